"""The decode role: an in-process prefill worker and a KV transfer backend.

With `EngineConfig(disaggregation="decode")` a request is admitted into
TRANSFERRING: the KV hook pre-allocates its slot and pages to receive, and
the `kv_transfer` hook (scope: TRANSFERRING only) hands a job to the prefill
worker and puts a fence on the request's KV. The worker runs its own request
through its own machine and pools (QUEUED -> PREFILLING -> PREBUILT ->
FINISHED -> RELEASED), computes the prompt KV and the first token, and the
transfer backend copies the pages into the decode side's. The decode request
then enters PREBUILT with that token, exactly like a locally prefilled one.

Leaving TRANSFERRING for any reason releases the `kv_transfer` handle: on an
abort that cancels the job if it has not been sent. The KV pages themselves
wait for the fence, so a copy still in flight never writes freed memory; a
copy that misses the deadline quarantines them.

`TransferBackend` is the seam for a multi-process backend (torch.distributed:
gloo on CPU, NCCL on GPU): the machine and the hooks only see a job, its
outcome and its fence.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import anyio
import structlog

from engine.disagg.kv_transfer_hook import TRANSFER_FENCE, TransferJob
from engine.disagg.transfer import TransferBackend, TransferFailed
from engine.runtime.scheduler import ScheduledSeq
from resources import ManualFence, ResourceExhausted
from resources.kv_hook import KVHook
from states import FinishReason, Request, RequestState

S = RequestState
log = structlog.get_logger("kvlife.disaggregation")


class PrefillWorker:
    """Runs prefill jobs through its own machine and pools, then sends the KV."""

    def __init__(self, parts: Any, transfer: TransferBackend, *, faults: Any = None,
                 fence_timeout: float = 30.0) -> None:
        self.parts = parts
        self.machine = parts.machine
        self.transfer = transfer
        self.faults = faults
        self.fence_timeout = fence_timeout
        self.jobs: deque[TransferJob] = deque()
        self.requests: dict[str, Request] = {}  # worker-side requests not yet RELEASED
        self._wake = anyio.Event()

    def submit(self, job: TransferJob) -> None:
        self.jobs.append(job)
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self.release_finished()
            job = self.jobs[0] if self.jobs else None
            if job is None or not await self._process(job):
                with anyio.move_on_after(None if not (job or self.requests) else 0.005):
                    await self._wake.wait()
                self._wake = anyio.Event()

    async def _process(self, job: TransferJob) -> bool:
        """Run one job; False if the worker's pools cannot take it yet."""
        kv = self.parts.kv_pool
        if not job.cancelled and (kv.slots.num_free == 0 or kv.available_pages < kv.pages_for(len(job.token_ids))):
            return False
        request = Request(f"prefill:{job.request_id}", job.token_ids, job.params, mm_inputs=job.mm_inputs)
        self.machine.start(request)
        self.requests[request.request_id] = request
        if job.cancelled:
            self.jobs.popleft()
            return self._finish(request, job, FinishReason.ABORT, ("failed", TransferFailed("cancelled")))
        try:
            self.machine.advance(request, S.PREFILLING, reason="prefill job")
        except ResourceExhausted:  # e.g. the multimodal cache is full: retried as a fresh request
            self.machine.finish(request, FinishReason.ABORT)
            self.release_finished()
            return False
        except Exception as exc:
            self.jobs.popleft()
            return self._finish(request, job, FinishReason.ERROR, ("failed", exc))
        self.jobs.popleft()
        try:
            first_token = await anyio.to_thread.run_sync(self._prefill, request)
            request.output_token_ids.append(first_token)
            self.machine.advance(request, S.PREBUILT, reason="prefilled")
            if job.cancelled:
                return self._finish(request, job, FinishReason.ABORT, ("failed", TransferFailed("cancelled")))
            slot = KVHook.slot(request)
            src_locs = self.parts.kv_pool.slots.req_to_token[slot, : request.num_prompt_tokens]
            await anyio.to_thread.run_sync(self.transfer.send, self.parts.kv_buffers, src_locs, job.dst_locs,
                                           job.request_id)
        except Exception as exc:
            log.warning("transfer.failed", request_id=job.request_id, error=repr(exc))
            return self._finish(request, job, FinishReason.ERROR, ("failed", exc))
        except BaseException:  # cancelled mid-job: finish it, so no fence is left to time out
            self._finish(request, job, FinishReason.SHUTDOWN, ("failed", TransferFailed("engine shut down")))
            raise
        return self._finish(request, job, FinishReason.LENGTH, ("ok", first_token))

    def _prefill(self, request: Request) -> int:
        """Chunked prefill of the whole prompt in the worker's pools; returns the first token."""
        runner, budget = self.parts.runner, self.parts.config.max_prefill_tokens
        token = None
        while request.kv_len < request.num_tokens:
            n = min(budget, request.num_tokens - request.kv_len)
            seq = ScheduledSeq(request, request.kv_len, n, request.kv_len + n == request.num_tokens)
            output = runner.step([seq])
            for observer in self.parts.step_observers:
                observer([seq], output)
            request.kv_len += n
            if output.tokens:
                token = output.tokens[0]
        return token

    def _finish(self, request: Request, job: TransferJob, reason: FinishReason, outcome: tuple) -> bool:
        stuck = self.faults is not None and self.faults.fence_stuck(TRANSFER_FENCE, job.request_id)
        if stuck:  # the copy "never lands": both sides' fences miss their deadlines
            request.fences.append(ManualFence("kv_send", {"kv"}, timeout=self.fence_timeout))
        self.machine.finish(request, reason)
        job.outcome = outcome
        if not stuck:
            job.fence.complete()
        self.release_finished()
        return True

    def release_finished(self) -> None:
        for rid, request in list(self.requests.items()):
            if request.state is S.FINISHED and self.machine.try_release(request):
                del self.requests[rid]
                self.parts.ledger.forget_request(rid)


class PrefixedPool:
    """The prefill worker's pools in the decode engine's memory report."""

    def __init__(self, prefix: str, pool: Any, ledger: Any) -> None:
        self.name = prefix + pool.name
        self._pool = pool
        self._ledger = ledger

    def stats(self):
        return self._pool.stats()

    def owners(self):
        owners = getattr(self._pool, "owners", None)
        return owners() if owners is not None else self._ledger.owners(self._pool.name)
