"""The request states, finish reasons, transition table and request record."""

from __future__ import annotations

import pytest

from states import (
    HELD_STATES,
    LIVE_STATES,
    TRANSITIONS,
    FinishReason,
    IllegalTransition,
    Request,
    RequestKind,
    RequestState,
)
from states.request_state import is_legal

S = RequestState

#: The lifecycle of docs/architecture.md, edge by edge.
EXPECTED_EDGES = {
    (S.QUEUED, S.PREFILLING), (S.QUEUED, S.TRANSFERRING), (S.QUEUED, S.FINISHED),
    (S.TRANSFERRING, S.PREBUILT), (S.TRANSFERRING, S.FINISHED),
    (S.PREFILLING, S.PREBUILT), (S.PREFILLING, S.FINISHED),
    (S.PREBUILT, S.STAGING), (S.PREBUILT, S.DECODING), (S.PREBUILT, S.FINISHED),
    (S.STAGING, S.DECODING), (S.STAGING, S.RETRACTED), (S.STAGING, S.FINISHED),
    (S.DECODING, S.RETRACTED), (S.DECODING, S.FINISHED),
    (S.RETRACTED, S.QUEUED), (S.RETRACTED, S.FINISHED),
    (S.FINISHED, S.RELEASED),
}


def _edges() -> set[tuple[RequestState, RequestState]]:
    return {(src, dst) for src, dsts in TRANSITIONS.items() for dst in dsts}


def _reachable_from(start: RequestState) -> set[RequestState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _make_request(**kw) -> Request:
    return Request(kw.pop("request_id", "r1"), kw.pop("prompt", [1, 2, 3]), None, **kw)


class TestTransitionTable:
    def test_edges_are_the_documented_lifecycle(self):
        """The table holds exactly the edges of the architecture diagram."""
        assert _edges() == EXPECTED_EDGES

    def test_every_state_has_a_row(self):
        """Every state, terminal ones included, has an entry in the table."""
        assert set(TRANSITIONS) == set(RequestState)

    @pytest.mark.parametrize("state", sorted(LIVE_STATES, key=lambda s: s.name))
    def test_every_live_state_can_finish(self, state):
        """Abort, error and shutdown can end a request from any state before FINISHED."""
        assert S.FINISHED in TRANSITIONS[state]

    def test_released_only_from_finished(self):
        """RELEASED is entered from FINISHED and nowhere else, and leads nowhere."""
        assert {src for src, dst in _edges() if dst is S.RELEASED} == {S.FINISHED}
        assert TRANSITIONS[S.RELEASED] == frozenset()
        assert TRANSITIONS[S.FINISHED] == frozenset({S.RELEASED})

    def test_every_state_is_reachable_and_can_reach_released(self):
        """No state is dead: all are reachable from QUEUED and all lead to RELEASED."""
        assert _reachable_from(S.QUEUED) == set(RequestState)
        assert all(S.RELEASED in _reachable_from(s) for s in RequestState)

    def test_no_self_loops(self):
        """A transition always changes the state."""
        assert all(src is not dst for src, dst in _edges())

    @pytest.mark.parametrize("src", list(RequestState), ids=lambda s: s.name)
    def test_is_legal_agrees_with_the_table(self, src):
        """`is_legal` is the table lookup."""
        assert {d for d in RequestState if is_legal(src, d)} == TRANSITIONS[src]


class TestStateSets:
    def test_live_states(self):
        """LIVE_STATES is every state before FINISHED."""
        assert LIVE_STATES == set(RequestState) - {S.FINISHED, S.RELEASED}

    def test_held_states(self):
        """HELD_STATES, the widest scope, is every state but RELEASED."""
        assert HELD_STATES == set(RequestState) - {S.RELEASED}


class TestFinishReason:
    def test_reasons(self):
        """The seven finish reasons; a health check is a request kind, not a reason."""
        assert {r.name for r in FinishReason} == {
            "STOP", "LENGTH", "ABORT", "ERROR", "TRANSFER_FAILED", "SHUTDOWN", "DEADLINE"
        }
        assert RequestKind.HEALTH_CHECK.name not in {r.name for r in FinishReason}

    def test_reprs_are_qualified(self):
        """Enum reprs name the enum, so log lines and errors are unambiguous."""
        assert repr(S.DECODING) == "RequestState.DECODING"
        assert repr(FinishReason.ABORT) == "FinishReason.ABORT"


class TestIllegalTransition:
    def test_carries_request_src_and_dst(self):
        """The exception keeps the request id and both states as attributes."""
        exc = IllegalTransition("req-7", S.QUEUED, S.DECODING)
        assert (exc.request_id, exc.src, exc.dst) == ("req-7", S.QUEUED, S.DECODING)

    def test_message_names_request_src_and_dst(self):
        """The message says which request tried which edge."""
        assert str(IllegalTransition("req-7", S.QUEUED, S.DECODING)) == (
            "request 'req-7': illegal transition QUEUED -> DECODING"
        )


class TestRequest:
    def test_fresh_request(self):
        """A new request is QUEUED, holds nothing, and has no reason or history."""
        req = _make_request()
        assert req.state is S.QUEUED
        assert (req.handles, req.fences, req.history) == ({}, [], [])
        assert req.finish_reason is None and req.kv_len == 0
        assert req.kind is RequestKind.NORMAL

    def test_token_counters(self):
        """The counters follow the prompt and the output list."""
        req = _make_request(prompt=[5, 6, 7])
        req.output_token_ids += [8, 9]
        assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 2, 5)
        assert req.all_token_ids == [5, 6, 7, 8, 9]

    def test_all_token_ids_is_a_copy(self):
        """Mutating `all_token_ids` never changes the prompt."""
        req = _make_request(prompt=[1, 2])
        req.all_token_ids.append(3)
        assert req.prompt_token_ids == [1, 2]

    @pytest.mark.parametrize("state", list(RequestState), ids=lambda s: s.name)
    def test_is_finished(self, state):
        """`is_finished` is true exactly in FINISHED and RELEASED."""
        req = _make_request()
        req.state = state
        assert req.is_finished is (state not in LIVE_STATES)

    def test_entered_at_returns_the_last_entry(self):
        """`entered_at` gives the latest time the request entered a state."""
        req = _make_request()
        req.history += [(S.QUEUED, 1.0), (S.PREFILLING, 2.0), (S.QUEUED, 3.0)]
        assert req.entered_at(S.QUEUED) == 3.0
        assert req.entered_at(S.PREFILLING) == 2.0
        assert req.entered_at(S.DECODING) is None

    def test_repr_names_id_state_and_reason(self):
        """The repr is enough to attribute a log line."""
        req = _make_request(request_id="abc")
        assert repr(req) == "Request('abc', QUEUED, reason=None)"
