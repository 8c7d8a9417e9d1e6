"""Planning one step: what moved since the last one, who is admitted, who
grows or is retracted, and the batch.

In order: transfers that landed enter PREBUILT (decode role); moves that wait
on memory or copies are retried (PREBUILT -> DECODING/STAGING, STAGING ->
DECODING, RETRACTED -> QUEUED); the scheduler picks admissions (QUEUED ->
PREFILLING/TRANSFERRING) in priority order, retracting lower-priority running
requests for the head of the queue when it does not fit; in the decode role,
while its prefill client says no peer can take a job, the requests that
would need one finish TRANSFER_FAILED instead, holding no KV; every decoding
request grows by one token through the machine, retracting the lowest
priority, newest admitted under page pressure; the scheduler builds the
batch. A request waiting past `starvation_timeout` while pools stay held is
reported once (`memory.starved`), after a leak check, naming the pools it
waits for and their holders (`resources.leak_watch.starvation_record`).

The planner decides; moves go through the gateway, progress through the step
applier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from engine.disagg.decode.kv_transfer_hook import TransferJob
from engine.disagg.decode.transfer import TransferFailed
from engine.model.batch import ScheduledSeq
from engine.runtime.gateway import RequestGateway
from engine.runtime.role import Role
from engine.runtime.scheduler import Scheduler
from engine.runtime.stats import EngineStats
from engine.runtime.step_applier import StepApplier
from engine.runtime.table import RequestTable
from engine.speculative.budget import draft_budget
from resources.kv_pool import KVPool
from resources.leak_watch import starvation_record
from resources.ledger import MemoryReport
from states import FinishReason, Request, RequestState, ResourceExhausted

S = RequestState
log = structlog.get_logger("kvlife.loop")


class Planner:
    def __init__(self, *, gateway: RequestGateway, applier: StepApplier, table: RequestTable, stats: EngineStats,
                 scheduler: Scheduler, kv_pool: KVPool, role: Role, starvation_timeout: float,
                 clock: Callable[[], float], report: Callable[[], MemoryReport], draft_tokens: int = 0,
                 max_context: int = 0) -> None:
        self.gateway = gateway
        self.applier = applier
        self.table = table
        self.stats = stats
        self.scheduler = scheduler
        self.kv_pool = kv_pool
        self.role = role
        self.starvation_timeout = starvation_timeout
        self.clock = clock
        #: runs the leak check and returns its memory report, for naming what a starved request waits on
        self.report = report
        self._admissions = 0
        #: speculative decoding: draft tokens per step and request (0: off), and the context bound
        self.draft_tokens = draft_tokens
        self.max_context = max_context
        #: request -> what it was reported starving for (reported once per request), until it
        #: is admitted or released
        self.starved: dict[Request, dict[str, Any]] = {}

    def forget_starved(self, request: Request) -> None:
        """`request` was released (a release observer of the gateway)."""
        self.starved.pop(request, None)

    def prepare(self) -> None:
        if self.role.transfer_job is not None:
            self._land_transfers(self.role.transfer_job)
        self._retry_moves()
        self._admit()

    # ---------------------------------------------------------- transfers
    def _land_transfers(self, transfer_job: Callable[[Request], TransferJob]) -> None:
        """TRANSFERRING requests whose KV has landed: PREBUILT with the first token."""
        for request in self.table.in_state(S.TRANSFERRING):
            job = transfer_job(request)
            if job.outcome is None or not job.fence.done():
                missed = self.gateway.missed_fence(request)
                if missed is not None:  # presumed lost: fail it; its pages quarantine
                    self.gateway.finish(request, FinishReason.TRANSFER_FAILED,
                                        error=TimeoutError(f"{missed.name} missed its deadline"))
                continue
            status, value = job.outcome
            if status != "ok":
                self.gateway.finish(request, FinishReason.TRANSFER_FAILED, error=value)
                continue
            self.applier.land(request, value)

    # ------------------------------------------------------- retried moves
    def _retry_moves(self) -> None:
        after_prefill = self.role.after_prefill
        for request in self.table.in_state(S.PREBUILT, S.STAGING, S.RETRACTED):
            if request.state is S.PREBUILT:
                if after_prefill is not None:
                    self.gateway.advance(request, after_prefill, reason="first token")
            elif request.state is S.RETRACTED:
                self.gateway.requeue(request)
            else:
                missed = self.gateway.missed_fence(request)
                if missed is not None:  # staging can never complete: finish (the memory quarantines)
                    self.gateway.finish(request, FinishReason.ERROR,
                                        error=TimeoutError(f"{missed.name} missed its deadline"))
                elif all(f.done() for f in request.fences):
                    self.gateway.advance(request, S.DECODING, reason="staged")

    # ----------------------------------------------------------- admission
    def _admit(self) -> None:
        waiting = self.table.waiting
        if not waiting:
            return
        owner = self.table.owner
        role = self.role
        ready = self.scheduler.order(r for r in waiting if owner[r].admissible(r))  # issue 21: priority order
        why = role.transfer_unavailable() if role.transfer_unavailable is not None and ready else None
        if why is not None:
            ready = self._refuse_transfers(ready, why)
        self._admit_in_order(ready)
        if ready and ready[0].state is S.QUEUED and self._preempt_for(ready[0]):  # issue 21: priority retraction
            self._admit_in_order([r for r in ready if r.state is S.QUEUED])
        if ready and ready[0].state is S.QUEUED:
            self.check_starvation(ready[0])

    def _preempt_for(self, head: Request) -> bool:
        """Retract lower-priority running requests so `head` fits (the scheduler decides who)."""
        kv = self.kv_pool
        victims = self.scheduler.select_preemptions(
            head, self.table.in_state(S.DECODING), num_running=len(self.table.running()),
            free_slots=kv.slots.num_free, available_pages=kv.available_pages, retractable=_retractable,
            freed_pages=_own_pages)
        return sum(self.retract(victim, reason=f"priority of {head.request_id}") for victim in victims) > 0

    def _admit_in_order(self, ready: list[Request]) -> None:
        kv, owner, waiting, role = self.kv_pool, self.table.owner, self.table.waiting, self.role
        chosen = self.scheduler.select_admissions(
            ready, num_running=len(self.table.running()), free_slots=kv.slots.num_free,
            available_pages=kv.available_pages, takes_pages=lambda r: role.takes_pages(r, owner[r].leader))
        for request in chosen:
            into = role.admits(request, owner[request].leader)
            if not self.gateway.advance(request, into, reason="admitted"):
                break
            waiting.remove(request)
            self.applier.admitted(request)
            self._admissions += 1
            request.admitted_seq = self._admissions
            self.starved.pop(request, None)
            if request.num_cached_tokens is None:  # the first admission
                request.num_cached_tokens = request.kv_len
                queried = request.num_prompt_tokens - 1 if into is S.PREFILLING else 0
                self.stats.on_admit(request, time.monotonic(), request.kv_len, queried)

    def _refuse_transfers(self, ready: list[Request], why: str) -> list[Request]:
        """No prefill can take a job: every ready request that would need one (and its waiting siblings)
        finishes TRANSFER_FAILED now, instead of pre-allocating KV that nobody can fill."""
        owner = self.table.owner
        for request in [r for r in ready if self.role.admits(r, owner[r].leader) is S.TRANSFERRING]:
            for r in [r for r in owner[request].requests if r in self.table.waiting]:
                self.gateway.finish(r, FinishReason.TRANSFER_FAILED, error=TransferFailed(why))
        return [r for r in ready if not r.is_finished]

    def check_starvation(self, head: Request) -> None:
        """Report `head` (waiting for memory since it was queued, or since it arrived if its start
        was refused) once it has waited past the bound."""
        queued_at = head.entered_at(S.QUEUED) if head.history else head.arrival_time
        if head in self.starved or queued_at is None or self.clock() - queued_at < self.starvation_timeout:
            return
        record = starvation_record(self.report(), head.request_id, self.clock() - queued_at)
        self.starved[head] = record
        self.stats.starved += 1
        log.warning("memory.starved", **record)

    # --------------------------------------------------------------- batch
    def batch(self) -> list[ScheduledSeq]:
        grown: list[Request] = []
        for request in self.table.in_state(S.DECODING):
            if request.state is not S.DECODING:  # retracted as a victim meanwhile
                continue
            self.gateway.prune_fences(request)  # a long decode must not keep one completed backup fence per token
            if self._grow(request):
                grown.append(request)
        # NOTE: nothing enters DECODING while requests grow, so the grown ones still decoding (not
        # retracted as a victim after they grew) are the batch's decode rows, in table order
        decoding = [r for r in grown if r.state is S.DECODING]
        batch = self.scheduler.select_batch(self.table.in_state(S.PREFILLING), decoding)
        if self.draft_tokens:
            for s in batch:
                if s.samples and s.request.state is S.DECODING:
                    s.draft_budget = self._extend_for_drafts(s.request)
        return batch

    def _extend_for_drafts(self, request: Request) -> int:
        """The draft tokens `request` may verify this step, their KV slots grown through the
        machine; 0 when it does not speculate or a pool is short (then nothing stays grown)."""
        budget = draft_budget(request, self.draft_tokens, self.max_context)
        if budget and not self.gateway.extend(request, request.kv_len + 1 + budget):
            return 0
        return budget

    def _grow(self, request: Request) -> bool:
        """Cover the request's next token, retracting others under pressure; False if it
        cannot decode this step (finished, or a retraction was refused: retried next step)."""
        while request.state is S.DECODING:
            grown = self.gateway.grow(request, request.kv_len + 1)
            if grown is None:  # a hook failed: the gateway finished it
                return False
            if grown:
                return True
            victim = self.scheduler.select_victim(self.table.in_state(S.DECODING), retractable=_retractable)
            if victim is None:
                self.gateway.finish(request, FinishReason.ERROR, error=ResourceExhausted("no page to decode into"))
                return False
            if not self.retract(victim):
                return False
        return False

    def retract(self, request: Request, *, reason: str = "page pressure") -> bool:
        """DECODING -> RETRACTED -> QUEUED (back in its place in the queue); output is kept.
        False if the machine refused (the request stays where it was)."""
        if not self.gateway.advance(request, S.RETRACTED, reason=reason):
            return False
        self.applier.retracted(request)
        self.gateway.requeue(request)
        return True


def _own_pages(request: Request) -> int:
    """KV pages a retraction gives back at least (the request's own; its prefix may be shared)."""
    handle = request.handles.get("kv")
    return 0 if handle is None else handle.amount


def _retractable(request: Request) -> bool:
    return all(f.done() for f in request.fences)
