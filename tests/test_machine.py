"""The request machine: edges, scope releases, release order, rollback, fences."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from resources import ManualFence, ResourceExhausted, ResourceHook, order_hooks
from states import (
    HELD_STATES,
    TRANSITIONS,
    DoubleRelease,
    FencePending,
    FinishReason,
    Handle,
    IllegalTransition,
    Request,
    RequestMachine,
    RequestState,
)

S = RequestState
KV_SCOPE = frozenset({S.TRANSFERRING, S.PREFILLING, S.PREBUILT, S.STAGING, S.DECODING, S.FINISHED})
#: The built-in release order of docs/architecture.md.
ORDER = ["moe", "hisparse", "kv", "mm", "timing"]

#: One way to reach each state from QUEUED, plus the other ways to reach RELEASED.
PATHS = {
    S.QUEUED: [S.QUEUED],
    S.TRANSFERRING: [S.QUEUED, S.TRANSFERRING],
    S.PREFILLING: [S.QUEUED, S.PREFILLING],
    S.PREBUILT: [S.QUEUED, S.PREFILLING, S.PREBUILT],
    S.STAGING: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.STAGING],
    S.DECODING: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING],
    S.RETRACTED: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.RETRACTED],
    S.FINISHED: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.FINISHED],
    S.RELEASED: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.FINISHED, S.RELEASED],
}
EXTRA_PATHS = {
    "transfer-prebuilt": [S.QUEUED, S.TRANSFERRING, S.PREBUILT],
    "staging-decoding": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.STAGING, S.DECODING],
    "staging-retracted": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.STAGING, S.RETRACTED],
    "retract-requeue": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.RETRACTED, S.QUEUED],
    "requeue-decode": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.RETRACTED, S.QUEUED,
                       S.PREFILLING, S.PREBUILT, S.DECODING],
}
LEGAL = sorted(((a, b) for a, bs in TRANSITIONS.items() for b in bs), key=lambda e: (e[0].name, e[1].name))
ILLEGAL = [(a, b) for a in RequestState for b in RequestState if b not in TRANSITIONS[a]]




class _Hook(ResourceHook):
    """A hook whose pool is a counter of handles out."""

    def __init__(self, name, acquire_on, scope=HELD_STATES, *, before=(), after=()) -> None:
        super().__init__()
        self.name, self.pool = name, name
        self.acquire_on, self.scope = frozenset(acquire_on), frozenset(scope)
        self.before, self.after = tuple(before), tuple(after)
        self.held = 0
        self.release_calls = 0
        self.fail_acquire: Exception | None = None
        self.fail_release = False

    def acquire(self, request, into):
        if self.fail_acquire is not None:
            raise self.fail_acquire
        self.held += 1
        return Handle(self.name, request.request_id, amount=1)

    def release(self, request, handle):
        self.release_calls += 1
        if self.fail_release:
            raise RuntimeError(f"{self.name} release broke")
        self.held -= 1


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _make_hooks() -> dict[str, _Hook]:
    """Five hooks shaped like the built-ins, registered out of order; ordered by constraints."""
    hooks = [
        _Hook("timing", {S.QUEUED}, after=("mm",)),
        _Hook("kv", {S.PREFILLING, S.TRANSFERRING}, KV_SCOPE),
        _Hook("mm", {S.QUEUED}, after=("kv",)),
        _Hook("hisparse", {S.PREBUILT}, KV_SCOPE - {S.TRANSFERRING, S.PREFILLING}, before=("kv",)),
        _Hook("moe", {S.QUEUED}, before=("hisparse",)),
    ]
    return {h.name: h for h in order_hooks(hooks)}


def _make_machine(hooks=None, **kw) -> RequestMachine:
    return RequestMachine(list((hooks or {}).values()), **kw)


def _step(machine: RequestMachine, req: Request, dst: RequestState) -> None:
    if dst is S.FINISHED:
        assert machine.finish(req, FinishReason.ABORT)
    elif dst is S.RELEASED:
        assert machine.try_release(req)
    else:
        machine.advance(req, dst)


def _drive(machine: RequestMachine, path: list[RequestState], rid: str = "r1") -> Request:
    req = Request(rid, [1, 2, 3], None)
    machine.start(req)
    for dst in path[1:]:
        _step(machine, req, dst)
    assert req.state is path[-1]
    return req


def _expected_held(hooks: dict[str, _Hook], path: list[RequestState]) -> list[str]:
    held: set[str] = set()
    for state in path:
        held = {n for n in held if state in hooks[n].scope}
        held |= {n for n, h in hooks.items() if state in h.acquire_on}
    return [n for n in ORDER if n in held]


def _events(logs, *names) -> list[tuple]:
    return [
        (e["event"], e["src"], e["dst"]) if e["event"] == "request.transition" else (e["event"], e["resource"])
        for e in logs
        if e["event"] in names
    ]


def _finish_all(machine: RequestMachine, req: Request) -> None:
    if req.state is not S.RELEASED:
        machine.finish(req, FinishReason.SHUTDOWN)
        machine.try_release(req)


class TestLegalEdges:
    @pytest.mark.parametrize("with_hooks", [False, True], ids=["no-hooks", "five-hooks"])
    @pytest.mark.parametrize(("src", "dst"), LEGAL, ids=lambda s: s.name)
    def test_edge_moves(self, src, dst, with_hooks):
        """Every edge of the table moves the request, logs it, and holds what the scopes say."""
        hooks = _make_hooks() if with_hooks else {}
        machine = _make_machine(hooks)
        req = _drive(machine, PATHS[src])
        with capture_logs() as logs:
            _step(machine, req, dst)
        assert req.state is dst and req.history[-1][0] is dst
        assert _events(logs, "request.transition")[-1] == ("request.transition", src.name, dst.name)
        if with_hooks:
            assert set(req.handles) == set(_expected_held(hooks, PATHS[src] + [dst]))
            assert {n for n, h in hooks.items() if h.held} == set(req.handles)
        _finish_all(machine, req)

    def test_ordered_hooks_match_the_built_in_order(self):
        """The before/after declarations give moe, hisparse, kv, mm, timing."""
        assert list(_make_hooks()) == ORDER

    def test_observers_see_every_transition(self):
        """Transition observers are called with (request, src, dst) after each move."""
        machine = _make_machine()
        seen = []
        machine.transition_observers.append(lambda r, a, b: seen.append((r.request_id, a, b)))
        _drive(machine, PATHS[S.RELEASED])
        path = PATHS[S.RELEASED]
        assert seen == [("r1", a, b) for a, b in zip(path, path[1:])]


class TestIllegalEdges:
    @pytest.mark.parametrize(("src", "dst"), ILLEGAL, ids=lambda s: s.name)
    def test_non_edge_raises_and_changes_nothing(self, src, dst):
        """A non-edge raises IllegalTransition naming request, src and dst; nothing moves."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        req = _drive(machine, PATHS[src], rid="req-9")
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
        _finish_all(machine, req)

    @pytest.mark.parametrize("dst", [S.FINISHED, S.RELEASED], ids=lambda s: s.name)
    def test_advance_refuses_terminal_states(self, dst):
        """`advance` cannot finish or release: those go through finish and try_release."""
        machine = _make_machine()
        req = _drive(machine, PATHS[S.DECODING])
        with pytest.raises(IllegalTransition):
            machine.advance(req, dst)
        assert req.state is S.DECODING

    def test_start_twice_raises(self):
        """A request enters QUEUED by `start` once; re-queueing goes through RETRACTED."""
        machine = _make_machine()
        req = _drive(machine, PATHS[S.QUEUED])
        with pytest.raises(IllegalTransition):
            machine.start(req)


class TestScopeRelease:
    @pytest.mark.parametrize("src", [S.DECODING, S.STAGING], ids=lambda s: s.name)
    def test_retraction_releases_exactly_the_kv_scoped_hooks(self, src):
        """Preemption releases hisparse then kv, and keeps moe, mm and timing."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        req = _drive(machine, PATHS[src])
        with capture_logs() as logs:
            machine.advance(req, S.RETRACTED)
        assert _events(logs, "resource.released", "request.transition") == [
            ("resource.released", "hisparse"),
            ("resource.released", "kv"),
            ("request.transition", src.name, "RETRACTED"),
        ]
        assert set(req.handles) == {"moe", "mm", "timing"}
        assert {n: h.held for n, h in hooks.items()} == {"moe": 1, "hisparse": 0, "kv": 0, "mm": 1, "timing": 1}
        _finish_all(machine, req)

    def test_requeued_request_reacquires(self):
        """After RETRACTED -> QUEUED, admission and PREBUILT acquire kv and hisparse again."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        req = _drive(machine, EXTRA_PATHS["requeue-decode"])
        assert set(req.handles) == set(ORDER)
        assert all(h.held == 1 for h in hooks.values())
        _finish_all(machine, req)

    @pytest.mark.parametrize(
        "path", list(PATHS.values())[:-1] + list(EXTRA_PATHS.values()),
        ids=[s.name for s in list(PATHS)[:-1]] + list(EXTRA_PATHS),
    )
    def test_release_from_every_state_runs_in_one_order(self, path):
        """Finish + try_release from anywhere releases everything held, in the one order."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        req = _drive(machine, path)
        src = req.state
        held = _expected_held(hooks, path)
        with capture_logs() as logs:
            machine.finish(req, FinishReason.ABORT)
            assert machine.try_release(req)
        expected = [] if src is S.FINISHED else [("request.transition", src.name, "FINISHED")]
        expected += [("resource.released", n) for n in held]
        expected += [("request.transition", "FINISHED", "RELEASED")]
        assert _events(logs, "resource.released", "request.transition") == expected
        assert req.state is S.RELEASED and req.handles == {}
        assert all(h.held == 0 for h in hooks.values())


class TestExactlyOnce:
    def test_second_release_raises_and_leaves_the_pool(self):
        """Releasing a released handle raises DoubleRelease before the hook is reached."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        req = _drive(machine, PATHS[S.FINISHED])
        handle = req.handles["kv"]
        assert machine.try_release(req)
        req.handles["kv"] = handle  # a buggy path hands the machine the handle again
        with pytest.raises(DoubleRelease):
            machine._release(req, hooks["kv"])
        assert (hooks["kv"].held, hooks["kv"].release_calls) == (0, 1)
        with pytest.raises(DoubleRelease):
            handle.mark_released()

    def test_finish_twice_releases_nothing(self):
        """A second finish returns False, keeps the first reason and releases nothing."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        req = _drive(machine, PATHS[S.FINISHED])
        with capture_logs() as logs:
            assert machine.finish(req, FinishReason.STOP) is False
        assert logs == [] and req.finish_reason is FinishReason.ABORT
        _finish_all(machine, req)

    def test_release_twice_raises(self):
        """try_release after RELEASED raises and releases nothing."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        req = _drive(machine, PATHS[S.RELEASED])
        with capture_logs() as logs, pytest.raises(IllegalTransition):
            machine.try_release(req)
        assert logs == [] and all(h.release_calls == 1 for h in hooks.values())


class TestFailingRelease:
    @pytest.mark.parametrize("broken", ORDER)
    def test_a_raising_hook_does_not_stop_the_others(self, broken):
        """The error is logged, later hooks still run and the request reaches RELEASED."""
        hooks = _make_hooks()
        machine = _make_machine(hooks)
        failures = []
        machine.release_error_observers.append(lambda h, r, e: failures.append((h.name, r.request_id)))
        req = _drive(machine, PATHS[S.DECODING])
        hooks[broken].fail_release = True
        with capture_logs() as logs:
            machine.finish(req, FinishReason.ERROR)
            machine.try_release(req)
        assert req.state is S.RELEASED and req.handles == {}
        assert _events(logs, "resource.released", "resource.release_failed") == [
            ("resource.release_failed" if n == broken else "resource.released", n) for n in ORDER
        ]
        assert next(e for e in logs if e["event"] == "resource.release_failed")["log_level"] == "error"
        assert failures == [(broken, "r1")]
        assert {n: h.held for n, h in hooks.items()} == {n: int(n == broken) for n in ORDER}


class TestRollback:
    @pytest.mark.parametrize(
        ("src", "dst"), [e for e in LEGAL if e[1] not in (S.FINISHED, S.RELEASED)], ids=lambda s: s.name
    )
    def test_failed_acquisition_leaves_the_request_where_it_was(self, src, dst):
        """A hook raising ResourceExhausted undoes this transition's acquisitions; nothing moves."""
        hooks = _make_hooks()
        hooks["extra"] = _Hook("extra", {dst}, {dst})  # acquired first: released last
        hooks["full"] = _Hook("full", {dst}, {dst})
        hooks = {n: hooks[n] for n in ["full", *ORDER, "extra"]}
        machine = _make_machine(hooks)
        req = _drive(machine, PATHS[src])
        hooks["full"].fail_acquire = ResourceExhausted("pool full")
        held = {n: h.held for n, h in hooks.items()}
        handles, history = dict(req.handles), list(req.history)
        with pytest.raises(ResourceExhausted):
            machine.advance(req, dst)
        assert (req.state, req.handles, req.history) == (src, handles, history)
        assert {n: h.held for n, h in hooks.items()} == held
        hooks["full"].fail_acquire = None
        machine.advance(req, dst)  # room again: the same move now succeeds
        assert hooks["full"].held == hooks["extra"].held == 1
        _finish_all(machine, req)

    def test_failed_start_holds_nothing(self):
        """If an acquisition on entering QUEUED fails, no handle is kept and start can be retried."""
        hooks = _make_hooks()
        hooks["moe"].fail_acquire = ResourceExhausted("no expert record")
        machine = _make_machine(hooks)
        req = Request("r1", [1], None)
        with pytest.raises(ResourceExhausted):
            machine.start(req)
        assert req.handles == {} and req.history == [] and all(h.held == 0 for h in hooks.values())
        hooks["moe"].fail_acquire = None
        machine.start(req)
        _finish_all(machine, req)


class TestFences:
    def _setup(self, *, timeout=5.0):
        clock = _Clock()
        hooks = _make_hooks()
        machine = _make_machine(hooks, clock=clock)
        req = _drive(machine, PATHS[S.DECODING])
        fence = ManualFence("kv_transfer", {"kv"}, timeout=timeout, clock=clock)
        req.fences.append(fence)
        return clock, hooks, machine, req, fence

    def test_release_waits_for_a_fence_that_meets_its_deadline(self):
        """try_release is False while the fence runs, True once it completes; nothing quarantined."""
        clock, hooks, machine, req, fence = self._setup()
        machine.finish(req, FinishReason.STOP)
        clock.now += 4.9
        with capture_logs() as logs:
            assert machine.try_release(req) is False
        assert logs == [] and req.state is S.FINISHED and len(req.handles) == 5
        fence.complete()
        assert machine.try_release(req) is True
        assert req.fences == [] and hooks["kv"].quarantined == []
        assert all(h.held == 0 for h in hooks.values())

    def test_a_fence_past_its_deadline_quarantines_its_handles(self):
        """The protected handle is kept and quarantined; every other handle is released."""
        clock, hooks, machine, req, fence = self._setup()
        handle = req.handles["kv"]
        machine.finish(req, FinishReason.TRANSFER_FAILED)
        clock.now += 5.1
        with capture_logs() as logs:
            assert machine.try_release(req) is True
        assert req.state is S.RELEASED and req.handles == {}
        assert hooks["kv"].quarantined == [handle] and handle.status == Handle.QUARANTINED
        assert {n: h.held for n, h in hooks.items()} == {n: int(n == "kv") for n in ORDER}
        quarantined = [e for e in logs if e["event"] == "resource.quarantined"]
        assert [(e["resource"], e["fence"]) for e in quarantined] == [("kv", "kv_transfer")]
        assert ("resource.released", "kv") not in _events(logs, "resource.released")

    def test_pending_fence_blocks_a_transition_that_would_free_its_memory(self):
        """DECODING -> RETRACTED with a running fence on kv raises FencePending and releases nothing."""
        _, hooks, machine, req, fence = self._setup()
        with pytest.raises(FencePending, match="kv_transfer"):
            machine.advance(req, S.RETRACTED)
        assert req.state is S.DECODING and set(req.handles) == set(ORDER)
        assert all(h.held == 1 for h in hooks.values())
        fence.complete()
        machine.advance(req, S.RETRACTED)
        assert "kv" not in req.handles
        _finish_all(machine, req)

    def test_pending_fence_on_a_kept_handle_does_not_block(self):
        """A fence only blocks transitions that free what it protects."""
        _, hooks, machine, req, fence = self._setup()
        req.fences[:] = [ManualFence("expert_copy", {"moe"})]
        machine.advance(req, S.RETRACTED)
        assert "moe" in req.handles
        req.fences[0].complete()
        _finish_all(machine, req)

    def test_failed_finish_keeps_no_finish_reason(self):
        """A finish refused by FencePending leaves the request live, with no reason set."""
        _, hooks, machine, req, fence = self._setup()
        hooks["kv"].scope = KV_SCOPE - {S.FINISHED}
        with pytest.raises(FencePending):
            machine.finish(req, FinishReason.ABORT, error=RuntimeError("x"))
        assert req.state is S.DECODING and req.finish_reason is None and req.error is None
        fence.complete()
        _finish_all(machine, req)
