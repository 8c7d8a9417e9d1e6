"""The `kv_transfer` hook: a decode request's prefill job, held while TRANSFERRING.

Acquiring it (on entering TRANSFERRING, after the KV hook has pre-allocated
the slot and pages to receive) creates a `TransferJob`, puts its fence on the
request's KV and hands the job to the prefill worker. Leaving TRANSFERRING
for any reason releases it: on an abort that cancels the job if it has not
been sent. The KV pages themselves wait for the fence, so a copy still in
flight never writes freed memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from resources import ManualFence, ResourceHook
from resources.kv_hook import KVHook
from states import Handle, Request, RequestState

if TYPE_CHECKING:
    from engine.disagg.prefill_worker import PrefillWorker

S = RequestState
TRANSFER_FENCE = "kv_transfer"


@attrs.define(eq=False)
class TransferJob:
    request_id: str
    token_ids: list[int]
    params: Any
    mm_inputs: list
    dst_locs: torch.Tensor
    fence: ManualFence
    cancelled: bool = False
    #: set by the worker: ("ok", first_token) or ("failed", error)
    outcome: tuple[str, Any] | None = None


class KVTransferHook(ResourceHook):
    """Owns a decode request's transfer job while it is TRANSFERRING."""

    name = "kv_transfer"
    acquire_on = frozenset({S.TRANSFERRING})
    scope = frozenset({S.TRANSFERRING})
    before = ("kv",)

    def __init__(self, worker: "PrefillWorker", kv_pool: Any, fence_timeout: float, faults: Any = None) -> None:
        super().__init__()
        self.worker = worker
        self.kv_pool = kv_pool
        self.fence_timeout = fence_timeout
        self.faults = faults

    def acquire(self, request: Request, into: RequestState) -> Handle:
        slot = KVHook.slot(request)
        dst_locs = self.kv_pool.slots.req_to_token[slot, : request.num_tokens].clone()
        fence = ManualFence(TRANSFER_FENCE, {"kv"}, timeout=self.fence_timeout)
        job = TransferJob(request.request_id, request.all_token_ids, request.params, list(request.mm_inputs),
                          dst_locs, fence)
        request.fences.append(fence)
        self.worker.submit(job)
        return Handle(self.name, request.request_id, job, amount=request.num_tokens)

    @staticmethod
    def job(request: Request) -> TransferJob:
        """The job of a TRANSFERRING request."""
        return request.handles[KVTransferHook.name].payload

    def release(self, request: Request, handle: Handle) -> None:
        job: TransferJob = handle.payload
        if job.outcome is None:
            job.cancelled = True  # the worker skips the send; the fence still guards the pages
            self.worker.wake()
