"""The decode loop: one task that moves every request, one iteration at a time.

Each iteration::

    drain the inbox (QUEUED) -> apply aborts -> admit (QUEUED -> PREFILLING)
    -> grow decode pages, retracting under pressure -> run the model step in
    a worker thread -> append tokens, stream outputs, finish -> release the
    finished requests whose fences are done -> leak check when idle

NOTE: requests in a running step are never transitioned while it runs: the
loop is the only task that transitions, and it is awaiting the step. That
is the in-flight-model-step fence, by construction. Aborts, submissions and
health checks arriving meanwhile are queued and applied after the step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from engine.disagg.kv_transfer_hook import KVTransferHook
from engine.outputs import RequestOutput
from engine.runtime.scheduler import ScheduledSeq, Scheduler
from engine.runtime.stats import EngineStats
from resources import LeakError, ResourceExhausted
from states import FinishReason, Request, RequestMachine, RequestState

S = RequestState
log = structlog.get_logger("kvlife.loop")


class DecodeLoop:
    def __init__(self, *, machine: RequestMachine, scheduler: Scheduler, runner: Any, kv_hook: Any,
                 kv_pool: Any, stop_ids: frozenset[int], max_context: int, check_memory: Callable,
                 leak_check: str, admit_into: RequestState = S.PREFILLING,
                 after_prefill: RequestState = S.DECODING, max_queued: int = 4096,
                 grow: Callable[[Request, int], bool] | None = None) -> None:
        self.machine = machine
        self.scheduler = scheduler
        self.runner = runner
        self.kv_hook = kv_hook
        self.kv_pool = kv_pool
        self.stop_ids = stop_ids
        self.max_context = max_context
        self.check_memory = check_memory
        self.leak_check = leak_check
        self.admit_into = admit_into
        self.after_prefill = after_prefill
        #: make a decoding request's memory cover N tokens; False when the pool is short
        self.grow = grow if grow is not None else kv_hook.grow
        self.stats = EngineStats()
        machine.transition_observers.append(self.stats.on_transition)
        self.inbox_send, self.inbox = anyio.create_memory_object_stream(max_queued)
        self.requests: dict[str, Request] = {}  # every request not yet RELEASED
        self.outputs: dict[str, Any] = {}  # request id -> output send stream
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, not finished
        self.finished: list[Request] = []  # FINISHED, waiting for fences
        self.pending_aborts: deque[tuple[str, FinishReason]] = deque()
        self.step_observers: list[Callable[[Sequence[ScheduledSeq], Any], None]] = []
        self.release_observers: list[Callable[[Request], None]] = []
        self.make_output: Callable[..., RequestOutput] = RequestOutput
        self._admitted = itertools.count(1)
        self._wake = anyio.Event()
        self.idle_event = anyio.Event()
        self.idle_event.set()
        self._was_idle = True
        self.step_running = False
        self.closing = False  # set by shutdown: start no new step

    # ------------------------------------------------------------ the task
    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.iteration()

    def wake(self) -> None:
        self._wake.set()

    async def iteration(self) -> None:
        if self.closing:  # shutdown owns the requests now
            await self._wait(None)
            return
        self._drain_inbox()
        self._apply_aborts()
        self._release_finished()
        if not self.requests:
            self._on_idle()
            await self._wait(None)
            return
        self._was_idle = False
        self._land_transfers()
        self._advance_staged()
        self._admit()
        batch = self._plan_batch()
        if not batch:
            await self._wait(0.005)  # fences or memory: poll again shortly
            return
        self.step_running = True
        try:
            output = await anyio.to_thread.run_sync(self.runner.step, batch)
        except Exception as exc:  # the batch fails, the engine keeps serving
            self.stats.step_errors += 1
            log.error("model.step_failed", error=repr(exc), batch=[s.request.request_id for s in batch])
            for s in batch:
                self.finish(s.request, FinishReason.ERROR, error=exc)
        else:
            self._apply_step(batch, output)
        finally:
            self.step_running = False
            self.stats.on_step(time.monotonic())
        await anyio.lowlevel.checkpoint()

    async def _wait(self, timeout: float | None) -> None:
        with anyio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = anyio.Event()

    # --------------------------------------------------------- submissions
    def _drain_inbox(self) -> None:
        while True:
            try:
                request = self.inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                return
            self.machine.start(request)
            self.waiting.append(request)

    def _apply_aborts(self) -> None:
        while self.pending_aborts:
            request_id, reason = self.pending_aborts.popleft()
            request = self.requests.get(request_id)
            if request is not None:
                self.finish(request, reason)

    def _admit(self) -> None:
        if not self.waiting:
            return
        chosen = self.scheduler.select_admissions(
            self.waiting,
            num_running=len(self.running),
            free_slots=self.kv_pool.slots.num_free,
            available_pages=self.kv_pool.available_pages,
        )
        for request in chosen:
            if not self.advance(request, self.admit_into, reason="admitted"):
                break
            self.waiting.remove(request)
            request.extras["admitted_seq"] = next(self._admitted)
            if "cached_tokens" not in request.extras:  # first admission
                request.extras["cached_tokens"] = request.kv_len
                queried = request.num_prompt_tokens - 1 if self.admit_into is S.PREFILLING else 0
                self.stats.on_admit(request, time.monotonic(), request.kv_len, queried)
            self.running.append(request)

    def _land_transfers(self) -> None:
        """TRANSFERRING requests whose KV has landed: PREBUILT with the first token."""
        for request in list(self.running):
            if request.state is not S.TRANSFERRING:
                continue
            job = KVTransferHook.job(request)
            if job.outcome is None or not job.fence.done():
                missed = self._missed_fence(request)
                if missed is not None:  # the copy is presumed lost: fail it; its pages quarantine
                    self.finish(request, FinishReason.TRANSFER_FAILED,
                                error=TimeoutError(f"{missed.name} missed its deadline"))
                continue
            status, value = job.outcome
            if status != "ok":
                self.finish(request, FinishReason.TRANSFER_FAILED, error=value)
                continue
            request.kv_len = request.num_tokens
            self._accept_token(request, value, time.monotonic())

    def _advance_staged(self) -> None:
        """Retry moves that wait on memory or copies: PREBUILT -> after_prefill,
        STAGING -> DECODING once the staging copies are done."""
        for request in list(self.running):
            if request.state is S.PREBUILT:
                self.advance(request, self.after_prefill, reason="first token")
            elif request.state is S.STAGING:
                missed = self._missed_fence(request)
                if missed is not None:  # staging can never complete: finish (the memory quarantines)
                    self.finish(request, FinishReason.ERROR, error=TimeoutError(f"{missed.name} missed its deadline"))
                elif all(f.done() for f in request.fences):
                    self.advance(request, S.DECODING, reason="staged")

    def _missed_fence(self, request: Request) -> Any:
        """A fence of `request` still in flight past its deadline, if any."""
        now = self.machine.clock()
        return next((f for f in request.fences if not f.done() and f.deadline <= now), None)

    def advance(self, request: Request, dst: RequestState, *, reason: str) -> bool:
        """Move through the machine. A full pool leaves the request where it was
        (False); any other acquisition failure finishes it with ERROR."""
        try:
            self.machine.advance(request, dst, reason=reason)
        except ResourceExhausted:
            return False
        except Exception as exc:  # a faulty hook must not take the engine down
            log.error("request.acquire_failed", request_id=request.request_id, dst=dst.name, error=repr(exc))
            self.finish(request, FinishReason.ERROR, error=exc)
            return False
        return True

    # ---------------------------------------------------------- the batch
    def _plan_batch(self) -> list[ScheduledSeq]:
        decoding = [r for r in self.running if r.state is S.DECODING]
        for request in decoding:
            while request.state is S.DECODING and not self.grow(request, request.kv_len + 1):
                victim = self.scheduler.select_victim(
                    [r for r in self.running if r.state is S.DECODING], retractable=self._retractable
                )
                if victim is None:
                    self.finish(request, FinishReason.ERROR, error=ResourceExhausted("no page to decode into"))
                    break
                self.retract(victim)
        decoding = [r for r in self.running if r.state is S.DECODING]
        prefilling = [r for r in self.running if r.state is S.PREFILLING]
        return self.scheduler.select_batch(prefilling, decoding)

    def _retractable(self, request: Request) -> bool:
        return all(f.done() for f in request.fences)

    def retract(self, request: Request) -> None:
        """DECODING -> RETRACTED -> QUEUED at the head of the queue; output is kept."""
        self.machine.advance(request, S.RETRACTED, reason="page pressure")
        request.kv_len = 0
        self.running.remove(request)
        self.machine.advance(request, S.QUEUED, reason="requeued")
        self.waiting.appendleft(request)

    def _apply_step(self, batch: Sequence[ScheduledSeq], output: Any) -> None:
        for observer in self.step_observers:
            observer(batch, output)
        tokens = iter(output.tokens)
        now = time.monotonic()
        for s in batch:
            request = s.request
            request.kv_len = s.start + s.num_tokens
            if not s.samples:
                continue
            token = next(tokens)
            if request.state in (S.PREFILLING, S.DECODING):
                self._accept_token(request, token, now)

    def _accept_token(self, request: Request, token: int, now: float) -> None:
        """Append a sampled token; a completed prefill or transfer becomes PREBUILT,
        then finishes (first-token finish) or moves on like any other."""
        request.output_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        self.stats.on_token(request, now)
        if request.state in (S.PREFILLING, S.TRANSFERRING) and not self.advance(request, S.PREBUILT,
                                                                                 reason="prefilled"):
            return
        reason = self._finish_reason(request, token)
        if reason is not None:
            self.finish(request, reason, new_tokens=[token])
            return
        self.emit(request, [token])
        if request.state is S.PREBUILT:
            self.advance(request, self.after_prefill, reason="first token")

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if (token in self.stop_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_new_tokens or request.num_tokens >= self.max_context:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------ finishing
    def finish(self, request: Request, reason: FinishReason, *, error: BaseException | None = None,
               new_tokens: list[int] | None = None) -> None:
        """Finish through the machine and send the final output. Idempotent."""
        if not self.machine.finish(request, reason, error=error):
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.emit(request, new_tokens or [], final=True)
        if not self._try_release(request):
            self.finished.append(request)

    def emit(self, request: Request, new_tokens: list[int], *, final: bool = False) -> None:
        stream = self.outputs.get(request.request_id)
        if stream is None:
            return
        output = self.make_output(request, new_tokens, final)
        try:
            stream.send_nowait(output)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.outputs.pop(request.request_id, None)
            stream.close()
            if not request.is_finished:  # the client left: abort
                self.finish(request, FinishReason.ABORT)
            return
        if final:
            stream.close()
            self.outputs.pop(request.request_id, None)

    def _release_finished(self) -> None:
        if self.finished:
            self.finished = [r for r in self.finished if not self._try_release(r)]

    def _try_release(self, request: Request) -> bool:
        """FINISHED -> RELEASED if its fences allow; wakes `wait_idle` waiters."""
        if not self.machine.try_release(request):
            return False
        self.requests.pop(request.request_id, None)
        for observer in self.release_observers:
            observer(request)
        if not self.requests:
            self.idle_event.set()
        return True

    # ------------------------------------------------------------ idleness
    def _on_idle(self) -> None:
        if self._was_idle or self.leak_check == "off":
            self._was_idle = True
            return
        self._was_idle = True
        self.stats.leak_checks += 1
        try:
            self.check_memory()
        except LeakError:
            self.stats.leak_check_failures += 1
            if self.leak_check == "raise":
                raise

    # ------------------------------------------------------------ shutdown
    async def shutdown(self) -> None:
        """Finish every live request with SHUTDOWN and release all (call shielded).

        NOTE: a model step in flight still reads its batch's tables and writes
        their KV pages, so no new step starts and the one in flight is awaited
        before anything is released (it is the in-flight-step fence).
        """
        self.closing = True
        while self.step_running:
            await anyio.sleep(0.005)
        self.inbox_send.close()
        self._drain_inbox()
        self.inbox.close()
        for request in list(self.requests.values()):
            self.finish(request, FinishReason.SHUTDOWN)
        self.pending_aborts.clear()  # every request they named has finished
        while self.finished:
            self._release_finished()
            if self.finished:
                await anyio.sleep(0.005)
