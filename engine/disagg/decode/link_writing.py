"""The decode link's writing thread (`LinkWriting`, a part of `DecodeLink`), and what it is handed.

The receiving thread posts every chunk's receives and hands over what is
left to finish: a staged chunk already received (copied into its job, the
staging given back), or a job whose chunks are all posted (`Landing`: the
writing thread waits for its last chunks, copying staged ones in, then
lands the job and takes it off the link). Meanwhile the receiving thread
takes the next job's header and posts its receives, so the data of the next
job is never held up by a round trip after the last one. Items are taken in
the order they were handed over, and a wait that fails ends the link: the
pair is aborted first (nothing lands afterwards), the chunks left are
drained (their writes ended, their staging never reused), then the link goes
down, which moves or fails its jobs.
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from collections import deque

import attrs
import structlog
import torch
import torch.distributed as dist

from engine.disagg.decode.kv_transfer_hook import FirstToken
from engine.disagg.decode.link_job import LinkJob
from engine.disagg.link.messages import Piece
from engine.disagg.link.observability import TransferStats
from engine.disagg.link.settings import RemotePrefill
from engine.disagg.link.staging import StagingPool
from engine.disagg.link.transport import LinkError, Pair, classify
from engine.disagg.link.wire import Chunk, KVLayout

log = structlog.get_logger("kvlife.transfer")


class LinkWriting(abc.ABC):
    """The writing thread's side of `DecodeLink` (which sets these attributes and `down`)."""

    peer: str
    epoch: int
    pair: Pair
    settings: RemotePrefill
    layout: KVLayout
    stats: TransferStats
    staging: StagingPool
    lock: threading.Lock
    inflight: deque[LinkJob]
    _writes: queue.SimpleQueue

    @abc.abstractmethod
    def down(self, error: LinkError, *, block: bool = True) -> None:
        """Take the link down with `error` (`DecodeLink.down`: its jobs move or fail)."""

    def _write_loop(self) -> None:
        """Takes what the receiving thread hands over, in order, until it returns. It is the last user of
        the pair's data group (the receiving thread has returned): it closes the pair as it leaves (an
        NCCL group is aborted, so a dropped link leaks no communicator)."""
        try:
            self._write_items()
        finally:
            self.pair.close()

    def _write_items(self) -> None:
        while (item := self._writes.get()) is not None:
            if isinstance(item, Landing):
                self._land(item)
            else:
                self._write(*item)

    def _forget(self, lj: LinkJob) -> None:
        with self.lock:
            if lj in self.inflight:
                self.inflight.remove(lj)

    def _land(self, landing: Landing) -> None:
        """On the writing thread: wait for a job's last chunks (copying staged ones in), then land it.
        A wait that fails ends the link (the pair aborted first, so nothing lands afterwards)."""
        lj, pending = landing.lj, list(landing.posted)
        try:
            while pending:
                self.pair.wait_all(pending[0].works, self.settings.chunk_timeout(pending[0].chunk.nbytes))
                posted = pending.pop(0)
                if posted.buf is None:  # received straight into the pages
                    lj.end_write()
                else:
                    self._write(lj, posted.chunk, posted.buf, posted.owner)
        except Exception as exc:  # noqa: BLE001 - every failure ends the link
            if pending:
                self.pair.abort()
            for posted in pending:
                self._drain(posted)
            self.down(classify(exc), block=False)
        else:
            self._landed(lj, landing.first_token)
        finally:
            self._forget(lj)

    def _landed(self, lj: LinkJob, first_token: FirstToken) -> None:
        """Every chunk of the job is written: end it (unless it was given up or failed meanwhile)."""
        now = time.monotonic()

        def count() -> None:  # NOTE: before the fence completes: the engine may report the job at once
            self.stats.job_ok(lj.nbytes, now - (lj.answered or now), now - lj.submitted)
            log.debug("transfer.landed", request_id=lj.job.request_id, peer=self.peer, epoch=self.epoch,
                      bytes=lj.nbytes, seconds=round(now - (lj.answered or now), 6))

        lj.end(first_token, decided=count)

    def _drain(self, posted: Posted) -> None:
        """After a failure: wait (bounded) until no receive of `posted` can write any more, then end its
        write or give its buffer back, never to be reused."""
        self.pair.drain(posted.works, self.settings.chunk_timeout(posted.chunk.nbytes))
        if posted.writing:
            posted.lj.end_write()
        elif posted.buf is not None:
            self.staging.give(posted.owner, posted.buf, reuse=False)


    def _write(self, lj: LinkJob, chunk: Chunk, value: torch.Tensor, owner: str) -> None:
        """Copy a staged chunk into a job still writable, and give the buffer back."""
        try:
            if lj.begin_write():
                try:
                    lj.destination.write(chunk, value.view(self.layout.dtype).view(self.layout.chunk_shape(chunk)))
                finally:
                    lj.end_write()
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the fence open
            lj.end(None, "transport", f"writing a chunk failed: {exc!r}",
                   decided=lambda: self.stats.job_failed("transport"))
        finally:
            self.staging.give(owner, value)


@attrs.define(eq=False)
class Posted:
    """The receives posted for one chunk: into the job's pages (`writing`) or into a staging buffer."""

    lj: LinkJob
    chunk: Chunk
    pieces: list[Piece]
    works: list[dist.Work]
    buf: torch.Tensor | None
    owner: str
    writing: bool


@attrs.define(eq=False)
class Landing:
    """A job whose chunks are all posted: the writing thread waits for the last ones and lands it."""

    lj: LinkJob
    posted: list[Posted]
    first_token: FirstToken
