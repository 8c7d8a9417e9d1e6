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
from typing import Any

import attrs
import structlog
import torch
import torch.distributed as dist

from engine.disagg.link.messages import chunk_pieces, cuts
from engine.disagg.link.transport import LinkError, Pair, classify
from engine.disagg.link.wire import (BYE, CANCEL, CANCELLED, FAILED, JOB, OK, PING, RESULT, Chunk, JobSpec,
                                     ProtocolError, decode_job, empty_header, encode_logprob, header)
from engine.disagg.prefill.send import SendRecord

log = structlog.get_logger("kvlife.transfer")


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

    def __init__(self, server: Any, pair: Pair, name: str, settings: Any, *, epoch: int = 0) -> None:
        self.server = server
        self.pair = pair
        self.name = name
        self.epoch = epoch
        self.settings = settings
        self.outbox: deque[ServerJob] = deque()
        self.jobs: dict[int, ServerJob] = {}
        self.cond = threading.Condition()
        self.up = True
        self._bye = False  # say goodbye before the sending thread stops
        self._threads = [threading.Thread(target=self._recv_loop, name=f"kvlife-ctl-{name}", daemon=True),
                         threading.Thread(target=self._send_loop, name=f"kvlife-answer-{name}", daemon=True)]

    def start(self) -> None:
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
            while True:
                self.pair.recv_ctl(hdr, s.liveness_timeout)
                op, tag, size = hdr[:3].tolist()
                if not self.up:
                    return
                if op == PING:
                    continue
                if op == BYE:
                    raise LinkError("shutdown", "the decode left")
                if op == CANCEL:
                    with self.cond:
                        sj = self.jobs.get(tag)
                    if sj is not None:
                        self.server.call(self.server.cancel_job, sj, "cancelled")
                    continue
                if op != JOB or not 0 < size <= s.staging_bytes:
                    raise ProtocolError(f"unexpected control message op {op} size {size}")
                frame = torch.empty(size, dtype=torch.uint8)
                self.pair.recv_ctl(frame, s.chunk_timeout(size))
                now = time.monotonic()
                try:
                    spec = decode_job(frame)
                    sj = ServerJob(self, tag, spec, now, now + spec.budget)
                except ProtocolError as exc:
                    sj = ServerJob(self, tag, None, now, now, error=f"malformed job: {exc}", ready=True)
                with self.cond:
                    self.outbox.append(sj)
                    self.jobs[tag] = sj
                    self.cond.notify_all()
                if sj.error is None:
                    self.server.call(self.server.submit_job, sj)
        except Exception as exc:  # noqa: BLE001 - every failure ends the link
            self.down(classify(exc))

    # -------------------------------------------------------- sending
    def _send_loop(self) -> None:
        try:
            self._send_items()
        finally:  # NOTE: the only user of the pair's data group: an NCCL group is aborted as it leaves
            self.pair.close()

    def _send_items(self) -> None:
        s = self.settings
        last = time.monotonic()
        try:
            while True:
                with self.cond:
                    if not self.up:
                        if self._bye:
                            self.pair.send_ctl(header(BYE), s.chunk_slack)
                        return
                    head = self.outbox.popleft() if self.outbox and self.outbox[0].ready else None
                    if head is None:
                        self.cond.wait(max(s.keepalive - (time.monotonic() - last), 0.001))
                    else:
                        self.jobs.pop(head.tag, None)
                if head is None:
                    if time.monotonic() - last >= s.keepalive and self.up:
                        self.pair.send_ctl(header(PING), s.chunk_slack)
                        last = time.monotonic()
                    continue
                sent = False
                try:
                    self._answer(head)
                    sent = True
                finally:  # NOTE: the popped job is this thread's alone: `down` no longer sees it
                    head.wire_done(reusable=sent)  # a send that failed: its buffers are never reused
                    self.server.forget_job(head)  # NOTE: not through the loop: the next answer must not wait for it
                last = time.monotonic()
        except Exception as exc:  # noqa: BLE001
            self.down(classify(exc))

    def _answer(self, sj: ServerJob) -> None:
        s, stats = self.settings, self.server.stats
        status, first_token, reason, logprob = sj.answer()
        record = sj.send if status == OK else None
        runs = None if record is None else record.src_runs
        raw = reason.encode()
        self.pair.send_ctl(header(RESULT, sj.tag, status, first_token, len(raw), len(logprob), len(runs or ()),
                                  int(runs is not None)), s.chunk_slack)
        extras = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (raw, logprob) if b]
        if runs:
            extras.append(torch.tensor(runs, dtype=torch.int64))
        for extra in extras:
            self.pair.send_ctl(extra, s.chunk_timeout(extra.numel() * extra.element_size()))
        if record is None:
            if status == FAILED:
                stats.job_failed("prefill_failed")
            return
        spec = sj.spec
        assert spec is not None and record.views is not None  # an OK answer has both
        self._send_chunks(spec.request_id, record, cuts(runs, spec.runs))
        nbytes = sum(chunk.nbytes for chunk in record.plan)
        stats.job_ok(nbytes, None, time.monotonic() - sj.received)
        log.debug("transfer.sent", request_id=spec.request_id, peer=self.name, epoch=self.epoch, bytes=nbytes)

    def _send_chunks(self, request_id: str, record: SendRecord, cut: list[int] | None) -> None:
        """Post each chunk's messages, then wait for the chunk before; every send posted is waited for
        before this returns, even on a failure (bounded by its timeout; a failed or timed-out send closes
        the pair), so nothing reads the record's memory after it."""
        layout, points = self.server.layout, self.server.test_points
        views = record.views
        assert views is not None
        outstanding: list[tuple[Chunk, list[dist.Work]]] = []
        try:
            for index, chunk in enumerate(record.plan):
                if points is not None:
                    points("sending", request_id, index)
                pieces = chunk_pieces(layout, chunk, cut)
                works: list[dist.Work] = []
                outstanding.append((chunk, works))
                for view in views(index, chunk, pieces):
                    works.append(self.pair.post_send_data(view))
                if len(outstanding) > 1:
                    self.pair.wait_all(outstanding[0][1], self.settings.chunk_timeout(outstanding[0][0].nbytes))
                    outstanding.pop(0)
            while outstanding:
                self.pair.wait_all(outstanding[0][1], self.settings.chunk_timeout(outstanding[0][0].nbytes))
                outstanding.pop(0)
        except BaseException:
            if outstanding:  # a wait failed or timed out: the link is over, and after the abort nothing is read
                self.pair.abort()
            for chunk, works in outstanding:
                self.pair.drain(works, self.settings.chunk_timeout(chunk.nbytes))
            raise

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
