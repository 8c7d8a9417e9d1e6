"""One decode job on its way through a link (`LinkJob`), and how it ends.

A job is decided once (`end`: landed, failed, given up; `detach`: moved to
another link), under `_deciding`, and resolved (outcome first, then the
fence) under `lock`, the lock the link's writing thread holds while it
writes one of the job's chunks. So once a job is decided, nothing writes its
pages for this link any more: a write in progress finishes, and the
resolution waits for it (or, from the event loop, is applied when it
returns). A moved job is resolved by its successor on the next link.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from engine.disagg.decode.kv_transfer_hook import FirstToken, TransferCancelled
from engine.disagg.decode.transfer import TransferFailed
from engine.disagg.link.wire import JobSpec

MOVED = "moved"  # a LinkJob's decision when it left its link for another


class RemoteTransferFailed(TransferFailed):
    """A remote transfer failed; `cause` is one of engine.disagg.link.transport.CAUSES."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@attrs.define(eq=False)
class LinkJob:
    """One TransferJob on its way through a link."""

    job: Any
    destination: Any
    plan: list
    spec: JobSpec
    submitted: float
    deadline: float  # the first answer's
    peer: str = ""
    epoch: int = 0
    tag: int = 0
    attempt: int = 1  # 1 + the links it was moved away from
    answered: float | None = None  # when its header arrived
    done: bool = False  # resolved: outcome set, fence completed
    cancel_sent: bool = False
    #: how it ends, decided once: (first token and its logprob, cause, message)
    decision: tuple[FirstToken | int | None, str | None, str] | None = None
    lock: threading.Lock = attrs.field(factory=threading.Lock)  # held by the writing thread while it writes
    _deciding: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.plan)

    @property
    def writable(self) -> bool:
        """Whether a chunk may still be written (call with the lock held)."""
        return self.decision is None

    def end(self, first_token: FirstToken | int | None, cause: str | None = None, message: str = "", *,
            block: bool = True) -> bool:
        """Decide how the job ends (once; True for the call that decided) and resolve it: outcome
        first, then the fence. Cause "cancelled" (the decode gave it up) resolves it with
        TransferCancelled.

        With `block=False` (the event loop) a write in progress is not waited for: the writing
        thread resolves the job as soon as that write returns, so a writing thread that wedges
        leaves the fence open (and the loop quarantines the pages at its deadline) instead of
        wedging the loop.
        """
        with self._deciding:
            decided = self.decision is None
            if decided:
                self.decision = (first_token, cause, message)
        if self.lock.acquire(blocking=block):
            try:
                self._resolve()
            finally:
                self.lock.release()
        return decided

    def detach(self) -> bool:
        """Decide that this job leaves its link for another one (True if this call decided): nothing
        writes it for this link any more, and its TransferJob stays open for the next link."""
        with self._deciding:
            if self.decision is not None:
                return False
            self.decision = (None, MOVED, "moved to another prefill")
        return True

    def writing(self) -> bool:
        """Whether a chunk of it is being written right now (its lock is held)."""
        if not self.lock.acquire(blocking=False):
            return True
        self.lock.release()
        return False

    def successor(self, deadline: float) -> LinkJob:
        """The same TransferJob, destination and chunks as a new job for another link."""
        return LinkJob(self.job, self.destination, self.plan, self.spec, self.submitted, deadline,
                       attempt=self.attempt + 1)

    def apply_decision(self) -> None:
        """After a write (lock released): resolve an end decided during it."""
        if self.decision is not None and not self.done:
            with self.lock:
                self._resolve()

    def _resolve(self) -> None:
        assert self.decision is not None  # `end` decides before anything resolves
        if self.done or self.decision[1] == MOVED:  # a moved job is resolved by its successor
            return
        self.done = True
        first_token, cause, message = self.decision
        if cause is None:
            self.job.resolve("ok", first_token)
        else:
            text = f"{message} (peer {self.peer}, epoch {self.epoch})" if self.peer else message
            error = TransferCancelled(text) if cause == "cancelled" else RemoteTransferFailed(cause, text)
            self.job.resolve("failed", error)
