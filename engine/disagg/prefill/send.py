"""A prefill's send: the record the `kv_send` hook holds, the senders' protocol, and the
thread that runs sends.

A prefill-role request enters PREBUILT with its first token; the `kv_send`
hook's acquisition then starts the send of its KV through the role's
`KVSender` and holds a `SendRecord`: what is sent, how a link reads it (the
views of each chunk's messages: of the KV pages themselves, or of the
staging buffers the KV was gathered into when it must be), and the fences
of the send's reads. The machine adds those fences, so the request's
release waits for them, and the hook's release gives any staging back: on
every path (sent, cancelled, the decode gone, shutdown), through the one
release sequence.

- `pages_fence` (``kv_send``, protects ``kv``): the send reads the request's
  KV pages until it completes. When a link sends straight from the pages,
  it completes only once the link is done with them: the last byte has
  left, or the send failed and the pair is closed (`wire_done`).
- `wire_fence` (``kv_wire``, protects ``kv_send``): a link reads the staged
  chunks until it completes (the remote sender's fallback through staging).

A sender resolves the decode side's job: ("ok", first token) once the KV has
landed there (in process) or is staged for its link (remote), ("failed",
error) if the send fails. A job nothing sent is answered by the
`prefill_job` hook's release.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt
import structlog
import torch

from engine.disagg.decode.kv_transfer_hook import FirstToken, TransferJob
from engine.disagg.link.staging import StagingPool
from engine.disagg.link.messages import Piece
from engine.disagg.link.wire import Chunk
from engine.thread_names import named_thread
from resources.fences import ManualFence
from states import Fence

SEND_FENCE = "kv_send"
WIRE_FENCE = "kv_wire"
log = structlog.get_logger("kvlife.transfer")


@attrs.define(eq=False)
class SendRecord:
    """The `kv_send` handle's record: one prefill request's send of its KV."""

    job: TransferJob
    first: FirstToken
    #: the KV's token locations in this side's buffers (a copy: the request slot may be given back first)
    src_locs: torch.Tensor
    #: the same locations in host memory (from the page ids: no device read), for views of the pages
    host_locs: npt.NDArray[np.int64] | None = None
    #: the send reads the KV pages until this completes
    pages_fence: Fence | None = None
    #: the chunks a link sends (the remote sender)
    plan: list[Chunk] = attrs.field(factory=list)
    #: where the runs of `host_locs` start when the link sends from the pages; None: from staging
    src_runs: list[int] | None = None
    #: (chunk index, chunk, its messages) -> the tensors a link sends for them (the remote sender)
    views: Callable[[int, Chunk, list[Piece]], list[torch.Tensor]] | None = None
    #: staging buffers holding the gathered KV, in chunk order (the fallback), and their owner
    staged: list[tuple[Chunk, torch.Tensor]] = attrs.field(factory=list)
    owner: str = ""
    #: a link reads what `views` gives until this completes: `pages_fence` itself when it sends from the
    #: pages, else the staged chunks' own fence (``kv_wire``)
    wire_fence: ManualFence | None = None
    #: False once a failed send may have posted a staged buffer: it is given back, never reused
    reusable: bool = True

    @property
    def fences(self) -> tuple[Fence, ...]:
        fences = (self.pages_fence, self.wire_fence)
        return tuple(f for i, f in enumerate(fences) if f is not None and f not in fences[:i])

    def wire_done(self, *, reusable: bool = True) -> None:
        """The link will not read what it sends any more (sent, failed with the pair closed, or never
        posted)."""
        if not reusable:
            self.reusable = False
        if self.wire_fence is not None:
            self.wire_fence.complete()


class KVSender(Protocol):
    """How a prefill role sends a request's KV: into the decode's pages (in process) or to a link."""

    @property
    def staging(self) -> StagingPool | None:
        """The staging pool the records' chunks come from (None: nothing is staged)."""

    def start(self, record: SendRecord) -> None:
        """Start the send (never blocks the event loop): set the record's fences; complete them,
        and resolve the job, when the send has landed or failed."""

    def close(self) -> None:
        """Stop the sending thread once the sends already started are done."""


class SendQueue:
    """One thread that runs a sender's sends in order (the loop must not block on a copy)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = named_thread(self._run, name=self.name)
                self._thread.start()
        self._queue.put(work)

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - a sender completes its fences itself; never kill the thread
                log.error("transfer.send_crashed", error=repr(exc))
