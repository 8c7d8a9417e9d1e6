"""A runtime loop waiting on a transfer sleeps until the fence completes: the completing thread wakes it
(`engine.runtime.loop_waker`), nothing polls every 5 ms, and no wakeup is lost: with the safety poll
pushed past the test's deadline, a transfer landing, failing or missing its deadline still ends the
request, and every pool is whole after. Also the RESULT header carrying its run starts (protocol 4)."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import pytest
from structlog.testing import capture_logs

from engine import Engine, SamplingParams
from engine.disagg.link.wire import FAILED, HEADER_LEN, INLINE_RUNS, OK, inline_runs, result_frames
from engine.runtime import loop_waker
from engine.runtime.loop_waker import POLL, SAFETY_POLL, LoopWaker, fence_wait
from engine.testing import FaultInjector
from helpers import DEADLINE, Clock, run_all, small_config
from resources.fences import CopyFence, ManualFence
from states import FinishReason, Request

PROMPTS = [[9, 8, 7, 6, 5, 4, 3], list(range(100, 141)), list(range(30, 52))]


def _waiting_on(*fences) -> list[Request]:
    """A request holding `fences` (what the loop reads of it)."""
    request = Request("r", [1, 2, 3], SamplingParams())
    request.fences.extend(fences)
    return [request]


class TestFenceSignal:
    def test_complete_calls_each_waiter_once_from_the_completing_thread(self):
        """A waiter subscribed twice is called once, on the thread that completed the fence."""
        fence = ManualFence("kv_transfer", {"kv"})
        calls: list[tuple[str, int]] = []
        first = lambda: calls.append(("first", threading.get_ident()))  # noqa: E731
        assert fence.subscribe(first) and fence.subscribe(first)
        assert fence.subscribe(lambda: calls.append(("second", threading.get_ident())))
        thread = threading.Thread(target=fence.complete)
        thread.start()
        thread.join()
        assert sorted(name for name, _ in calls) == ["first", "second"]
        assert {tid for _, tid in calls} == {thread.ident}
        fence.complete()  # a second completion calls nobody again
        assert len(calls) == 2 and fence.done()

    def test_arming_calls_the_waiters(self):
        """Arming a fence moves its deadline: a loop sleeping on it is woken to sleep until the new one."""
        fence = ManualFence("kv_transfer", {"kv"}, armed=False)
        woken = []
        fence.subscribe(lambda: woken.append(True))
        fence.arm(5.0)
        assert woken == [True] and not fence.done() and fence.subscribe(lambda: None)

    def test_a_done_or_polled_fence_refuses_a_waiter(self):
        """Subscribing to a completed fence, or to one that is polled (a CUDA event), says False."""
        done = ManualFence("kv_transfer", {"kv"})
        done.complete()
        assert not done.subscribe(lambda: None)
        assert not CopyFence("kv_copy", {"kv"}, poll=lambda: False).subscribe(lambda: None)

    def test_a_waiter_that_raises_leaves_the_others_called(self):
        """A failing waiter is logged; the fence completes and the next waiter runs."""
        fence = ManualFence("kv_transfer", {"kv"})
        called = []
        fence.subscribe(lambda: 1 / 0)
        fence.subscribe(lambda: called.append(True))
        with capture_logs() as logs:
            fence.complete()
        assert fence.done() and called == [True]
        assert [e["event"] for e in logs] == ["fence.waiter_failed"]


class TestFenceWait:
    def test_only_signalling_fences_let_the_loop_sleep_long(self):
        """Pending ManualFences: sleep up to the safety poll; a polled fence or no fence at all: the
        short poll; the sleep never passes a fence's deadline."""
        clock = Clock(100.0)
        unarmed = ManualFence("kv_transfer", {"kv"}, armed=False)
        assert fence_wait(_waiting_on(unarmed), lambda: None, clock()) == SAFETY_POLL
        assert fence_wait(_waiting_on(), lambda: None, clock()) == POLL
        polled = CopyFence("kv_copy", {"kv"}, poll=lambda: False)
        assert fence_wait(_waiting_on(unarmed, polled), lambda: None, clock()) == POLL
        soon = ManualFence("kv_transfer", {"kv"}, timeout=0.05, clock=clock)
        assert fence_wait(_waiting_on(unarmed, soon), lambda: None, clock()) == pytest.approx(0.05)
        late = ManualFence("kv_transfer", {"kv"}, timeout=0.05, clock=clock)
        clock.now += 1
        assert fence_wait(_waiting_on(late), lambda: None, clock()) == 0.0

    def test_a_fence_completing_while_the_loop_subscribes_is_not_slept_through(self):
        """The fence completes between the loop's look and its subscription: no sleep at all."""

        class Racing(ManualFence):
            def subscribe(self, waiter):
                self.complete()
                return super().subscribe(waiter)

        assert fence_wait(_waiting_on(Racing("kv_transfer", {"kv"})), lambda: None, 0.0) == 0.0

    def test_a_fence_whose_subscribe_raises_is_polled(self):
        """A faulty fence (a plugin's) is polled and logged; the look never raises into the loop (a decode
        run's start subscribes too)."""

        class Faulty(ManualFence):
            def subscribe(self, waiter):
                raise RuntimeError("a faulty subscribe")

        with capture_logs() as logs:
            assert fence_wait(_waiting_on(Faulty("kv_transfer", {"kv"}, armed=False)), lambda: None, 0.0) == POLL
        assert any(entry["event"] == "fence.subscribe_failed" for entry in logs)

    def test_subscribes_the_waker_to_every_pending_fence(self):
        """Completing any pending fence calls the waker given to the loop's look."""
        fences = [ManualFence("kv_transfer", {"kv"}, armed=False) for _ in range(3)]
        woken = []
        fence_wait(_waiting_on(*fences), lambda: woken.append(True), 0.0)
        fences[1].complete()
        assert woken == [True]


class TestLoopWaker:
    @pytest.mark.parametrize("backend", ["asyncio", "trio"])
    def test_a_wake_from_another_thread_runs_on_the_loop(self, backend):
        """Called from a thread, the waker's wake runs on the loop's thread; a burst of calls costs at
        most one wake per call and at least one."""
        ran: list[int] = []

        async def main() -> None:
            woken = anyio.Event()

            def wake() -> None:
                ran.append(threading.get_ident())
                woken.set()

            waker = LoopWaker(wake)
            waker.bind(anyio.lowlevel.current_token())
            thread = threading.Thread(target=lambda: [waker() for _ in range(50)])
            thread.start()
            with anyio.fail_after(DEADLINE):
                await woken.wait()
            thread.join()
            await anyio.sleep(0)

        anyio.run(main, backend=backend)
        loop_thread = threading.get_ident()  # anyio.run runs the loop on this thread
        assert 1 <= len(ran) <= 50 and set(ran) == {loop_thread}

    def test_an_unbound_waker_does_nothing(self):
        """Before the loop runs (nothing bound) a fence completing calls a waker that does nothing."""
        calls = []
        LoopWaker(lambda: calls.append(True))()
        assert calls == []


class TestEngineWakes:
    """The decode role with its in-process prefill: the transfer fence is completed by the sending
    thread; the safety poll is pushed past the deadline, so only a wake can end each request in time."""

    @pytest.fixture(autouse=True)
    def _no_safety_poll(self, monkeypatch):
        monkeypatch.setattr(loop_waker, "SAFETY_POLL", 10 * DEADLINE)

    @pytest.mark.asyncio
    async def test_transfers_landing_while_the_loop_sleeps_wake_it(self):
        """Every request's KV lands and it decodes to the end; then both sides' pools are whole."""
        async with Engine(small_config(disaggregation="decode")) as engine:
            with anyio.fail_after(DEADLINE):
                outputs = await run_all(engine, PROMPTS, 4)
                await engine.wait_idle(DEADLINE)
            pools = engine.check_memory().pools
        assert [len(o) for o in outputs] == [4, 4, 4]
        assert pools["kv_pages"].held == 0 and pools["prefill.kv_pages"].held == 0

    @pytest.mark.asyncio
    async def test_a_failed_transfer_still_ends_its_request(self):
        """An injected transfer failure completes the fence with an error: TRANSFER_FAILED, the others
        finish, nothing held."""
        faults = FaultInjector(fail_transfer=lambda rid: rid == "doomed")
        async with Engine(small_config(disaggregation="decode"), faults=faults) as engine:
            with anyio.fail_after(DEADLINE):
                doomed = await engine.complete(PROMPTS[1], SamplingParams(max_new_tokens=4), request_id="doomed")
                fine = await engine.complete(PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
                await engine.wait_idle(DEADLINE)
            pools = engine.check_memory().pools
        assert doomed.finish_reason is FinishReason.TRANSFER_FAILED and len(fine.token_ids) == 4
        assert pools["kv_pages"].held == 0 and pools["prefill.kv_pages"].held == 0

    @pytest.mark.asyncio
    async def test_a_fence_that_never_completes_is_failed_at_its_deadline(self):
        """A stuck copy never signals: the loop still wakes at the fence's deadline, fails the request
        (its pages quarantined), and releases them once the copy lands late."""
        faults = FaultInjector(stuck_fences={"kv_transfer"})
        async with Engine(small_config(disaggregation="decode", fence_timeout=0.3), faults=faults) as engine:
            with anyio.fail_after(DEADLINE):
                final = await engine.complete(PROMPTS[0], SamplingParams(max_new_tokens=4), request_id="stuck")
                assert final.finish_reason is FinishReason.TRANSFER_FAILED
                faults.unstick()
                await engine.wait_idle(DEADLINE)
                while engine.check_memory().pools["kv_pages"].held:  # the quarantine is reaped on its poll
                    await anyio.sleep(0.01)
            pools = engine.check_memory().pools
        assert pools["kv_pages"].held == 0 and pools["prefill.kv_pages"].held == 0


class TestResultRuns:
    """Protocol 4: a RESULT's run starts ride in its header when they fit (no message of their own)."""

    @pytest.mark.parametrize("runs", [None, [], [0], list(range(0, 4 * INLINE_RUNS, 4))],
                             ids=["staged", "none", "one", "all-inline"])
    def test_run_starts_that_fit_ride_in_the_header(self, runs):
        """Up to INLINE_RUNS starts: one message, and the decode reads them back from the header."""
        frames = result_frames(7, OK, 42, b"", b"", runs)
        assert len(frames) == 1 and frames[0].shape == (HEADER_LEN,)
        assert inline_runs(frames[0].tolist()) == (runs or [])

    def test_more_run_starts_travel_after_the_header(self):
        """One start more than fits: the header says how many, and they follow in a message of their own,
        after the reason."""
        runs = list(range(0, 4 * (INLINE_RUNS + 1), 4))
        frames = result_frames(7, FAILED, 0, b"why", b"", runs)
        assert len(frames) == 3 and inline_runs(frames[0].tolist()) is None
        assert frames[0].tolist()[6] == len(runs) and frames[2].tolist() == runs
