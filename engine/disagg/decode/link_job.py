"""One decode job on its way through a link (`LinkJob`), and how it ends.

A job is decided once (`end`: landed, failed, given up; `detach`: moved to
another link) and resolved (outcome first, then the fence) once no write of
its memory is in progress. A write is whatever may change the job's
destination: a receive posted straight into its pages (from the post until
its wait has returned, or failed), or a staged chunk being copied in. The
link's receiving and writing threads bracket each with `begin_write` (False
once the job is decided: the chunk is then received into staging and
dropped) and `end_write`. So once a job is decided, nothing writes its pages
for this link any more: writes in progress finish, and the resolution waits
for the last of them (or, from the event loop, is applied by whoever ends
that write). A moved job is resolved by its successor on the next link.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
    _writes: int = 0  # writes of its memory in progress
    _cond: threading.Condition = attrs.field(factory=threading.Condition)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.plan)

    def begin_write(self) -> bool:
        """Start a write of the job's memory; False (nothing to end) once the job is decided."""
        with self._cond:
            if self.decision is not None:
                return False
            self._writes += 1
            return True

    def end_write(self) -> None:
        """A write started by `begin_write` is over (done, or failed for good): resolve an end decided
        during it once it was the last."""
        with self._cond:
            self._writes -= 1
            last = self._writes == 0
            if last:
                self._cond.notify_all()
        if last:
            self._resolve()

    def end(self, first_token: FirstToken | int | None, cause: str | None = None, message: str = "", *,
            block: bool = True, decided: Callable[[], None] | None = None) -> bool:
        """Decide how the job ends (once; True for the call that decided) and resolve it: outcome
        first, then the fence. Cause "cancelled" (the decode gave it up) resolves it with
        TransferCancelled. `decided()` runs for the call that decided, before the resolution (the
        fence wakes the event loop, which may report the job at once: count it first).

        With writes in progress the resolution waits for them (`block`), or, with `block=False`
        (the event loop), is left to the last of them to end: a write that wedges leaves the
        fence open (and the loop quarantines the pages at its deadline) instead of wedging the
        loop.
        """
        with self._cond:
            deciding = self.decision is None
            if deciding:
                self.decision = (first_token, cause, message)
            while block and self._writes:
                self._cond.wait()
            idle = self._writes == 0
        if deciding and decided is not None:
            decided()
        if idle:
            self._resolve()
        return deciding

    def detach(self) -> bool:
        """Decide that this job leaves its link for another one (True if this call decided): nothing
        writes it for this link any more, and its TransferJob stays open for the next link."""
        with self._cond:
            if self.decision is not None:
                return False
            self.decision = (None, MOVED, "moved to another prefill")
        return True

    def writing(self) -> bool:
        """Whether a write of its memory is in progress."""
        with self._cond:
            return self._writes > 0

    def successor(self, deadline: float) -> LinkJob:
        """The same TransferJob, destination and chunks as a new job for another link."""
        return LinkJob(self.job, self.destination, self.plan, self.spec, self.submitted, deadline,
                       attempt=self.attempt + 1)

    def _resolve(self) -> None:
        """Resolve a decided job once (whoever calls it first, with no write in progress)."""
        with self._cond:
            if self.decision is None or self.done or self.decision[1] == MOVED:  # a moved job: its successor's
                return
            self.done = True
            first_token, cause, message = self.decision
        if cause is None:
            self.job.resolve("ok", first_token)
        else:
            text = f"{message} (peer {self.peer}, epoch {self.epoch})" if self.peer else message
            error = TransferCancelled(text) if cause == "cancelled" else RemoteTransferFailed(cause, text)
            self.job.resolve("failed", error)
