"""Applying a step and finishing: tokens in, outputs out, releases done.

Every transition the loop makes goes through `Finisher.advance` or
`Finisher.finish`, so refusals and faults are handled in one place: a
refused move (`ResourceExhausted`, a pending fence) leaves the request where
it was, to be retried; any other error from a hook finishes the request with
ERROR and the engine carries on. Finishing sends the final output (and
closes the stream after a submission's last sequence), then releases as soon
as the fences allow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from engine.outputs import RequestOutput, TokenLogprob
from engine.runtime.stats import EngineStats
from engine.runtime.table import RequestTable, Submission, close_stream
from states import FencePending, FinishReason, Request, RequestMachine, RequestState, ResourceExhausted

if TYPE_CHECKING:
    from engine.model.step_types import StepOutput, Verified
    from engine.runtime.scheduler import ScheduledSeq

S = RequestState
log = structlog.get_logger("kvlife.loop")
#: (request, token) -> None, or (finish reason, error, whether the token is kept) ending the request;
#: the token is -1 when the sampler found no allowed token for the request
TokenCheck = Callable[[Request, int], "tuple[FinishReason, BaseException | None, bool] | None"]


class Finisher:
    def __init__(self, *, machine: RequestMachine, table: RequestTable, stats: EngineStats, stop_ids: frozenset[int],
                 max_context: int, after_prefill: RequestState) -> None:
        self.machine = machine
        self.table = table
        self.stats = stats
        self.stop_ids = stop_ids
        self.max_context = max_context
        self.after_prefill = after_prefill
        self.step_observers: list[Callable[[Sequence[ScheduledSeq], StepOutput], None]] = []
        self.release_observers: list[Callable[[Request], None]] = []
        #: features' checks of each sampled token before it is appended (a grammar's: is it complete,
        #: or at a dead end): None, or (reason, error, keep the token) to finish the request with
        self.token_checks: list[TokenCheck] = []

    # ------------------------------------------------------------- moves
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

    def finish(self, request: Request, reason: FinishReason, *, error: BaseException | None = None,
               new_tokens: Sequence[int] = (), new_text: str = "", flush_text: bool = True,
               logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        """Finish through the machine and send the final output. Idempotent.

        `flush_text=False` when a stop string ended it: the text held back is
        the stop string's start, not output."""
        if not request.history:  # never started (its start was refused): enter QUEUED holding nothing
            self.machine.start(request, acquire=False)
            self._forget_unstarted(request)
        if not self.machine.finish(request, reason, error=error):
            return
        if request in self.table.waiting:
            self.table.waiting.remove(request)
        submission = self.table.owner.get(request)
        if submission is not None:
            submission.prompt_ready = True  # a leader that ends early leaves the others to compute it
            builder = submission.builders[request]
            if flush_text:
                new_text += builder.flush()
            self._send(submission, builder.output(list(new_tokens), new_text, final=True, logprobs=logprobs))
            submission.open -= 1
            if submission.open <= 0:
                close_stream(submission)
        self.try_release(request)

    def abort_submission(self, submission: Submission, reason: FinishReason) -> None:
        for request in submission.requests:
            if request in self.table.owner and not request.is_finished:
                self.finish(request, reason)

    # ------------------------------------------------------------ the step
    def apply_step(self, batch: Sequence[ScheduledSeq], output: StepOutput) -> None:
        rows = output.rows if output.rows is not None else batch
        for observer in self.step_observers:
            try:
                observer(rows, output)
            except Exception as exc:
                log.error("loop.step_observer_failed", observer=repr(observer), error=repr(exc))
        tokens = iter(output.tokens)
        logprobs = iter(getattr(output, "logprobs", None) or ())
        verified = iter(output.verified)
        for request, first, entries in getattr(output, "prompt_logprobs", None) or ():  # issue 21
            submission = self.table.owner.get(request)
            if submission is not None:
                submission.builders[request].add_prompt_logprobs(first, entries)
        now = time.monotonic()
        for s in batch:
            request = s.request
            request.kv_len = s.start + s.num_tokens
            if not s.samples:
                continue
            request.skip_prefix_match = False  # issue 21: its prompt is computed; a re-admission may match
            token = next(tokens)
            result = next(verified) if output.verified else None
            if request.state in (S.PREFILLING, S.DECODING):
                request.num_token_steps += 1
                if s.draft_budget:
                    self._accept_verified(request, result, token, now)
                else:
                    self.accept_token(request, token, now, next(logprobs, None))

    def _accept_verified(self, request: Request, result: Verified | None, token: int, now: float) -> None:
        """A speculating row: its accepted drafts (their KV is complete), then its token; the
        slots of the rejected drafts go back through the machine."""
        accepted = result.accepted if result is not None else ()
        if result is not None and result.proposed:
            request.num_draft_tokens += result.proposed
            request.num_accepted_drafts += len(accepted)
            self.stats.on_verified(result.proposed, len(accepted))
        hold: list[tuple[int, str]] = []  # NOTE: one output for the step's tokens, not one per token
        for draft in accepted:
            self.accept_token(request, draft, now, hold=hold)
            if request.state is not S.DECODING:
                return
            request.kv_len += 1
        self.accept_token(request, token, now, hold=hold)
        if request.state is S.DECODING:
            self._send_held(request, hold)
            self.machine.rollback(request, request.num_tokens)

    def _send_held(self, request: Request, hold: list[tuple[int, str]]) -> None:
        submission = self.table.owner.get(request)
        if submission is not None and hold:
            tokens, texts = zip(*hold)
            self._send(submission, submission.builders[request].output(list(tokens), "".join(texts), final=False))
        hold.clear()

    def fail_step(self, batch: Sequence[Any], error: BaseException) -> None:
        self.stats.step_errors += 1
        log.error("model.step_failed", error=repr(error), batch=[s.request.request_id for s in batch])
        for s in batch:
            self.finish(s.request, FinishReason.ERROR, error=error)

    def accept_token(self, request: Request, token: int, now: float, logprob: TokenLogprob | None = None,
                     hold: list[tuple[int, str]] | None = None) -> None:
        """Append a sampled token; a completed prefill or transfer becomes PREBUILT,
        then finishes (first-token finish) or moves on like any other. With `hold`, a
        decoding request's chunk is kept there (token, text) for one output of several
        tokens (`_send_held`); a finish sends what is held first."""
        src = request.state
        verdict = self._check_token(request, token)
        if verdict is not None and not verdict[2]:  # a token the request cannot take ends it instead
            self.finish(request, verdict[0], error=verdict[1])
            return
        request.output_token_ids.append(token)
        if src in (S.PREFILLING, S.TRANSFERRING) and not self.advance(request, S.PREBUILT, reason="prefilled"):
            if not request.is_finished:  # refused for now: exactly where it was, retried later
                request.output_token_ids.pop()
                # NOTE: a prefill recomputes its last token next step (same KV, same seeded draw);
                # a landed transfer keeps its outcome and lands again next iteration
                request.kv_len = request.kv_len - 1 if src is S.PREFILLING else 0
            return
        if request.first_token_time is None:
            request.first_token_time = now
        self.stats.on_token(request, now)
        request.last_token_time = now
        submission = self.table.owner.get(request)
        if submission is not None and not submission.prompt_ready and request is submission.leader:
            self.machine.call(request, "kv", "publish")  # the other sequences match its prompt pages
            submission.prompt_ready = True
        new_text, stopped = ("", False) if submission is None else submission.builders[request].add_tokens([token])
        logprobs = None if logprob is None else (logprob,)
        reason = FinishReason.STOP if stopped else (verdict[0] if verdict else self._finish_reason(request, token))
        if reason is not None:
            if hold:
                self._send_held(request, hold)
            self.finish(request, reason, new_tokens=[token], new_text=new_text, flush_text=not stopped,
                        logprobs=logprobs)
            return
        if hold is not None and logprob is None:
            hold.append((token, new_text))
        elif submission is not None:
            self._send(submission, submission.builders[request].output([token], new_text, final=False,
                                                                        logprobs=logprobs))
        if request.state is S.PREBUILT:
            self.advance(request, self.after_prefill, reason="first token")

    def _check_token(self, request: Request, token: int) -> tuple[FinishReason, BaseException | None, bool] | None:
        for check in self.token_checks:
            try:
                verdict = check(request, token)
            except Exception as exc:  # a faulty check ends its request, never the loop
                log.error("loop.token_check_failed", request_id=request.request_id, error=repr(exc))
                return FinishReason.ERROR, exc, False
            if verdict is not None:
                return verdict
        return None

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if (token in self.stop_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_new_tokens or request.num_tokens >= self.max_context:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------ outputs
    def _send(self, submission: Submission, output: RequestOutput) -> None:
        send = submission.send
        if send is None:
            return
        if not send.send(output):
            close_stream(submission)  # the client left: abort what it asked for, if anything is left
            if any(not r.is_finished for r in submission.requests):
                self.table.aborts.append((submission, FinishReason.ABORT))

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

    def _forget_unstarted(self, request: Request) -> None:
        try:
            self.table.unstarted.remove(request)
        except ValueError:
            pass
