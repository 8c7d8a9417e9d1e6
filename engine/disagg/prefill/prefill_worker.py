"""The decode role's in-process prefill: a `PrefillClient` with its own machine and pools.

With `EngineConfig(disaggregation="decode")` (and no remote prefill) a
request is admitted into TRANSFERRING: the slot and KV hooks pre-allocate
its pages to receive, and the `kv_transfer` hook hands a job to this worker.
The worker runs its own request through its own machine and pools (QUEUED
-> PREFILLING -> PREBUILT -> FINISHED -> RELEASED), computes the KV and the
next token, and the transfer backend copies the pages into the decode
side's. The decode request then enters PREBUILT with that token, exactly
like a locally prefilled one.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from engine.disagg.decode.kv_transfer_hook import TRANSFER_FENCE, TransferCancelled, TransferJob, cancel_unstarted
from engine.disagg.decode.transfer import TransferBackend
from engine.model.batch import ScheduledSeq
from resources.request_slots import RequestSlotHook
from resources.ledger import Pool
from states import FinishReason, Request, RequestState, ResourceExhausted

if TYPE_CHECKING:
    from engine.runtime.assembly import EngineParts

S = RequestState
log = structlog.get_logger("kvlife.disaggregation")


class PrefillWorker:
    """Runs prefill jobs through its own machine and pools, then sends the KV."""

    def __init__(self, parts: EngineParts, transfer: TransferBackend, *, faults: Any = None) -> None:
        self.parts = parts
        self.machine = parts.machine
        self.transfer = transfer
        self.faults = faults
        self.jobs: deque[TransferJob] = deque()
        self.requests: list[Request] = []  # worker-side requests not yet RELEASED
        self.pools: list[Pool] = [PrefixedPool("prefill.", pool, parts.ledger) for pool in parts.pools]
        self._closing = False
        self._wake = anyio.Event()

    # ------------------------------------------------------- PrefillClient
    def submit(self, job: TransferJob) -> None:
        self.jobs.append(job)
        self._wake.set()

    def cancel(self, job: TransferJob) -> None:
        cancel_unstarted(job)  # a started job notices `cancelled` before sending
        self._wake.set()

    @property
    def idle(self) -> bool:
        return not self.requests and not any(job.outcome is None for job in self.jobs)

    async def close(self) -> None:
        self._closing = True
        for job in self.jobs:
            cancel_unstarted(job)
        self.jobs.clear()
        while self.requests:
            self._release_finished()
            if self.requests:
                await anyio.sleep(0.005)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._release_finished()
            while self.jobs and self.jobs[0].outcome is not None:  # cancelled before it started
                self.jobs.popleft()
            job = self.jobs[0] if self.jobs and not self._closing else None
            if job is None or not await self._process(job):
                with anyio.move_on_after(None if not (job or self.requests) else 0.005):
                    await self._wake.wait()
                self._wake = anyio.Event()

    # -------------------------------------------------------------- a job
    async def _process(self, job: TransferJob) -> bool:
        """Run one job; False if the worker's pools cannot take it yet."""
        kv = self.parts.kv_pool
        if kv.slots.num_free == 0 or kv.available_pages < kv.pages_for(len(job.token_ids)):
            return False
        request = Request(f"prefill:{job.request_id}", list(job.prompt_token_ids), job.params,
                          mm_inputs=job.mm_inputs, output_token_ids=list(job.output_token_ids))
        try:
            self.machine.start(request)
        except ResourceExhausted:
            return False
        except Exception as exc:
            self.jobs.popleft()
            job.resolve("failed", exc)
            return True
        self.requests.append(request)
        try:
            self.machine.advance(request, S.PREFILLING, reason="prefill job")
        except ResourceExhausted:  # e.g. the multimodal cache is full: retried as a fresh request
            self._finish(request, FinishReason.ABORT)
            return False
        except Exception as exc:
            self.jobs.popleft()
            self._finish(request, FinishReason.ERROR)
            job.resolve("failed", exc)
            return True
        self.jobs.popleft()
        job.start()
        try:
            first_token = await anyio.to_thread.run_sync(self._prefill, request, job)
            num_tokens = request.num_tokens
            request.output_token_ids.append(first_token)
            self.machine.advance(request, S.PREBUILT, reason="prefilled")
            if job.cancelled:
                self._finish(request, FinishReason.ABORT)
                job.resolve("failed", TransferCancelled(f"{job.request_id!r} cancelled"))
                return True
            slot = RequestSlotHook.slot(request)
            src_locs = self.parts.kv_pool.slots.req_to_token[slot, :num_tokens]
            await anyio.to_thread.run_sync(self.transfer.send, self.parts.kv_buffers, src_locs, job.dst_locs,
                                           job.request_id, job.destination)
        except Exception as exc:
            log.warning("transfer.failed", request_id=job.request_id, error=repr(exc))
            self._finish(request, FinishReason.ERROR)
            job.resolve("failed", exc)
            return True
        except BaseException:  # cancelled mid-job: finish it, so no fence is left to time out
            self._finish(request, FinishReason.SHUTDOWN)
            job.resolve("failed", TransferCancelled("engine shut down"))
            raise
        stuck = self.faults is not None and self.faults.fence_stuck(TRANSFER_FENCE, job.request_id)
        if stuck:  # the copy does not land in time: both sides' fences miss their deadlines
            self.machine.add_fence(request, self.faults.stuck_fence("kv_send", {"kv"}, timeout=job.fence_timeout))
            self.faults.stuck.append(job.fence)  # `unstick()` lands it on the decode side too
        self._finish(request, FinishReason.LENGTH)
        job.resolve("ok", first_token, landed=not stuck)
        return True

    def _prefill(self, request: Request, job: TransferJob) -> int:
        """Chunked prefill of every token given in the worker's pools; returns the next token.
        A job cancelled meanwhile stops between chunks (`TransferCancelled`)."""
        runner, budget = self.parts.runner, self.parts.config.max_prefill_tokens
        token = None
        while request.kv_len < request.num_tokens:
            if job.cancelled:
                raise TransferCancelled(f"{job.request_id!r} cancelled during its prefill")
            n = min(budget, request.num_tokens - request.kv_len)
            seq = ScheduledSeq(request, request.kv_len, n, request.kv_len + n == request.num_tokens)
            output = runner.step([seq])
            for observer in self.parts.step_observers:
                observer([seq], output)
            request.kv_len += n
            if output.tokens:
                token = output.tokens[0]
        assert token is not None, "a prefill's last chunk samples"
        return token

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.machine.finish(request, reason)
        self._release_finished()

    def _release_finished(self) -> None:
        self.machine.reap_quarantine()
        for request in list(self.requests):
            if request.state is S.FINISHED and self.machine.try_release(request):
                self.requests.remove(request)


class PrefixedPool:
    """A prefill worker's pool in the decode engine's memory report (with its own ledger)."""

    def __init__(self, prefix: str, pool: Any, ledger: Any) -> None:
        self.name = prefix + pool.name
        self.pool = pool
        self.ledger = ledger  # NOTE: the report reads held/quarantined from this ledger under `ledger_name`
        self.ledger_name = pool.name

    def stats(self) -> Any:
        return self.pool.stats()

    def shared_owners(self) -> list[Any]:
        shared = getattr(self.pool, "shared_owners", None)
        return shared() if shared is not None else []
