"""The request machine: edges, scope releases, the release order, exactly-once release."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from machine_helpers import (
    EXTRA_PATHS, ILLEGAL, LEGAL, ORDER, PATHS, S, drive, events, expected_held, finish_all, make_hooks, make_machine,
    step,
)
from states import DoubleRelease, FinishReason, IllegalTransition


class TestLegalEdges:
    @pytest.mark.parametrize("with_hooks", [False, True], ids=["no-hooks", "five-hooks"])
    @pytest.mark.parametrize(("src", "dst"), LEGAL, ids=lambda s: s.name)
    def test_edge_moves(self, src, dst, with_hooks):
        """Every edge of the table moves the request, logs it, and holds what the scopes say."""
        hooks = make_hooks() if with_hooks else {}
        machine = make_machine(hooks)
        req = drive(machine, PATHS[src])
        with capture_logs() as logs:
            step(machine, req, dst)
        assert req.state is dst and req.history[-1][0] is dst
        assert events(logs, "request.transition")[-1] == ("request.transition", src.name, dst.name)
        if with_hooks:
            assert set(req.handles) == set(expected_held(hooks, PATHS[src] + [dst]))
            assert {n for n, h in hooks.items() if h.held} == set(req.handles)
        finish_all(machine, req)

    def test_ordered_hooks_match_the_built_in_order(self):
        """The before/after declarations give moe, hisparse, kv, mm, timing."""
        assert list(make_hooks()) == ORDER

    def test_observers_see_every_transition(self):
        """Transition observers are called with (request, src, dst) after each move."""
        machine = make_machine()
        seen = []
        machine.transition_observers.append(lambda r, a, b: seen.append((r.request_id, a, b)))
        drive(machine, PATHS[S.RELEASED])
        path = PATHS[S.RELEASED]
        assert seen == [("r1", a, b) for a, b in zip(path, path[1:])]


class TestIllegalEdges:
    @pytest.mark.parametrize(("src", "dst"), ILLEGAL, ids=lambda s: s.name)
    def test_non_edge_raises_and_changes_nothing(self, src, dst):
        """A non-edge raises IllegalTransition naming request, src and dst; nothing moves."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, PATHS[src], rid="req-9")
        held = {n: h.held for n, h in hooks.items()}
        handles, history = dict(req.handles), list(req.history)
        if dst is S.FINISHED:  # finishing twice is idempotent, not an error
            assert machine.finish(req, FinishReason.STOP) is False
        else:
            with pytest.raises(IllegalTransition) as info:
                machine.try_release(req) if dst is S.RELEASED else machine.advance(req, dst)
            assert (info.value.request_id, info.value.src, info.value.dst) == ("req-9", src, dst)
            assert f"{src.name} -> {dst.name}" in str(info.value) and "req-9" in str(info.value)
        assert (req.state, req.handles, req.history) == (src, handles, history)
        assert {n: h.held for n, h in hooks.items()} == held
        finish_all(machine, req)

    @pytest.mark.parametrize("dst", [S.FINISHED, S.RELEASED], ids=lambda s: s.name)
    def test_advance_refuses_terminal_states(self, dst):
        """`advance` cannot finish or release: those go through finish and try_release."""
        machine = make_machine()
        req = drive(machine, PATHS[S.DECODING])
        with pytest.raises(IllegalTransition):
            machine.advance(req, dst)
        assert req.state is S.DECODING

    def test_start_twice_raises(self):
        """A request enters QUEUED by `start` once; re-queueing goes through RETRACTED."""
        machine = make_machine()
        req = drive(machine, PATHS[S.QUEUED])
        with pytest.raises(IllegalTransition):
            machine.start(req)


class TestScopeRelease:
    @pytest.mark.parametrize("src", [S.DECODING, S.STAGING], ids=lambda s: s.name)
    def test_retraction_releases_exactly_the_kv_scoped_hooks(self, src):
        """Preemption releases hisparse then kv, and keeps moe, mm and timing."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, PATHS[src])
        with capture_logs() as logs:
            machine.advance(req, S.RETRACTED)
        assert events(logs, "resource.released", "request.transition") == [
            ("resource.released", "hisparse"),
            ("resource.released", "kv"),
            ("request.transition", src.name, "RETRACTED"),
        ]
        assert set(req.handles) == {"moe", "mm", "timing"}
        assert {n: h.held for n, h in hooks.items()} == {"moe": 1, "hisparse": 0, "kv": 0, "mm": 1, "timing": 1}
        finish_all(machine, req)

    def test_requeued_request_reacquires(self):
        """After RETRACTED -> QUEUED, admission and PREBUILT acquire kv and hisparse again."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, EXTRA_PATHS["requeue-decode"])
        assert set(req.handles) == set(ORDER)
        assert all(h.held == 1 for h in hooks.values())
        finish_all(machine, req)

    @pytest.mark.parametrize(
        "path", list(PATHS.values())[:-1] + list(EXTRA_PATHS.values()),
        ids=[s.name for s in list(PATHS)[:-1]] + list(EXTRA_PATHS),
    )
    def test_release_from_every_state_runs_in_one_order(self, path):
        """Finish + try_release from anywhere releases everything held, in the one order."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, path)
        src = req.state
        held = expected_held(hooks, path)
        with capture_logs() as logs:
            machine.finish(req, FinishReason.ABORT)
            assert machine.try_release(req)
        expected = [] if src is S.FINISHED else [("request.transition", src.name, "FINISHED")]
        expected += [("resource.released", n) for n in held]
        expected += [("request.transition", "FINISHED", "RELEASED")]
        assert events(logs, "resource.released", "request.transition") == expected
        assert req.state is S.RELEASED and req.handles == {}
        assert all(h.held == 0 for h in hooks.values())


class TestExactlyOnce:
    def test_second_release_raises_and_leaves_the_pool(self):
        """Releasing a released handle raises DoubleRelease before the hook is reached."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, PATHS[S.FINISHED])
        handle = req.handles["kv"]
        assert machine.try_release(req)
        with pytest.raises(DoubleRelease):  # a buggy path hands the machine the handle again
            machine._release_handle(req, hooks["kv"], handle)
        assert (hooks["kv"].held, hooks["kv"].release_calls) == (0, 1)
        with pytest.raises(DoubleRelease):
            handle.mark_released()

    def test_finish_twice_releases_nothing(self):
        """A second finish returns False, keeps the first reason and releases nothing."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, PATHS[S.FINISHED])
        with capture_logs() as logs:
            assert machine.finish(req, FinishReason.STOP) is False
        assert logs == [] and req.finish_reason is FinishReason.ABORT
        finish_all(machine, req)

    def test_release_twice_raises(self):
        """try_release after RELEASED raises and releases nothing."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, PATHS[S.RELEASED])
        with capture_logs() as logs, pytest.raises(IllegalTransition):
            machine.try_release(req)
        assert logs == [] and all(h.release_calls == 1 for h in hooks.values())
