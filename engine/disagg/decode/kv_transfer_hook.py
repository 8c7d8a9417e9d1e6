"""The `kv_transfer` hook: a decode request's prefill job, held while TRANSFERRING,
and the `PrefillClient` protocol every prefill backend implements.

Acquiring the hook (on entering TRANSFERRING, after the slot and KV hooks
have pre-allocated the pages to receive) creates a `TransferJob`, puts its
fence on the request's KV and hands the job to the prefill client. Leaving
TRANSFERRING for any reason releases it, which cancels the job: a job not
started yet is resolved at once (its fence completes, so an abort frees the
pages immediately); a job in flight keeps its fence until the client's
receiving side has returned. The KV pages wait for the fence, so a copy still
in flight never writes freed memory; a fence past its deadline quarantines
them until it completes after all.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch

from engine.disagg.decode.destination import KVDestination, PagedDestination
from engine.disagg.link.messages import host_locations
from resources import ManualFence, ResourceHook
from resources.kv_buffers import KVBuffers
from resources.kv_hook import KVHook
from resources.kv_pool import KVPool
from resources.ledger import Pool
from resources.request_slots import RequestSlotHook
from states import Handle, Request, RequestState, TokenLogprob

S = RequestState
TRANSFER_FENCE = "kv_transfer"


class TransferCancelled(RuntimeError):
    """The decode side gave the job up (abort, shutdown) before it landed."""


@attrs.frozen
class FirstToken:
    """What a prefill sends with the KV: the next token, and its logprob when the request
    asked for logprobs (so the decode side's output has one entry per token on every path)."""

    token: int
    logprob: TokenLogprob | None = None


@attrs.define(eq=False)
class TransferJob:
    """One prefill for one decode request.

    The prefill computes the KV of `prompt_token_ids + output_token_ids` (the
    outputs are those generated before a retraction) and samples the next
    token at output position ``len(output_token_ids)``, so seeded sampling
    does not depend on the path. Its KV lands at `dst_locs` of the decode
    side's KV buffers. The fence's deadline starts when the job starts
    (`start`), not while it waits for a worker.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: Any
    mm_inputs: list
    dst_locs: torch.Tensor
    fence: ManualFence
    fence_timeout: float
    #: where the KV lands: the request's KV pages (at `dst_locs`), or HiSparse's host rows
    destination: KVDestination | None = None
    started: bool = False
    cancelled: bool = False
    #: set once: ("ok", first_token) or ("failed", error)
    outcome: tuple[str, Any] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def start(self) -> None:
        self.started = True
        self.fence.arm(self.fence_timeout)

    def resolve(self, status: str, value: Any, *, landed: bool = True) -> None:
        """Record the outcome, ("ok", FirstToken) or ("failed", error); `landed=False` leaves
        the fence pending (a copy that may still write)."""
        if status == "ok" and not isinstance(value, FirstToken):
            value = FirstToken(int(value))
        if self.outcome is None:
            self.outcome = (status, value)
        if landed:
            self.fence.complete()


class PrefillClient(Protocol):
    """Where a decode engine's prefills run: in process (`engine.runtime.prefill_runtime.PrefillRuntime`) or
    remote (`engine.disagg.decode.remote_client.RemotePrefillClient`)."""

    #: extra pools for the decode engine's memory report (may be empty)
    pools: list[Pool]

    def submit(self, job: TransferJob) -> None:
        """Take a job; it must eventually be resolved (outcome set, fence completed
        once nothing writes its pages any more)."""

    def cancel(self, job: TransferJob) -> None:
        """Give the job up: resolve it at once if not started, else as soon as it is safe."""

    def unavailable(self) -> str | None:
        """Why no job can be filled now (no prefill peer is up), else None. While it says why, the
        decode admits nothing into TRANSFERRING (no KV is pre-allocated for a job nobody can fill):
        its waiting requests finish TRANSFER_FAILED with this reason, and its health is not ready."""

    async def run(self, *, task_status: Any) -> None:
        """The client's task in the engine's task group."""

    async def close(self) -> None:
        """Shutdown: cancel every job and wait (bounded by their fences) for those in flight."""

    @property
    def idle(self) -> bool:
        """Nothing in flight (part of `Engine.idle`)."""


def cancel_unstarted(job: TransferJob) -> bool:
    """Resolve a job that never started as cancelled; False if it has started."""
    job.cancelled = True
    if job.started:
        return False
    job.resolve("failed", TransferCancelled(f"{job.request_id!r} cancelled before its prefill started"))
    return True


class KVTransferHook(ResourceHook):
    """Owns a decode request's transfer job while it is TRANSFERRING."""

    name = "kv_transfer"
    acquire_on = frozenset({S.TRANSFERRING})
    scope = frozenset({S.TRANSFERRING})
    before: tuple[str, ...] = ("kv",)

    def __init__(self, client: PrefillClient, kv_pool: KVPool, kv_buffers: KVBuffers, fence_timeout: float,
                 landing: Landing | None = None) -> None:
        self.client = client
        self.kv_pool = kv_pool
        self.kv_buffers = kv_buffers
        self.fence_timeout = fence_timeout
        #: (request, tokens) -> where the KV lands when not in the request's KV pages (HiSparse's host rows)
        self.landing = landing
        if landing is not None:  # NOTE: acquired after the hooks whose memory the landing writes
            self.before = ("kv", *landing.protects)

    @staticmethod
    def job(request: Request) -> TransferJob:
        """The job of a TRANSFERRING request."""
        payload = request.handles[KVTransferHook.name].payload
        assert isinstance(payload, TransferJob)
        return payload

    def acquire(self, request: Request, into: RequestState) -> Handle[TransferJob]:
        n = request.num_tokens
        destination: KVDestination
        if self.landing is not None:
            destination = self.landing.destination(request, n)
            dst_locs = torch.empty(0, dtype=torch.int64)
        else:
            dst_locs = self.kv_pool.slots.req_to_token[RequestSlotHook.slot(request), :n].clone()
            block = KVHook.block(request.handles[KVHook.name])  # NOTE: host-side page ids: no device read
            host_locs = host_locations(block.row[: block.num_pages], self.kv_pool.page_size, n)
            destination = PagedDestination(self.kv_buffers, dst_locs, host_locs)
        fence = ManualFence(TRANSFER_FENCE, {"kv", *destination.protects}, timeout=self.fence_timeout, armed=False)
        job = TransferJob(request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                          request.params, list(request.mm_inputs), dst_locs, fence, self.fence_timeout,
                          destination=destination)
        self.client.submit(job)
        return Handle(self.name, request.request_id, job, fences=(fence,))

    def release(self, request: Request, handle: Handle[TransferJob]) -> None:
        job = handle.payload
        if job.outcome is None:
            self.client.cancel(job)
        elif job.outcome[0] == "ok" and job.destination is not None:
            job.destination.landed()


class Landing(Protocol):
    """Where a decode-role transfer lands when not in the request's KV pages (HiSparse's host rows)."""

    #: the hooks whose memory the destinations write (the transfer's fence guards them too)
    protects: tuple[str, ...]

    def destination(self, request: Request, num_tokens: int) -> KVDestination: ...
