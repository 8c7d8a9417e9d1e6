"""The prefill side of one link: a control-receiving thread and a sending thread.

The control thread reads the decode's JOB, CANCEL, PING and BYE frames and
hands jobs and cancels to the server (on its event loop). The sending
thread answers the link's jobs strictly in the order they arrived: it waits
for the oldest job's outcome (sending a keepalive every `keepalive` s
meanwhile, so the decode can tell a busy prefill from a dead or stopped
one), then sends its RESULT header (with the first token's logprob when the
job asked for it, and where its page runs start) and, if it succeeded, the
messages of each chunk (`engine.disagg.link.messages`), the next chunk's
posted before this one's are waited for.

What it sends is the `kv_send` handle's (`SendRecord.views`: the KV pages
themselves, or the staged chunks): the link only reads it, and says when it
is done (`SendRecord.wire_done`), which completes the fence guarding it
(the pages fence when it sends from the pages). Done means: every message
has left, or never will (every send posted was waited for, and a failed or
timed-out one closes the pair, so gloo reads nothing later), or none was
posted. The prefill request's release waits for that fence, then frees the
pages (and gives any staging back), as for every path.

A link that fails (a send or receive error or timeout, the decode's
silence for `liveness_timeout`, its BYE) is down for good: its jobs not yet
computed are cancelled, so their requests finish and release through the
prefill's own machine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import attrs
import structlog
import torch
import torch.distributed as dist

from engine.disagg.link.messages import chunk_pieces, cuts
from engine.disagg.link.transport import LinkError, Pair, classify
from engine.disagg.link.wire import (BYE, CANCEL, CANCELLED, FAILED, JOB, OK, PING, RESULT, Chunk, JobSpec,
                                     ProtocolError, decode_job, empty_header, encode_logprob, header, job_index,
                                     result_frames)
from engine.disagg.prefill.send import SendRecord
from engine.thread_names import named_thread

log = structlog.get_logger("kvlife.transfer")


@attrs.define(eq=False)
class _Unit:
    """Messages posted together and waited for together: a RESULT (with its extras) and/or one chunk."""

    works: list[dist.Work]
    timeout: float
    ctl: int = 0  # the first `ctl` works are control messages
    chunk: int = 0  # 1 if it carries a chunk (at most two are in flight)
    done: ServerJob | None = None  # the job it finishes once waited for
    status: int = OK  # that job's answer
    keep: list[torch.Tensor] = attrs.field(factory=list)  # the control tensors, alive until waited for


@attrs.define(eq=False)
class ServerJob:
    """One decode job on the prefill side."""

    link: Any
    tag: int
    spec: JobSpec | None
    received: float
    deadline: float
    worker_id: str = ""
    job: Any = None  # the prefill runtime's TransferJob
    send: SendRecord | None = None  # the `kv_send` handle's record once its KV is staged
    error: str | None = None  # refused before reaching the runtime
    cancelled: bool = False  # the decode gave it up
    expired: bool = False  # over its compute budget
    ready: bool = False  # its outcome is known

    def answer(self) -> tuple[int, int, str, bytes]:
        """(status, first token, reason, encoded logprob) to send."""
        if self.error is not None:
            return FAILED, 0, self.error, b""
        status, value = self.job.outcome
        if status == "ok" and self.send is not None and self.send.views is not None:
            return OK, int(value.token), "", encode_logprob(value.logprob)
        if self.cancelled:
            return CANCELLED, 0, "cancelled by the decode", b""
        if self.expired:
            return FAILED, 0, "over the compute budget", b""
        return FAILED, 0, repr(value)[:500], b""

    def wire_done(self, *, reusable: bool = True) -> None:
        """Nothing of this job's staging will be read by the link any more."""
        if self.send is not None:
            self.send.wire_done(reusable=reusable)


class PrefillLink:
    """One epoch of one decode's link (see the module docstring)."""

    def __init__(self, server: Any, pair: Pair, name: str, settings: Any, *, epoch: int = 0,
                 vocab_size: int | None = None) -> None:
        self.server = server
        #: a job with a token id outside [0, vocab_size) is answered FAILED by this thread (None: not checked)
        self.vocab_size = vocab_size
        self.pair = pair
        self.name = name
        self.epoch = epoch
        self.settings = settings
        self.outbox: deque[ServerJob] = deque()
        self.jobs: dict[int, ServerJob] = {}
        self.cond = threading.Condition()
        self.up = True
        self._bye = False  # say goodbye before the sending thread stops
        self._threads = [named_thread(pair.running(self._recv_loop), name=f"kvlife-ctl-{name}"),
                         named_thread(pair.running(self._send_loop), name=f"kvlife-answer-{name}")]

    def start(self) -> None:
        self.pair.hold(len(self._threads))  # NOTE: the last thread to return closes the pair
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0))
        return not any(t.is_alive() for t in self._threads)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def attach(self, sj: ServerJob, record: SendRecord) -> bool:
        """Send a job's staged chunks (its `kv_send` record) when its turn comes; False (keeping
        nothing) if the link is down."""
        with self.cond:
            if not self.up:
                return False
            sj.send = record
            return True

    # ------------------------------------------------------ receiving
    def _recv_loop(self) -> None:
        hdr = empty_header()
        s = self.settings
        try:
            work = self.pair.post_recv_ctl(hdr)
            while True:
                self.pair.wait_ctl(work, s.liveness_timeout)
                op, tag, size = hdr[:3].tolist()
                if not self.up:
                    return
                if op == BYE:
                    raise LinkError("shutdown", "the decode left")
                if op in (PING, CANCEL):
                    work = self.pair.post_recv_ctl(hdr)
                    with self.cond:
                        sj = self.jobs.get(tag) if op == CANCEL else None
                    if sj is not None:
                        self.server.call(self.server.cancel_job, sj, "cancelled")
                    continue
                if op != JOB:
                    raise ProtocolError(f"unexpected control message op {op}")
                index = job_index(hdr.tolist(), s.staging_bytes)  # one message carries a batch of jobs
                frame = torch.empty(size, dtype=torch.uint8)
                self.pair.recv_ctl(frame, s.chunk_timeout(size))
                work = self.pair.post_recv_ctl(hdr)  # NOTE: the next frame's header lands while this one is read
                self._take_jobs(index, frame)
        except Exception as exc:  # noqa: BLE001 - every failure ends the link
            self.down(classify(exc))

    def _take_jobs(self, index: list[tuple[int, int]], frame: torch.Tensor) -> None:
        """Queue each job of a JOB message for its answer, in order, and hand the server those that parsed."""
        now, offset, jobs = time.monotonic(), 0, []
        for tag, nbytes in index:
            try:
                spec = decode_job(frame[offset: offset + nbytes], vocab_size=self.vocab_size)
                jobs.append(ServerJob(self, tag, spec, now, now + spec.budget))
            except ProtocolError as exc:
                jobs.append(ServerJob(self, tag, None, now, now, error=f"malformed job: {exc}", ready=True))
            offset += nbytes
        with self.cond:
            for sj in jobs:
                self.outbox.append(sj)
                self.jobs[sj.tag] = sj
            self.cond.notify_all()
        for sj in jobs:
            if sj.error is None:
                self.server.call(self.server.submit_job, sj)

    # -------------------------------------------------------- sending
    def _send_loop(self) -> None:
        try:
            self._send_items()
        except Exception as exc:  # noqa: BLE001 - every failure ends the link
            self.down(classify(exc))
        finally:  # NOTE: the only user of the pair's data group: an NCCL group is aborted as it leaves
            self.pair.close()

    def _send_items(self) -> None:
        """Answer the jobs in order, the next job's header and messages posted before the last chunk of
        the one before is waited for (`_Unit`), so the wire never idles for a round trip between jobs."""
        s = self.settings
        last = time.monotonic()
        posting: Iterator[_Unit] | None = None  # the units of the job being posted
        pending: deque[_Unit] = deque()  # posted, not waited for yet, in posting order
        open_jobs: list[ServerJob] = []  # popped and not finished: this thread's alone (`down` no longer sees them)
        try:
            while True:
                if posting is None:
                    with self.cond:
                        head = None
                        if not self.up and not pending:
                            if self._bye:
                                self.pair.send_ctl(header(BYE), s.chunk_slack)
                            return
                        if self.up and self.outbox and self.outbox[0].ready:
                            head = self.outbox.popleft()
                            self.jobs.pop(head.tag, None)
                        elif not pending:
                            self.cond.wait(max(s.keepalive - (time.monotonic() - last), 0.001))
                    if head is not None:
                        open_jobs.append(head)
                        posting = self._post_answer(head)
                    elif not pending:
                        if time.monotonic() - last >= s.keepalive and self.up:
                            self.pair.send_ctl(header(PING), s.chunk_slack)
                            last = time.monotonic()
                        continue
                if posting is not None and sum(u.chunk for u in pending) < 2:
                    unit = next(posting, None)
                    if unit is None:
                        posting = None
                    else:
                        pending.append(unit)
                    continue
                unit = pending.popleft()
                self.pair.wait_all(unit.works, unit.timeout, ctl=unit.ctl)
                if unit.done is not None:
                    self._finished(unit.done, unit.status)
                    open_jobs.remove(unit.done)
                last = time.monotonic()
        except BaseException:
            if pending:  # a wait failed or timed out: the link is over, and after the abort nothing is read
                self.pair.abort()
            for unit in pending:
                self.pair.drain(unit.works, unit.timeout)
            raise
        finally:
            for sj in open_jobs:
                sj.wire_done(reusable=False)  # a send that failed: its buffers are never reused
                self.server.forget_job(sj)

    def _post_answer(self, sj: ServerJob) -> Iterator[_Unit]:
        """Post a job's RESULT (with its reason, logprob and run starts), then each chunk's messages,
        one `_Unit` at a time; the last unit finishes the job once waited for."""
        s, points = self.settings, self.server.test_points
        status, first_token, reason, logprob = sj.answer()
        record = sj.send if status == OK else None
        runs = None if record is None else record.src_runs
        ctl = result_frames(sj.tag, status, first_token, reason.encode(), logprob, runs)
        nbytes = sum(t.numel() * t.element_size() for t in ctl)
        works: list[dist.Work] = []
        self._post_all(works, ctl, s.chunk_timeout(nbytes), ctl=True)
        if record is None or not record.plan:
            yield _Unit(works, s.chunk_timeout(nbytes), ctl=len(works), done=sj, status=status, keep=ctl)
            return
        spec = sj.spec
        assert spec is not None and record.views is not None  # an OK answer has both
        views, cut, plan = record.views, cuts(runs, spec.runs), record.plan
        for index, chunk in enumerate(plan):
            if points is not None:
                points("sending", spec.request_id, index)
            data = list(views(index, chunk, chunk_pieces(self.server.layout, chunk, cut)))
            n = len(works)
            timeout = s.chunk_timeout(chunk.nbytes + nbytes)
            self._post_all(works, data, timeout)
            yield _Unit(works, timeout, ctl=n, chunk=1, done=sj if index == len(plan) - 1 else None, status=status,
                        keep=ctl)
            works, ctl, nbytes = [], [], 0

    def _post_all(self, works: list[dist.Work], tensors: list[torch.Tensor], timeout: float, *,
                  ctl: bool = False) -> None:
        """Post a send of each tensor (control messages with `ctl`, else chunks) into `works`; if one fails
        (the pair is closed), the ones posted are drained before it raises, so nothing reads their memory
        afterwards."""
        try:
            self.pair.post_each(works, tensors, send=True, ctl=ctl)
        except BaseException:
            if works:
                self.pair.abort()
                self.pair.drain(works, timeout)
            raise

    def _finished(self, sj: ServerJob, status: int) -> None:
        """Every message of an answered job has left: count it, and let its release reuse what was sent."""
        stats, record = self.server.stats, sj.send
        if status == OK and record is not None:
            assert sj.spec is not None
            nbytes = sum(chunk.nbytes for chunk in record.plan)
            stats.job_ok(nbytes, None, time.monotonic() - sj.received)
            log.debug("transfer.sent", request_id=sj.spec.request_id, peer=self.name, epoch=self.epoch, bytes=nbytes)
        elif status == FAILED:
            stats.job_failed("prefill_failed")
        sj.wire_done(reusable=True)
        self.server.forget_job(sj)

    # ------------------------------------------------------------- down
    def down(self, error: LinkError) -> None:
        """End the link (idempotent): cancel its jobs; their staging was never posted."""
        with self.cond:
            if not self.up:
                return
            self.up = False
            self._bye = error.cause == "shutdown"
            jobs = list(self.outbox)
            self.outbox.clear()
            self.jobs.clear()
            self.cond.notify_all()
        for sj in jobs:
            sj.wire_done()  # never posted: the release may reuse the buffers
        level = log.info if error.cause in ("shutdown", "peer_closed") and not jobs else log.warning
        level("transfer.link_down", peer=self.name, epoch=self.epoch, cause=error.cause, error=str(error), jobs_cancelled=len(jobs))
        self.server.call(self.server.link_down, self, jobs, error)
