"""The request machine under faults: failing releases, refused acquisitions, fences and quarantine."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from helpers import Clock
from machine_helpers import (
    KV_SCOPE, LEGAL, ORDER, PATHS, S, CountingHook, drive, events, finish_all, make_hooks, make_machine,
)
from resources import ManualFence, ResourceExhausted
from resources.ledger import Ledger
from states import FencePending, FinishReason, Handle, Request


class TestFailingRelease:
    @pytest.mark.parametrize("broken", ORDER)
    def test_a_raising_hook_does_not_stop_the_others(self, broken):
        """The error is logged, later hooks still run and the request reaches RELEASED."""
        hooks = make_hooks()
        ledger = Ledger()
        machine = make_machine(hooks, ledger=ledger)
        req = drive(machine, PATHS[S.DECODING])
        hooks[broken].fail_release = True
        with capture_logs() as logs:
            machine.finish(req, FinishReason.ERROR)
            machine.try_release(req)
        assert req.state is S.RELEASED and req.handles == {}
        assert events(logs, "resource.released", "resource.release_failed") == [
            ("resource.release_failed" if n == broken else "resource.released", n) for n in ORDER
        ]
        assert next(e for e in logs if e["event"] == "resource.release_failed")["log_level"] == "error"
        assert ledger.suspect == {broken} and ledger.num_tracked_requests == 0
        assert {n: h.held for n, h in hooks.items()} == {n: int(n == broken) for n in ORDER}


class TestRollback:
    @pytest.mark.parametrize(
        ("src", "dst"), [e for e in LEGAL if e[1] not in (S.FINISHED, S.RELEASED)], ids=lambda s: s.name
    )
    def test_failed_acquisition_leaves_the_request_where_it_was(self, src, dst):
        """A hook raising ResourceExhausted undoes this transition's acquisitions; nothing moves."""
        hooks = make_hooks()
        hooks["extra"] = CountingHook("extra", {dst}, {dst})  # acquired first: released last
        hooks["full"] = CountingHook("full", {dst}, {dst})
        hooks = {n: hooks[n] for n in ["full", *ORDER, "extra"]}
        machine = make_machine(hooks)
        req = drive(machine, PATHS[src])
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
        finish_all(machine, req)

    def test_failed_start_holds_nothing(self):
        """If an acquisition on entering QUEUED fails, no handle is kept and start can be retried."""
        hooks = make_hooks()
        hooks["moe"].fail_acquire = ResourceExhausted("no expert record")
        machine = make_machine(hooks)
        req = Request("r1", [1], None)
        with pytest.raises(ResourceExhausted):
            machine.start(req)
        assert req.handles == {} and req.history == [] and all(h.held == 0 for h in hooks.values())
        hooks["moe"].fail_acquire = None
        machine.start(req)
        finish_all(machine, req)


class TestFences:
    def _setup(self, *, timeout=5.0, kv_scope=None):
        clock = Clock(100.0)
        hooks = make_hooks()
        if kv_scope is not None:  # declarations are fixed when the machine is built
            hooks["kv"].scope = kv_scope
        machine = make_machine(hooks, clock=clock)
        req = drive(machine, PATHS[S.DECODING])
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
        assert req.fences == [] and machine.quarantined == []
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
        assert [q.handle for q in machine.quarantined] == [handle] and handle.status == Handle.QUARANTINED
        assert {n: h.held for n, h in hooks.items()} == {n: int(n == "kv") for n in ORDER}
        quarantined = [e for e in logs if e["event"] == "resource.quarantined"]
        assert [(e["resource"], e["fence"]) for e in quarantined] == [("kv", "kv_transfer")]
        assert ("resource.released", "kv") not in events(logs, "resource.released")
        fence.complete()  # the late copy lands after all: the handle is released then, once
        with capture_logs() as logs:
            assert machine.reap_quarantine() == 1 and machine.reap_quarantine() == 0
        assert handle.status == Handle.RELEASED and hooks["kv"].held == 0 and machine.quarantined == []
        assert [(e["resource"], e["after_quarantine"]) for e in logs] == [("kv", True)]

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
        finish_all(machine, req)

    def test_pending_fence_on_a_kept_handle_does_not_block(self):
        """A fence only blocks transitions that free what it protects."""
        _, hooks, machine, req, fence = self._setup()
        req.fences[:] = [ManualFence("expert_copy", {"moe"})]
        machine.advance(req, S.RETRACTED)
        assert "moe" in req.handles
        req.fences[0].complete()
        finish_all(machine, req)

    def test_finish_is_never_refused_and_keeps_fenced_memory(self):
        """Finishing always succeeds; a fenced handle outside FINISHED's scope stays held until RELEASED."""
        _, hooks, machine, req, fence = self._setup(kv_scope=KV_SCOPE - {S.FINISHED})
        assert machine.finish(req, FinishReason.ABORT, error=RuntimeError("x"))
        assert req.state is S.FINISHED and "kv" in req.handles and hooks["kv"].held == 1
        assert machine.try_release(req) is False
        fence.complete()
        assert machine.try_release(req) and hooks["kv"].held == 0


class _Interrupt(BaseException):
    """Stands for a cancellation or KeyboardInterrupt arriving inside a hook."""


class TestBaseException:
    def test_an_interrupt_in_a_release_still_finishes_the_sequence(self):
        """A BaseException in a release is re-raised only after every hook ran and RELEASED was reached (item 5)."""
        hooks = make_hooks()
        ledger = Ledger()
        machine = make_machine(hooks, ledger=ledger)
        req = drive(machine, PATHS[S.FINISHED])

        def interrupted(request, handle):
            hooks["kv"].held -= 1
            raise _Interrupt

        hooks["kv"].release = interrupted
        with pytest.raises(_Interrupt):
            machine.try_release(req)
        assert req.state is S.RELEASED and req.handles == {}
        assert all(h.held == 0 for h in hooks.values()) and ledger.num_tracked_requests == 0

    def test_an_interrupt_in_an_acquisition_rolls_back(self):
        """A BaseException during an acquisition releases what the move took and leaves the request put."""
        hooks = make_hooks()
        machine = make_machine(hooks)
        req = drive(machine, PATHS[S.QUEUED])
        hooks["kv"].fail_acquire = _Interrupt()
        with pytest.raises(_Interrupt):
            machine.advance(req, S.PREFILLING)
        assert req.state is S.QUEUED and set(req.handles) == {"moe", "mm", "timing"}
        hooks["kv"].fail_acquire = None
        finish_all(machine, req)

    def test_an_observer_that_raises_is_only_logged(self):
        """A transition observer cannot refuse or stop a move."""
        machine = make_machine(make_hooks())
        machine.transition_observers.append(lambda r, a, b: 1 / 0)
        with capture_logs() as logs:
            req = drive(machine, PATHS[S.RELEASED])
        assert req.state is S.RELEASED
        assert {e["event"] for e in logs if e["log_level"] == "error"} == {"machine.observer_failed"}


def test_an_acquire_that_returns_no_handle_is_refused_cleanly():
    """A hook returning something other than a Handle raises a TypeError naming it; the move rolls back."""
    hooks = make_hooks()
    machine = make_machine(hooks)
    req = drive(machine, PATHS[S.QUEUED])
    hooks["kv"].acquire = lambda request, into: {"pages": [1]}
    with pytest.raises(TypeError, match="hook 'kv': acquire returned dict"):
        machine.advance(req, S.PREFILLING)
    assert req.state is S.QUEUED and "kv" not in req.handles and hooks["mm"].held == 1
    finish_all(machine, req)
