"""The gateway: the one object that moves requests through the machine.

Every transition the runtime makes goes through it (start, advance, finish,
release, abort), and so does every other machine call it makes while a
request runs (growth, publishing, fences), so refusals and faults are handled
in one place: a refused move (`ResourceExhausted`, a pending fence) leaves the
request where it was, to be retried; any other error from a hook finishes the
request with ERROR and the engine carries on. Finishing sends the final
output (and closes the stream after a submission's last sequence), then
releases as soon as the fences allow.

The gateway never writes a request's progress (`kv_len`, output tokens):
that is the step applier's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from engine.runtime.output_sender import OutputSender
from engine.runtime.table import RequestTable, Submission
from states import (Fence, FencePending, FinishReason, Request, RequestMachine, RequestState, ResourceExhausted,
                    TokenLogprob)

S = RequestState
log = structlog.get_logger("kvlife.loop")

#: told when a request reaches RELEASED (after the machine's release sequence)
ReleaseObserver = Callable[[Request], None]


class RequestGateway:
    def __init__(self, *, machine: RequestMachine, table: RequestTable, outputs: OutputSender) -> None:
        self.machine = machine
        self.table = table
        self.outputs = outputs
        self.release_observers: list[ReleaseObserver] = []

    # ------------------------------------------------------------- intake
    def start(self, request: Request) -> None:
        """Start a request that no submission carries (a session's anchor) in QUEUED; raises as
        `RequestMachine.start` does (`ResourceExhausted`: nothing changed)."""
        self.machine.start(request)

    def intake(self) -> Request | None:
        """Start submitted requests (QUEUED, in order; a refused start waits, FIFO) and apply
        the aborts queued since the last iteration. Returns the request whose start was refused
        for want of memory (it waits at the head), if any."""
        table = self.table
        refused = None
        while table.unstarted:
            request = table.unstarted[0]
            try:
                self.machine.start(request)
            except ResourceExhausted:
                refused = request
                break  # FIFO: retried next iteration
            except Exception as exc:
                table.unstarted.popleft()
                log.error("request.start_failed", request_id=request.request_id, error=repr(exc))
                self.finish(request, FinishReason.ERROR, error=exc)
                continue
            table.unstarted.popleft()
            table.waiting.append(request)
        while table.aborts:
            submission, reason = table.aborts.popleft()
            self.abort_submission(submission, reason)
        return refused

    # -------------------------------------------------------------- moves
    def advance(self, request: Request, dst: RequestState, *, reason: str) -> bool:
        """Move through the machine; False if refused (the request stays where it was)."""
        try:
            self.machine.advance(request, dst, reason=reason)
        except (ResourceExhausted, FencePending):
            return False
        except Exception as exc:  # a faulty hook must not take the engine down
            log.error("request.acquire_failed", request_id=request.request_id, dst=dst.name, error=repr(exc))
            self.finish(request, FinishReason.ERROR, error=exc)
            return False
        return True

    def requeue(self, request: Request) -> bool:
        """RETRACTED -> QUEUED at the head of the queue; False if refused (retried later)."""
        if not self.advance(request, S.QUEUED, reason="requeued"):
            return False
        self.table.waiting.appendleft(request)
        return True

    def finish(self, request: Request, reason: FinishReason, *, error: BaseException | None = None,
               tokens: Sequence[int] = (), text: str = "", flush_text: bool = True,
               logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        """Finish through the machine and send the final output (with the tokens that ended
        it, if a token did). Idempotent; never refused."""
        if not request.history:  # never started (its start was refused): enter QUEUED holding nothing
            self.machine.start(request, acquire=False)
            self.table.forget_unstarted(request)
        if not self.machine.finish(request, reason, error=error):
            return
        if request in self.table.waiting:
            self.table.waiting.remove(request)
        submission = self.table.owner.get(request)
        if submission is not None:
            submission.prompt_ready = True  # a leader that ends early leaves the others to compute it
            self.outputs.final(request, tokens=tokens, text=text, flush_text=flush_text, logprobs=logprobs)
        self.try_release(request)

    def abort_submission(self, submission: Submission, reason: FinishReason) -> None:
        for request in submission.requests:
            if request in self.table.owner and not request.is_finished:
                self.finish(request, reason)

    # ------------------------------------------------- while a request runs
    def grow(self, request: Request, num_tokens: int) -> bool | None:
        """Cover `num_tokens` tokens: True, False when a pool is short, None when a hook
        failed (the request is then finished with ERROR)."""
        try:
            return self.machine.grow(request, num_tokens)
        except Exception as exc:
            log.error("request.grow_failed", request_id=request.request_id, error=repr(exc))
            self.finish(request, FinishReason.ERROR, error=exc)
            return None

    def extend(self, request: Request, num_tokens: int) -> bool:
        """Speculative decoding: room for a verify step's drafts, `num_tokens` tokens in all;
        False when a pool is short or a hook failed (what grew is given back: the request
        decodes plainly this step, nobody is retracted)."""
        try:
            if self.machine.extend(request, num_tokens):
                return True
        except Exception as exc:  # a faulty hook: no speculation this step, the release is the usual one
            log.error("request.extend_failed", request_id=request.request_id, error=repr(exc))
        self.machine.rollback(request, request.kv_len + 1)
        return False

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Give back what the request's handles hold past `num_tokens` tokens (rejected drafts)."""
        self.machine.rollback(request, num_tokens)

    def publish(self, request: Request) -> None:
        """Share the request's complete memory now (an n > 1 leader's prompt pages)."""
        self.machine.publish(request)

    def add_fence(self, request: Request, fence: Fence) -> None:
        self.machine.add_fence(request, fence)

    def prune_fences(self, request: Request) -> None:
        self.machine.prune_fences(request)

    def missed_fence(self, request: Request) -> Fence | None:
        """A fence of the request past its deadline that is not done, if any."""
        now = self.machine.clock()
        return next((f for f in request.fences if not f.done() and f.deadline <= now), None)

    # ------------------------------------------------------------ releases
    def try_release(self, request: Request) -> bool:
        """FINISHED -> RELEASED if its fences allow."""
        if not self.machine.try_release(request):
            return False
        self.table.forget(request)
        for observer in self.release_observers:
            try:
                observer(request)
            except Exception as exc:
                log.error("loop.release_observer_failed", observer=repr(observer), error=repr(exc))
        return True

    def release_finished(self) -> int:
        """Release every finished request whose fences allow, and quarantined handles whose
        fences completed since; returns how many quarantined handles were released."""
        for request in self.table.finished():
            self.try_release(request)
        return self.machine.reap_quarantine()

    def release_what_can_be(self, error: BaseException) -> None:
        """The loop died: finish every request with ERROR and release what the fences allow
        (best effort, each request on its own)."""
        for request in self.table.requests():
            try:
                if not request.history:
                    self.machine.start(request, acquire=False)
                self.machine.finish(request, FinishReason.ERROR, error=error)
                self.try_release(request)
            except Exception as again:  # noqa: BLE001
                log.error("engine.dead_release_failed", request_id=request.request_id, error=repr(again))
