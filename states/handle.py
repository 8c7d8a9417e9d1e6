"""Handles and fences: what a request holds, and what must finish first.

A `Handle` is the record of one resource held by one request (KV pages,
device slots, a cache reference...). It is released exactly once: the
machine marks it released before the hook frees anything, so a second
release raises `DoubleRelease` and touches no pool. A handle garbage-collected
while still held emits a `ResourceWarning`, like an unclosed file.

A `Fence` is an in-flight operation (a model step, a KV transfer, a host
backup copy) that still touches the memory of some handles. FINISHED ->
RELEASED waits for a request's fences; one that misses its deadline
quarantines the handles it protects instead of freeing them.
"""

from __future__ import annotations

import warnings
from typing import Generic, Protocol, TypeVar, runtime_checkable


class DoubleRelease(Exception):
    """A handle was released twice: a bug in whoever asked for it."""


class ResourceExhausted(Exception):
    """A pool cannot satisfy an acquisition or a growth now; the caller waits and retries.

    Defined here (and re-exported by `resources`) because the machine gives it
    its meaning: a refused move leaves the request exactly where it was.
    """


P = TypeVar("P")


class Handle(Generic[P]):
    """One resource held by one request. `payload` is the hook's own record (typed:
    ``Handle[KVBlock]``); `fences` are in-flight operations its acquisition started (a
    staging copy, a transfer), which the machine adds to the request's fences."""

    __slots__ = ("resource", "request_id", "amount", "payload", "fences", "_status", "_was_quarantined")

    HELD, RELEASED, QUARANTINED = "held", "released", "quarantined"

    def __init__(self, resource: str, request_id: str, payload: P = None,  # type: ignore[assignment]
                 amount: int = 0, *, fences: tuple[Fence, ...] = ()) -> None:
        self.resource = resource
        self.request_id = request_id
        self.payload: P = payload
        self.amount = amount
        self.fences = fences
        self._status = Handle.HELD
        self._was_quarantined = False

    def __repr__(self) -> str:
        return f"Handle({self.resource!r}, {self.request_id!r}, amount={self.amount}, {self._status})"

    @property
    def status(self) -> str:
        return self._status

    @property
    def held(self) -> bool:
        return self._status == Handle.HELD

    @property
    def was_quarantined(self) -> bool:
        """Whether a fence protecting this handle ever missed its deadline (its
        memory may have been written after the request finished)."""
        return self._was_quarantined

    def mark_released(self) -> None:
        """Flip to released (from held, or from quarantined once its fence is
        done); raises `DoubleRelease` if this already happened."""
        if self._status == Handle.RELEASED:
            raise DoubleRelease(f"{self!r} released twice")
        self._status = Handle.RELEASED

    def mark_quarantined(self) -> None:
        if self._status != Handle.HELD:
            raise DoubleRelease(f"{self!r} quarantined after release")
        self._status = Handle.QUARANTINED
        self._was_quarantined = True

    def __del__(self) -> None:
        if getattr(self, "_status", None) == Handle.HELD:
            warnings.warn(
                f"{self!r} was garbage-collected while still held", ResourceWarning, stacklevel=1
            )


@runtime_checkable
class Fence(Protocol):
    """An in-flight operation that still uses some handles' memory.

    `protects` names the hooks whose handles it touches; `deadline` is a
    monotonic time after which the operation is presumed lost.
    """

    name: str
    protects: frozenset[str]
    deadline: float

    def done(self) -> bool: ...
