"""The runtime loop: one task that moves every request of one runtime, one
iteration at a time, in every role (a single engine, the decode role, and
the prefill role that `engine.runtime.prefill_runtime` wraps for the
in-process decode role and for `PrefillServer`).

Its interface is narrow: `submit` (requests in, a stream out), `abort`,
`abandon`, `wait_idle`, `shutdown`, `run`. Each iteration::

    intake (gateway): start submitted requests (QUEUED), apply aborts
    -> release (gateway): finished requests whose fences are done, and
       quarantined handles whose fences completed late
    -> plan (planner): landed transfers, retried moves, admission,
       growth/retraction, the batch; with none, it sleeps until a fence
       it waits on completes (the completing thread wakes it:
       `engine.runtime.loop_waker`), polling only what cannot signal
    -> run the model step (on the loop's step thread unless it is small:
       `engine.runtime.step_thread`), or a decode run (`decode_runs`)
    -> apply (step applier): progress, tokens, outputs, finishes
    -> the leak check when idle, and every second while busy
       (`resources.leak_watch`: logged and counted, never raised here);
       while a quarantined handle or a prefill client's job is left, it
       polls, so a late fence is reaped with no new request; deadlines and
       session leases (issue 21) bound its waits, so they are seen without
       traffic

NOTE: requests in a running step are never transitioned while it runs: the
loop is the only task that transitions, and it is awaiting the step. That is
the in-flight-model-step fence, by construction. Submissions and aborts that
arrive meanwhile are applied after the step.

If an iteration itself raises (a bug, not a hook: hooks are isolated by the
machine), the loop is dead: every open stream ends with `EngineDead`, new
submissions raise it, and `errored` holds the cause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
import structlog

from engine.errors import EngineClosed, EngineDead, EngineOverloaded
from engine.runtime.deadlines import DeadlineTimer
from engine.runtime.decode_runs import DecodeRuns
from engine.runtime.gateway import RequestGateway
from engine.runtime.inline_rule import InlineRule
from engine.runtime.loop_waker import LoopWaker, fence_wait
from engine.runtime.output_builder import OutputBuilder
from engine.runtime.output_sender import OutputSender
from engine.runtime.planner import Planner
from engine.runtime.sessions import SessionManager
from engine.runtime.stats import EngineStats
from engine.runtime.step_thread import StepThread
from engine.runtime.step_applier import StepApplier, StepObserver
from engine.runtime.table import OutputSink, RequestTable, Submission, close_stream
from engine.stream import OutputChannel, RequestStream
from resources.leak_watch import LeakWatch
from resources.ledger import MemoryReport
from states import FinishReason, Request, RequestState

if TYPE_CHECKING:
    from engine.model.step_types import StepOutput
    from engine.model.tokenizer import Tokenizer
    from engine.runtime.parts import EngineParts

S = RequestState
log = structlog.get_logger("kvlife.loop")


class RuntimeLoop:
    def __init__(self, parts: EngineParts, *, tokenizer: Tokenizer, max_context: int,
                 check_memory: Callable[[], MemoryReport], memory_report: Callable[[], MemoryReport]) -> None:
        config = parts.config
        self.machine = parts.machine
        self.runner = parts.runner
        self.role = parts.role
        self.prefill_client = parts.prefill_client
        self.leak_check = config.leak_check
        self.max_queued = config.max_queued
        self.speculative = config.speculative is not None
        self.admission_window = config.admission_window
        # NOTE: an injected stall must block the step thread, never the event loop
        faults = parts.runner.faults is not None
        self.inline = InlineRule(0 if faults else config.inline_step_tokens,
                                 0.0 if faults or parts.device.type != "cpu" else config.inline_step_ms / 1e3)
        self._kv_slots = parts.kv_pool.slots
        self._prefix_locks = parts.kv_pool.prefix_locks
        self.tokenizer = tokenizer
        self._check_memory = check_memory
        self.stats = EngineStats()
        self.leak_watch = LeakWatch(memory_report, enabled=config.leak_check != "off", counters=self.stats)
        self.machine.transition_observers.append(self.stats.on_transition)
        self.table = RequestTable()
        self.outputs = OutputSender(self.table)
        self.gateway = RequestGateway(machine=self.machine, table=self.table, outputs=self.outputs)
        self.applier = StepApplier(gateway=self.gateway, outputs=self.outputs, table=self.table, stats=self.stats,
                                   role=parts.role, stop_ids=frozenset(parts.model_config.stop_token_ids),
                                   max_context=max_context)
        self.applier.step_observers.extend(parts.step_observers)
        self.applier.token_checks.extend(parts.token_checks)
        self.planner = Planner(gateway=self.gateway, applier=self.applier, table=self.table, stats=self.stats,
                               scheduler=parts.scheduler, kv_pool=parts.kv_pool, role=parts.role,
                               starvation_timeout=config.starvation_timeout, clock=self.machine.clock,
                               report=self.leak_watch.check_now, max_context=max_context,
                               draft_tokens=config.speculative.num_tokens if config.speculative else 0)
        self.runs = DecodeRuns(gateway=self.gateway, table=self.table, stats=self.stats, max_context=max_context,
                               steps=1 if self.speculative else config.decode_steps, woken=lambda: self._wake.is_set(),
                               watch=lambda: fence_wait(self.table.requests(), self.waker, self.machine.clock()))
        # issue 21: deadlines and sessions, both seen on a timer even without traffic
        self.deadlines = DeadlineTimer()
        self.sessions = SessionManager(parts.sessions, self.gateway, max_context=max_context,
                                       idle_timeout=config.session_idle_timeout, max_pages=config.session_max_pages,
                                       clock=self.machine.clock)
        self.gateway.release_observers.extend((self.planner.forget_starved, self.deadlines.discard,
                                               self.sessions.on_released))
        self.errored: BaseException | None = None
        self.step_running = False
        self.closing = False
        self._wake = anyio.Event()
        #: wakes the loop from the threads that complete fences (`engine.runtime.loop_waker`)
        self.waker = LoopWaker(self.wake)
        #: where steps larger than `inline_step_tokens` run (`engine.runtime.step_thread`)
        self.step_thread = StepThread()
        self._idle_event = anyio.Event()
        self._idle_event.set()
        self._thread: int | None = None
        self._held = 0  # requests submitted held (their grammar compiles): they count as queued

    # ------------------------------------------------------------ interface
    def submit(self, request_id: str, requests: Sequence[Request], *, held: bool = False) -> RequestStream:
        """Hand requests over; the returned stream carries their outputs. `held`: they are live
        (their id is taken, abort and shutdown finish them) but start only at `start_held`."""
        channel = OutputChannel()
        submission = self.submit_to(request_id, requests, channel, held=held)
        return RequestStream(request_id, channel, lambda: self.abandon(submission), n=len(requests))

    def submit_to(self, request_id: str, requests: Sequence[Request], sink: OutputSink | None, *,
                  held: bool = False) -> Submission:
        """Hand requests over with their outputs going to `sink` (None: nobody streams them, as
        for the prefill role's jobs, which their hooks answer); returns the submission."""
        if self.errored is not None:
            raise EngineDead(self.errored)
        if self.closing:
            raise EngineClosed("the engine is shutting down")
        queued = len(self.table.unstarted) + len(self.table.waiting) + self._held
        if queued + len(requests) > self.max_queued:
            raise EngineOverloaded(f"{queued} requests already queued (max_queued = {self.max_queued})")
        submission = Submission(request_id, list(requests), sink,
                                {r: OutputBuilder(r, self.tokenizer, index=i, request_id=request_id,
                                                  speculative=self.speculative)
                                 for i, r in enumerate(requests)})
        self.table.add(submission, start=not held)
        self._held += len(requests) if held else 0
        for request in requests:  # issue 21
            self.deadlines.add(request)
            self.sessions.bind(request)
        self.stats.submitted += 1
        if self._idle_event.is_set():
            self._idle_event = anyio.Event()
        self.wake()
        return submission

    def start_held(self, requests: Sequence[Request], error: Exception | None = None) -> None:
        """Start requests submitted `held` (those not finished meanwhile); or, with `error`,
        refuse them before they hold anything: their stream raises `error`. Called once per held
        submission, whatever happened to it meanwhile."""
        self._held -= len(requests)
        waiting = [r for r in requests if r in self.table.owner and not r.history and not r.is_finished]
        if not waiting:
            return
        if error is None:
            self.table.unstarted.extend(waiting)
        else:
            submission = self.table.owner[waiting[0]]
            if submission.send is not None:
                submission.send.send(error)
            for request in waiting:
                self.gateway.finish(request, FinishReason.ERROR, error=error)
        self.wake()

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Abort a live submission by id; False if unknown or already finished."""
        submission = self.table.submissions.get(request_id) if isinstance(request_id, str) else None
        if submission is None or all(r.is_finished for r in submission.requests):
            return False
        self.table.aborts.append((submission, reason))
        self.wake()
        return True

    def abandon(self, submission: Submission) -> None:
        """Its client stopped listening: abort exactly that submission (safe from any thread).

        NOTE: a submission whose sequences all finished has nothing to abort;
        queueing it would leave a stale entry behind while the engine idles."""
        if submission.open <= 0:
            return
        self.table.aborts.append((submission, FinishReason.ABORT))
        if threading.get_ident() == self._thread:
            self.wake()

    @property
    def step_observers(self) -> list[StepObserver]:
        """Called as `observer(batch, step_output)` after every model step (isolated)."""
        return self.applier.step_observers

    def is_live(self, request_id: str) -> bool:
        return request_id in self.table.submissions

    def requests(self) -> list[Request]:
        """Every request not yet RELEASED (a snapshot)."""
        return list(self.table.requests())

    @property
    def num_live(self) -> int:
        """Requests not yet RELEASED."""
        return len(self.table)

    @property
    def num_running(self) -> int:
        """Admitted requests that have not finished."""
        return len(self.table.running())

    @property
    def last_leak(self) -> tuple[str, ...]:
        """The problems the latest leak check found (idle or busy); () once one passes."""
        return self.leak_watch.problems

    def starved(self) -> tuple[dict[str, Any], ...]:
        """The reports of requests now waiting past the starvation bound."""
        return tuple(self.planner.starved.values())

    def table_sizes(self) -> dict[str, int]:
        """How much every per-request table keeps: all 0 once the engine is idle (but
        `quarantined`, which empties when late copies land)."""
        table = self.table
        return {"submissions": len(table.submissions), "owner": len(table.owner), "waiting": len(table.waiting),
                "unstarted": len(table.unstarted), "aborts": len(table.aborts),
                "starved": len(self.planner.starved), "prefix_locks": len(self._prefix_locks),
                "quarantined": len(self.machine.quarantined), "deadlines": len(self.deadlines),
                "session_turns": self.sessions.num_turns_in_flight(), "held": self._held}

    @property
    def checked_idle(self) -> bool:
        """Whether the leak check has run since the loop last went idle."""
        return self.leak_watch.idle_checked

    @property
    def idle(self) -> bool:
        client = self.prefill_client
        return not self.table and (client is None or client.idle)

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until no request is outside RELEASED (aborts and releases applied)."""
        with anyio.fail_after(timeout):
            while not self.idle:
                if self.table:
                    await self._idle_event.wait()
                else:  # only the prefill client's own requests are left
                    await anyio.sleep(0.005)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------ the task
    def bind(self) -> None:
        """Create the waiting primitives in the async library about to run the loop (call on entry:
        the engine may have been built under another one, or outside any)."""
        self._wake = anyio.Event()
        self._idle_event = anyio.Event()
        self._idle_event.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._thread = threading.get_ident()
        token = anyio.lowlevel.current_token()
        self.waker.bind(token)
        self.step_thread.bind(token)
        task_status.started()
        try:
            while True:
                try:
                    await self.iteration()
                except Exception as exc:  # noqa: BLE001 - reported to every client, never lost
                    self._die(exc)
                    return
        finally:
            self.step_thread.close()

    async def iteration(self) -> None:
        if self.closing:  # shutdown owns the requests now
            await self._wait(None)
            return
        if self.runs.steps > 1:  # NOTE: a wake from now on (a landed transfer, a submission) ends a decode run
            self._wake = anyio.Event()
        if (refused := self.gateway.intake()) is not None:
            self.planner.check_starvation(refused)
        timed_out, reaped = self._timers(), self.gateway.release_finished()  # issue 21: timers
        if not self.table:
            self._idle_event.set()
            if self.idle:
                self.leak_watch.on_idle(recheck=bool(reaped) or timed_out)
            # NOTE: poll while a late copy may still land or the prefill client still works
            await self._wait(0.05 if self.machine.quarantined or not self.idle else None)
            return
        self.leak_watch.on_busy()
        self.planner.prepare()
        batch = self.planner.batch()
        if not batch:  # fences (each one that signals wakes the loop) or memory (polled)
            await self._wait(fence_wait(self.table.requests(), self.waker, self.machine.clock()))
            return
        steps = self.runs.plan(batch)  # NOTE: 1 unless decode_steps > 1 (engine.runtime.decode_runs)
        self.step_running = True
        finished = self.stats.finished_total
        tokens, started = sum(s.num_tokens for s in batch), time.perf_counter()
        outputs: list[StepOutput] = []
        try:  # NOTE: a short step costs less than the hand-offs to the step thread (inline_rule); a run takes it
            call = self.runs.runner_call(self.runner, steps)
            outputs = call(batch) if self.inline.inline(tokens, steps) else await self.step_thread.run(call, batch)
        except Exception as exc:  # the batch fails, the engine keeps serving
            self.applier.fail_step(batch, exc)
        else:
            self.inline.observe(tokens, time.perf_counter() - started, steps)
            self.runs.apply(batch, outputs, self.applier.apply_step)
        finally:
            self.step_running = False
            self.runs.settle(batch, steps, len(outputs))
            self.stats.on_step(time.monotonic(), max(1, len(outputs)))
        await anyio.lowlevel.checkpoint()
        if (self.admission_window and self.stats.finished_total > finished and not self.table.unstarted
                and self._kv_slots.num_free):
            self._wake = anyio.Event()  # NOTE: only a submission from now on ends the window
            await self._wait(self.admission_window)

    async def _wait(self, timeout: float | None) -> None:
        due = None if self.closing else min(
            (t for t in (self.deadlines.next_due(), self.sessions.next_due()) if t is not None), default=None)
        if due is not None:  # issue 21: a deadline or a lease is seen without new traffic (shutdown owns both)
            left = max(0.0, due - self.machine.clock())
            timeout = left if timeout is None else min(timeout, left)
        with anyio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = anyio.Event()

    def _timers(self) -> bool:
        """Issue 21: finish requests past their deadline (through the one release path), then
        apply session closes and expired leases; True if a session was released."""
        if not self.deadlines and not self.sessions:  # NOTE: nothing to look at (the common case), no clock read
            return False
        now = self.machine.clock()
        for request in self.deadlines.due(now):
            self.gateway.finish(request, FinishReason.DEADLINE, error=TimeoutError(
                f"deadline passed {now - request.arrival_time:.3f}s after submission"))
        return self.sessions.expire(now)

    # ------------------------------------------------------------ endings
    def _die(self, exc: BaseException) -> None:
        self.errored = exc
        log.error("engine.dead", error=repr(exc), live_requests=len(self.table))
        dead = EngineDead(exc)
        for submission in list(self.table.submissions.values()):
            if submission.send is not None:
                submission.send.send(dead)
                close_stream(submission)
        self.gateway.release_what_can_be(exc)  # best effort: release what can be released
        try:
            self.sessions.shutdown()  # issue 21: their kept KV too
        except Exception as again:  # noqa: BLE001
            log.error("engine.dead_release_failed", request_id="sessions", error=repr(again))

    async def shutdown(self) -> None:
        """Finish every live request with SHUTDOWN and release all (call shielded).

        NOTE: a model step in flight still reads its batch's tables and writes
        their KV pages, so no new step starts and the one in flight is awaited
        before anything is released (it is the in-flight-step fence); the wake
        ends a decode run after its current step."""
        self.closing = True
        self.wake()
        while self.step_running:
            await anyio.sleep(0.005)
        if self.errored is not None:
            return
        self.table.aborts.clear()
        for request in self.table.requests():
            self.gateway.finish(request, FinishReason.SHUTDOWN)
        while self.table.finished():
            self.gateway.release_finished()
            if self.table.finished():
                await anyio.sleep(0.005)
        self.gateway.release_finished()
        self.sessions.shutdown()  # issue 21: after their turns, so nothing hands KV to a closed session


#: the name before the prefill role ran on it too
DecodeLoop = RuntimeLoop
