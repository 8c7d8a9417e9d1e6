"""The decode side of one link: a sending thread, a receiving thread, a writing thread, a FIFO of jobs.

The receiving thread posts every write of a job's pages: the receives of
each chunk's messages (`engine.disagg.link.messages`) straight into them
when the job's destination takes them directly (its pages, in memory the
data group reaches), with the next chunk's posted before this one is waited
for. Otherwise (HiSparse's host rows, CUDA pages over gloo, short page
runs) it receives the chunk into staging and hands it to the writing
thread, which copies it in. Once a job's last chunk is posted, the writing
thread waits for it and lands the job (`engine.disagg.decode.link_writing`)
while the receiving thread takes the next header and posts the next job's
receives: with control and chunks on sockets of their own
(`engine.disagg.link.transport`), the next job's data never waits for a
round trip between the two sides. Each write is bracketed by the job's
`begin_write` / `end_write`, and a job ends exactly once
(`LinkJob.end`: outcome first, then the fence, once no write of it is in
progress). Whoever ends it, the writing thread (landed), the receiving
thread (reported failure), the link going down, or the client (a cancel, a missed
first-answer deadline), nothing writes the pages after that: a later chunk
for an ended job is received into staging and dropped. A receive posted
into the pages is over only when its wait has returned or failed (a
failure or a timeout closes the pair, so nothing lands later). So the fence
means "no write can happen any more", and it is completed within a bounded
time on every path.

Waits: a header (or keepalive) within `liveness_timeout`; a chunk within
`chunk_timeout(bytes)`. Any transport error or timeout ends the link and it
takes no new job: each of its jobs is either handed to the client's
`failover` (decided "moved": this link never writes it again, and the
client re-sends it to a live peer once no write of it is in progress) or
ends failed at once; the client builds a new pair (a new epoch).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import structlog
import torch
import torch.distributed as dist

from engine.disagg.decode.kv_transfer_hook import FirstToken
from engine.disagg.decode.link_job import LinkJob, RemoteTransferFailed
from engine.disagg.decode.link_writing import Landing, LinkWriting, Posted
from engine.disagg.link.messages import Piece, check_starts, chunk_pieces, cuts, staged_views
from engine.disagg.link.transport import LinkError, Pair, classify
from engine.disagg.link.wire import (BYE, CANCEL, CANCELLED, OK, PING, RESULT, STATUS_NAMES, Chunk, KVLayout,
                                     MAX_JOBS, JOB_BATCH_BYTES, ProtocolError, decode_logprob, empty_header, encode_job,
                                     header, inline_runs, jobs_header)
from engine.thread_names import named_thread

log = structlog.get_logger("kvlife.transfer")
__all__ = ["DecodeLink", "LinkJob", "RemoteTransferFailed"]


class DecodeLink(LinkWriting):
    """One epoch of the link to one prefill (see the module docstring)."""

    def __init__(self, *, peer: str, epoch: int, boot: str, pair: Pair, settings: Any, layout: KVLayout,
                 stats: Any, staging: Any, on_down: Callable[[DecodeLink, LinkError], None] | None = None,
                 failover: Callable[[LinkJob, LinkError], None] | None = None) -> None:
        self.peer, self.epoch, self.boot = peer, epoch, boot
        self.pair = pair
        self.settings = settings
        self.layout = layout
        self.stats = stats
        self.staging = staging
        self.on_down = on_down
        #: takes each job of this link that it left unfinished when it went down (decided "moved"); the
        #: client re-sends it to a live peer or fails it (None: they fail here)
        self.failover = failover
        self.inflight: deque[LinkJob] = deque()  # in the order their JOB frames were queued
        self.lock = threading.Lock()
        self.up = True
        self.cause = ""
        self._farewell = False  # tell the prefill when this side ended the link
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()  # received chunks for the writing thread
        self._tags = itertools.count(1)
        self._threads = [named_thread(pair.running(self._send_loop), name=f"kvlife-send-{peer}#{epoch}"),
                         named_thread(pair.running(self._recv_loop), name=f"kvlife-recv-{peer}#{epoch}"),
                         named_thread(pair.running(self._write_loop), name=f"kvlife-write-{peer}#{epoch}")]

    def start(self) -> None:
        self.pair.hold(len(self._threads))  # NOTE: the last thread to return closes the pair
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------- used by the client
    @property
    def load(self) -> int:
        """Jobs in flight that have not ended (fewest-in-flight spreading)."""
        with self.lock:
            return sum(1 for lj in self.inflight if lj.decision is None)

    def jobs(self) -> list[LinkJob]:
        """Jobs on this link not resolved yet (their fences are open)."""
        with self.lock:
            return [lj for lj in self.inflight if not lj.done]

    def submit(self, lj: LinkJob) -> bool:
        """Queue a job; False (nothing queued) if the link is down."""
        with self.lock:
            if not self.up:
                return False
            lj.peer, lj.epoch, lj.tag = self.peer, self.epoch, next(self._tags)
            self.inflight.append(lj)
        self._out.put(("job", lj))
        return True

    def cancel(self, lj: LinkJob) -> None:
        """Tell the prefill that `lj` was given up (the caller has ended it)."""
        if not lj.cancel_sent:
            lj.cancel_sent = True
            self._out.put(("cancel", lj.tag))

    def expire(self, now: float) -> None:
        """End jobs whose first answer is overdue; an overdue oldest job ends the link (event loop)."""
        with self.lock:
            overdue = [lj for lj in self.inflight if lj.answered is None and lj.decision is None
                       and lj.deadline <= now]
            head = next((lj for lj in self.inflight if lj.answered is None), None)  # the next to be answered
        if head is not None and head in overdue:
            self.down(LinkError("budget", f"no answer within the prefill's compute budget "
                                          f"({self.settings.first_timeout:g} s)"), block=False)
            return
        for lj in overdue:
            if lj.end(None, "budget", "no answer within the prefill's compute budget", block=False):
                self.stats.job_failed("budget")
                log.warning("transfer.failed", request_id=lj.job.request_id, peer=self.peer, epoch=self.epoch,
                            cause="budget")
                self.cancel(lj)

    def close(self) -> None:
        """Say goodbye and end the link (jobs still in flight end with cause "shutdown")."""
        self._out.put(("bye", None))

    @property
    def alive(self) -> bool:
        """Whether a thread of this link is still running (a receive returns within its bound)."""
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout: float) -> bool:
        """Wait for both threads to return (a peer that answers BYE lets them go at once)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0))
        return not self.alive

    # -------------------------------------------------------- sending
    def _send_loop(self) -> None:
        s = self.settings
        carried: tuple[str, object] | None = None  # what ended a batch of jobs, sent next
        try:
            while True:
                if carried is None:
                    try:
                        kind, item = self._out.get(timeout=s.keepalive)
                    except queue.Empty:
                        kind, item = "ping", None
                else:
                    (kind, item), carried = carried, None
                if not self.up:
                    if self._farewell:  # so the prefill cancels at once and its threads return
                        self.pair.send_ctl(header(BYE), s.chunk_slack)
                    return
                if kind == "job":
                    carried = self._send_jobs(item)
                elif kind == "cancel":
                    self.pair.send_ctl(header(CANCEL, item), s.chunk_slack)
                elif kind == "ping":
                    self.pair.send_ctl(header(PING), s.chunk_slack)
                elif kind == "bye":
                    self.pair.send_ctl(header(BYE), s.chunk_slack)
                    self.down(LinkError("shutdown", "the decode left"))
                    return
        except Exception as exc:  # noqa: BLE001 - every failure ends the link
            self.down(classify(exc))

    def _send_jobs(self, first: LinkJob) -> tuple[str, object] | None:
        """Send `first` and the jobs queued right behind it in one JOB message (up to `MAX_JOBS`, about
        `JOB_BATCH_BYTES` of frames): one round trip between the two sides for a burst of jobs. Returns
        the queued item that ended the batch (a cancel, a ping, ...), to send next."""
        s = self.settings
        frames: list[tuple[int, torch.Tensor]] = []
        carried: tuple[str, object] | None = None
        lj: LinkJob | None = first
        while lj is not None:
            budget = lj.deadline - time.monotonic()
            frames.append((lj.tag, encode_job(attrs.evolve(lj.spec, budget=max(budget - min(s.chunk_slack,
                                                                                              budget / 4), 0.0)))))
            lj = None
            if len(frames) < MAX_JOBS and sum(f.numel() for _, f in frames) < JOB_BATCH_BYTES:
                try:
                    kind, item = self._out.get_nowait()
                except queue.Empty:
                    break
                if kind == "job":
                    lj = item
                else:
                    carried = (kind, item)
        frame = torch.cat([f for _, f in frames])
        works = [self.pair.post_send_ctl(jobs_header(frames)), self.pair.post_send_ctl(frame)]
        self.pair.wait_all(works, s.chunk_timeout(frame.numel()), ctl=len(works))
        return carried

    # ------------------------------------------------------ receiving
    def _recv_loop(self) -> None:
        hdr = empty_header()
        try:
            self._receive(hdr)
        except Exception as exc:  # noqa: BLE001
            self.down(classify(exc))
        finally:
            self._writes.put(None)  # the writing thread finishes what was received, then returns

    def _receive(self, hdr: torch.Tensor) -> None:
        """Headers and chunks in FIFO order until the link fails (every exception ends it)."""
        work = self.pair.post_recv_ctl(hdr)
        while True:
            self.pair.wait_ctl(work, self.settings.liveness_timeout)
            if not self.up:
                return
            values = hdr.tolist()
            op, tag, status, first_token, reason_len, logprob_len, runs_len, direct = values[:8]
            if op == PING:
                work = self.pair.post_recv_ctl(hdr)
                continue
            if op == BYE:
                self._farewell = True  # answer it, so the prefill's receiving thread returns
                raise LinkError("peer_closed", "the prefill left")
            if op != RESULT:
                raise ProtocolError(f"unexpected message op {op}")
            with self.lock:  # NOTE: the jobs before it may still be landing (the writing thread ends them)
                lj = next((j for j in self.inflight if j.answered is None), None)
            if lj is None or lj.tag != tag:
                raise ProtocolError(f"result for job {tag}, expected {lj.tag if lj else 'none'}")
            reason = self._recv_bytes(reason_len).decode(errors="replace")
            first = FirstToken(first_token, decode_logprob(self._recv_bytes(logprob_len)))
            starts = inline_runs(values)
            if starts is None:  # too many to ride in the header
                raw = self._recv_bytes(8 * runs_len)
                starts = torch.frombuffer(bytearray(raw), dtype=torch.int64).tolist() if raw else []
            src = check_starts(starts, lj.destination.num_tokens, "the prefill's") if direct else None
            lj.answered = time.monotonic()
            if status == OK:
                work = self._recv_chunks(lj, first, cuts(src, lj.spec.runs), lambda: self.pair.post_recv_ctl(hdr))
            else:
                work = self.pair.post_recv_ctl(hdr)
                self._answered_failed(lj, status, reason)
                self._forget(lj)

    def _answered_failed(self, lj: LinkJob, status: int, reason: str) -> None:
        def count() -> None:  # NOTE: before the fence completes (it wakes the engine)
            if status == CANCELLED:
                self.stats.job_cancelled()
            else:
                self.stats.job_failed("prefill_failed")
                log.warning("transfer.failed", request_id=lj.job.request_id, peer=self.peer, epoch=self.epoch,
                            cause="prefill_failed", reason=reason)

        lj.end(None, "prefill_failed", f"the prefill answered {STATUS_NAMES.get(status, status)}: {reason}",
               decided=count)

    def _recv_bytes(self, nbytes: int) -> bytes:
        if nbytes <= 0:
            return b""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.pair.recv_ctl(buf, self.settings.chunk_timeout(nbytes))
        return buf.numpy().tobytes()

    def _recv_chunks(self, lj: LinkJob, first_token: FirstToken, cut: list[int] | None,
                     next_header: Callable[[], dist.Work]) -> dist.Work:
        """Receive every chunk's messages (the next chunk's posted before this one is waited for): into the
        job's pages when its destination takes them directly, else into staging for the writing thread,
        which copies it in while the next one arrives. Once the last chunk's receives are posted, the
        next header's is (`next_header`, returned), so it lands as soon as the prefill sends it, without
        a round trip between jobs. Every chunk receive posted is waited for before this returns; on a
        failure (a wait failed or timed out) the pair is aborted first, after which none can land
        (`Pair.abort`), so no write of the job's memory outlives it."""
        owner = f"{lj.job.request_id}@{self.peer}#{self.epoch}"
        outstanding: list[Posted] = []
        work = next_header() if not lj.plan else None
        direct = True  # every chunk went straight into the pages: nothing of it is left for the writing thread
        try:
            for index, chunk in enumerate(lj.plan):
                outstanding.append(self._post(lj, chunk, chunk_pieces(self.layout, chunk, cut), owner))
                direct = direct and outstanding[-1].writing
                if index == len(lj.plan) - 1:
                    work = next_header()
                if len(outstanding) > 1:
                    self._finish(outstanding[0])
                    outstanding.pop(0)
        except BaseException:
            if outstanding:  # a wait failed or timed out: the link is over, and after the abort nothing lands
                self.pair.abort()
            for posted in outstanding:
                self._drain(posted)
            raise
        # NOTE: the writing thread waits for the last chunks and lands the job, while this thread takes
        # the next header and posts the next job's receives: the data never waits for a round trip
        self._writes.put(Landing(lj, outstanding, first_token))
        assert work is not None
        return work

    def _post(self, lj: LinkJob, chunk: Chunk, pieces: list[Piece], owner: str) -> Posted:
        """Post a chunk's receives: straight into the job's pages if it takes them and is still writable
        (the receives are then a write of it), else into a staging buffer."""
        writing = lj.spec.runs is not None and lj.begin_write()
        buf = None if writing else self.staging.take(owner, chunk.nbytes, timeout=self.settings.chunk_slack,
                                                     device=self.pair.data_device)
        posted = Posted(lj, chunk, pieces, [], buf, owner, writing)
        try:
            views = lj.destination.views(pieces) if buf is None else staged_views(self.layout, chunk, buf, pieces)
            self.pair.post_each(posted.works, list(views), send=False, into_kv=writing)
        except BaseException:
            self._drain(posted)
            raise
        return posted

    def _finish(self, posted: Posted) -> None:
        """Wait for a chunk's receives; hand a staged one to the writing thread (which writes it into a job
        still writable, and gives the buffer back). If a wait raises, the caller drains it."""
        self.pair.wait_all(posted.works, self.settings.chunk_timeout(posted.chunk.nbytes))
        if posted.writing:
            posted.lj.end_write()
        else:
            self._writes.put((posted.lj, posted.chunk, posted.buf, posted.owner))

    # ------------------------------------------------------------- down
    def down(self, error: LinkError, *, block: bool = True) -> None:
        """End the link: every job on it ends failed now (idempotent; `block`: see `LinkJob.end`)."""
        with self.lock:
            if not self.up:
                return
            self.up = False
            self.cause = error.cause
            self._farewell = self._farewell or error.cause in ("budget", "protocol")
            jobs = list(self.inflight)
            self.inflight.clear()
        self.stats.link_down(self.peer, error.cause)  # NOTE: counted before a job's fence wakes the engine
        failed = moved = 0
        for lj in jobs:
            if error.cause != "shutdown" and self.failover is not None and lj.detach():
                moved += 1
                self.failover(lj, error)
                continue

            def count(lj: LinkJob = lj) -> None:
                self.stats.job_failed(error.cause)
                log.warning("transfer.failed", request_id=lj.job.request_id, peer=self.peer, epoch=self.epoch,
                            cause=error.cause, error=str(error))

            if lj.end(None, error.cause, str(error), block=block, decided=count):
                failed += 1
        self._out.put(("stop", None))
        level = log.info if error.cause == "shutdown" else log.warning
        level("transfer.link_down", peer=self.peer, epoch=self.epoch, cause=error.cause, error=str(error),
              jobs_failed=failed, jobs_moved=moved)
        if self.on_down is not None:
            self.on_down(self, error)
