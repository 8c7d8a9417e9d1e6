"""The prefill role's hooks: the job a request answers, and the send of its KV.

A prefill-role request is the prefill side of one decode request's
`TransferJob`. It goes QUEUED -> PREFILLING -> PREBUILT -> FINISHED ->
RELEASED like any request whose first token ends it, and two hooks make its
job a resource the machine answers on every path::

    hook          acquire_on   scope                 holds
    kv_send       PREBUILT     PREBUILT, FINISHED    the send (`SendRecord`): staged chunks, fences
    prefill_job   QUEUED       every state but RELEASED   the job: answered at release if no send did

`kv_send` is released before `kv` (its acquisition runs after the KV is
complete, its release after the send's fences are done); `prefill_job` last
of the two, so a job is answered only once nothing writes the decode's pages.
`arm_on_admission` (a transition observer) starts a job's clock when its
request is admitted, as the time it waited for a prefill slot is not the
copy's.
"""

from __future__ import annotations

from engine.disagg.decode.kv_transfer_hook import FirstToken, TransferCancelled, TransferJob
from engine.disagg.decode.transfer import TransferFailed
from engine.disagg.link.messages import host_locations
from engine.disagg.prefill.send import KVSender, SendRecord
from resources.contract import ResourceHook
from resources.kv_hook import KVHook
from resources.kv_pool import KVPool
from resources.request_slots import RequestSlotHook
from states import HELD_STATES, FinishReason, Handle, Request, RequestState

S = RequestState
PREFILL_JOB, KV_SEND = "prefill_job", "kv_send"


class JobInbox:
    """Jobs handed to the runtime, until their request's `prefill_job` handle takes them."""

    def __init__(self) -> None:
        self._jobs: dict[Request, TransferJob] = {}

    def put(self, request: Request, job: TransferJob) -> None:
        self._jobs[request] = job

    def take(self, request: Request) -> TransferJob | None:
        return self._jobs.pop(request, None)

    def __len__(self) -> int:
        return len(self._jobs)


class PrefillJobHook(ResourceHook):
    """Holds a prefill request's job from its start; releasing it answers a job no send
    answered: failed, with why the request finished."""

    name = PREFILL_JOB
    acquire_on = frozenset({S.QUEUED})
    scope = HELD_STATES

    def __init__(self, inbox: JobInbox) -> None:
        self.inbox = inbox

    @staticmethod
    def job(request: Request) -> TransferJob | None:
        handle = request.handles.get(PREFILL_JOB)
        payload = None if handle is None else handle.payload
        return payload if isinstance(payload, TransferJob) else None

    def acquire(self, request: Request, into: RequestState) -> Handle[TransferJob] | None:
        job = self.inbox.take(request)
        return None if job is None else Handle(self.name, request.request_id, job)

    def release(self, request: Request, handle: Handle[TransferJob]) -> None:
        job = handle.payload
        if job.outcome is None:
            job.resolve("failed", why_unsent(request, job))


def why_unsent(request: Request, job: TransferJob) -> BaseException:
    """The error a job nothing sent is answered with, from how its request finished."""
    if job.cancelled or request.finish_reason is FinishReason.ABORT:
        return TransferCancelled(f"{job.request_id!r} cancelled")
    if request.finish_reason is FinishReason.SHUTDOWN:
        return TransferCancelled("the prefill shut down")
    if request.error is not None:
        return TransferFailed(f"the prefill failed: {request.error!r}")
    return TransferFailed(f"the prefill finished with {request.finish_reason} and sent nothing")


def arm_on_admission(request: Request, src: RequestState, dst: RequestState) -> None:
    """A transition observer: a job's clock starts when its request is admitted."""
    if dst is S.PREFILLING:
        job = PrefillJobHook.job(request)
        if job is not None and not job.started:
            job.start()


class KVSendHook(ResourceHook):
    """Entering PREBUILT starts the send of the request's KV; the handle holds the send's record
    (what a link sends, fences) until the send is done, and its release gives any staging back.
    Its fences keep the request's KV pages from release while the send reads them (a link
    sending from the pages: until the last byte has left)."""

    name = KV_SEND
    acquire_on = frozenset({S.PREBUILT})
    scope = frozenset({S.PREBUILT, S.FINISHED})
    before = ("kv", PREFILL_JOB)

    def __init__(self, sender: KVSender, kv_pool: KVPool) -> None:
        self.sender = sender
        self.kv_pool = kv_pool

    def acquire(self, request: Request, into: RequestState) -> Handle[SendRecord] | None:
        job = PrefillJobHook.job(request)
        if job is None or job.cancelled:  # nothing to send: an abort is on its way
            return None
        logprob = request.output_logprobs[-1] if request.output_logprobs else None
        first = FirstToken(request.output_token_ids[-1], logprob)
        slot, n = RequestSlotHook.slot(request), len(job.token_ids)
        src_locs = self.kv_pool.slots.req_to_token[slot, :n].clone()
        block = KVHook.block(request.handles[KVHook.name])  # NOTE: host-side page ids: no device read
        host_locs = host_locations(block.row[: block.num_pages], self.kv_pool.page_size, n)
        record = SendRecord(job, first, src_locs, host_locs)
        self.sender.start(record)
        return Handle(self.name, request.request_id, record, fences=record.fences)

    def release(self, request: Request, handle: Handle[SendRecord]) -> None:
        record = handle.payload
        staging = self.sender.staging
        # NOTE: `views` closes over the staged buffers: dropped with them, so a buffer the pool does not
        # keep is freed now, not whenever the garbage collector reaches a cycle that holds the record
        staged, record.staged, record.views = record.staged, [], None
        if staging is not None:
            for _chunk, buf in staged:
                staging.give(record.owner, buf, reuse=record.reusable)
