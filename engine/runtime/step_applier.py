"""The step applier: the one writer of a request's progress.

A request's progress is `kv_len` (the leading tokens whose KV is complete in
this engine), its output tokens and their logprobs, and its token times.
Nothing else writes them, and they change only here:

- admission: `kv_len` starts at the prefix the KV hook found cached;
- a model step: each row's `kv_len` covers what the step computed, and a
  sampling row's token is accepted (the step's fences are added first,
  through the machine, before anything can finish);
- a transfer that landed: `kv_len` covers the whole context and the first
  token (with its logprob, which travelled with the KV) is accepted;
- retraction: `kv_len` is 0 (the KV was released).

Accepting a token: a completed prefill or transfer becomes PREBUILT, then
finishes (a first-token finish, or always in the prefill role, whose job
ends with the first token) or moves on like any other request; a stop
token, a stop string or a length limit finishes it. Moves and finishes go
through the gateway; outputs through the output sender.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog

from engine.disagg.decode.kv_transfer_hook import FirstToken
from engine.model.batch import ScheduledSeq
from engine.model.step_types import StepOutput, Verified
from engine.runtime.gateway import RequestGateway
from engine.runtime.output_sender import OutputSender
from engine.runtime.role import Role
from engine.runtime.stats import EngineStats
from engine.runtime.table import RequestTable
from resources.kv_hook import KVHook
from states import FinishReason, Request, RequestState, TokenLogprob

S = RequestState
log = structlog.get_logger("kvlife.loop")

#: called after every step with the batch and its output (the MoE record), on the loop's thread
StepObserver = Callable[[Sequence[ScheduledSeq], StepOutput], None]
#: (request, token) -> None, or (finish reason, error, whether the token is kept) ending the request;
#: the token is -1 when the sampler found no allowed token for the request (a feature's check: the grammar's)
TokenCheck = Callable[[Request, int], "tuple[FinishReason, BaseException | None, bool] | None"]


class StepApplier:
    def __init__(self, *, gateway: RequestGateway, outputs: OutputSender, table: RequestTable, stats: EngineStats,
                 role: Role, stop_ids: frozenset[int], max_context: int) -> None:
        self.gateway = gateway
        self.outputs = outputs
        self.table = table
        self.stats = stats
        self.role = role
        self.stop_ids = stop_ids
        self.max_context = max_context
        self.step_observers: list[StepObserver] = []
        #: features' checks of each sampled token before it is appended (a grammar's: is it complete,
        #: or at a dead end): None, or (reason, error, keep the token) to finish the request with
        self.token_checks: list[TokenCheck] = []

    # ------------------------------------------------------------ progress
    def admitted(self, request: Request) -> None:
        """Admission: the prefix the KV hook found in the prefix cache is complete KV."""
        request.kv_len = KVHook.cached_tokens(request)

    def retracted(self, request: Request) -> None:
        """Retraction released the request's KV: nothing of it is in this engine any more."""
        request.kv_len = 0

    def land(self, request: Request, first: FirstToken) -> None:
        """A transfer landed: the whole context's KV is here, and its first token is known."""
        request.kv_len = request.num_tokens
        self.accept_token(request, first.token, time.monotonic(), first.logprob)

    # ------------------------------------------------------------ the step
    def apply_step(self, batch: Sequence[ScheduledSeq], output: StepOutput) -> None:
        rows = output.rows if output.rows is not None else batch  # a verify step's rows hold their drafts
        for observer in self.step_observers:
            try:
                observer(rows, output)
            except Exception as exc:
                log.error("loop.step_observer_failed", observer=repr(observer), error=repr(exc))
        for request, fence in output.fences:  # NOTE: before anything finishes, so releases wait for them
            self.gateway.add_fence(request, fence)
        tokens = iter(output.tokens)
        logprobs = iter(output.logprobs)
        verified = iter(output.verified)
        for request, first, entries in output.prompt_logprobs:  # issue 21
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
            logprob = next(logprobs, None)
            result = next(verified) if output.verified else None
            if request.state in (S.PREFILLING, S.DECODING):
                request.num_token_steps += 1
                if s.draft_budget:
                    self._accept_verified(request, result, token, now)
                else:
                    self.accept_token(request, token, now, logprob)

    def _accept_verified(self, request: Request, result: Verified | None, token: int, now: float) -> None:
        """A speculating row: its accepted drafts (their KV is complete), then its token, in
        one output; the slots of the rejected drafts go back through the machine."""
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
            self.gateway.rollback(request, request.num_tokens)

    def _send_held(self, request: Request, hold: list[tuple[int, str]]) -> None:
        if hold:
            tokens, texts = zip(*hold)
            self.outputs.chunk(request, tokens, "".join(texts), None)
        hold.clear()

    def fail_step(self, batch: Sequence[ScheduledSeq], error: BaseException) -> None:
        self.stats.step_errors += 1
        log.error("model.step_failed", error=repr(error), batch=[s.request.request_id for s in batch])
        for s in batch:
            self.gateway.finish(s.request, FinishReason.ERROR, error=error)

    def accept_token(self, request: Request, token: int, now: float, logprob: TokenLogprob | None = None,
                     hold: list[tuple[int, str]] | None = None) -> None:
        """Append a sampled token (and its logprob); a completed prefill or transfer becomes
        PREBUILT, then finishes or moves on like any other request. With `hold`, a decoding
        request's chunk is kept there (token, text) for one output of several tokens
        (`_send_held`); a finish sends what is held first."""
        src = request.state
        verdict = self._check_token(request, token)
        if verdict is not None and not verdict[2]:  # a token the request cannot take ends it instead
            self.gateway.finish(request, verdict[0], error=verdict[1])
            return
        wants_logprobs = request.params.logprobs is not None
        request.output_token_ids.append(token)
        if wants_logprobs:
            request.output_logprobs.append(logprob)
        if src in (S.PREFILLING, S.TRANSFERRING) and not self.gateway.advance(request, S.PREBUILT,
                                                                              reason="prefilled"):
            if not request.is_finished:  # refused for now: exactly where it was, retried later
                request.output_token_ids.pop()
                if wants_logprobs:
                    request.output_logprobs.pop()
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
            self.gateway.publish(request)  # the other sequences match its prompt pages
            submission.prompt_ready = True
        new_text, stopped = ("", False) if submission is None else submission.builders[request].add_tokens([token])
        logprobs = None if logprob is None else (logprob,)
        reason = FinishReason.STOP if stopped else (verdict[0] if verdict else self._finish_reason(request, token))
        if reason is None and request.state is S.PREBUILT and self.role.after_prefill is None:
            reason = FinishReason.LENGTH  # the prefill role: the job ends with the first token
        if reason is not None:
            if hold:
                self._send_held(request, hold)
            self.gateway.finish(request, reason, tokens=[token], text=new_text, flush_text=not stopped,
                                logprobs=logprobs)
            return
        if hold is not None and logprobs is None:
            hold.append((token, new_text))
        else:
            self.outputs.chunk(request, [token], new_text, logprobs)
        if request.state is S.PREBUILT and self.role.after_prefill is not None:
            self.gateway.advance(request, self.role.after_prefill, reason="first token")

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
