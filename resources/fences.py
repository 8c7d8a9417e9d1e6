"""Concrete fences: in-flight operations that a release must wait for.

A fence is done when its `poll` says so. On CUDA, `for_cuda_event` polls an
event recorded on the stream that did the copy; on CPU copies complete at
once (`completed`). `ManualFence` is completed by whoever holds it (a
transfer's receiving side, tests and fault injection); its deadline can be
armed when the operation actually starts, so time spent waiting for a
worker never counts against the copy.

A fence that signals (`ManualFence`) calls the waiters given to `subscribe`
when it completes, from the completing thread, so a loop waiting on it can
sleep until then instead of polling; a polled fence (`CopyFence`: a CUDA
event) does not, and is polled.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

log = structlog.get_logger("kvlife.fences")


class CopyFence:
    """Satisfies `states.Fence`: name, protects, deadline, done()."""

    def __init__(
        self,
        name: str,
        protects: Iterable[str],
        *,
        poll: Callable[[], bool],
        timeout: float | None = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.protects = frozenset(protects)
        self.clock = clock
        self.timeout = timeout
        self.deadline = math.inf if timeout is None else clock() + timeout
        self._poll = poll
        self._done = False

    def done(self) -> bool:
        if not self._done:
            self._done = bool(self._poll())
        return self._done

    def subscribe(self, waiter: Callable[[], None]) -> bool:
        """Have `waiter()` called when the fence completes; False if it cannot signal (it is
        polled) or has completed already: either way, look at `done()`."""
        return False

    def arm(self, timeout: float | None = None) -> None:
        """Start the deadline now (`timeout`, else the one given at construction)."""
        timeout = self.timeout if timeout is None else timeout
        self.deadline = math.inf if timeout is None else self.clock() + timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, protects={sorted(self.protects)}, done={self._done})"

    @classmethod
    def completed(cls, name: str, protects: Iterable[str]) -> CopyFence:
        return cls(name, protects, poll=lambda: True)

    @classmethod
    def for_cuda_event(cls, name: str, protects: Iterable[str], event: Any, timeout: float = 30.0) -> CopyFence:
        return cls(name, protects, poll=event.query, timeout=timeout)


class ManualFence(CopyFence):
    """A fence that is done only once `complete()` is called.

    `timeout=None` leaves it unarmed (no deadline) until `arm()`. It signals:
    `complete()` calls each waiter `subscribe` took (once, from the thread
    that completes it; a waiter that raises does not stop the others), and
    so does `arm()`, as the deadline a waiter sleeps until has changed.
    """

    def __init__(self, name: str, protects: Iterable[str], *, timeout: float | None = 30.0,
                 armed: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self._completed = False
        self._waiters: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        super().__init__(name, protects, poll=lambda: self._completed, timeout=timeout, clock=clock)
        if not armed:
            self.deadline = math.inf

    def subscribe(self, waiter: Callable[[], None]) -> bool:
        with self._lock:
            if self._completed:
                return False
            if waiter not in self._waiters:  # NOTE: a loop subscribes again each time it sleeps
                self._waiters.append(waiter)
            return True

    def arm(self, timeout: float | None = None) -> None:
        """Start the deadline now; the waiters are called too (the deadline they sleep until changed),
        and subscribe again when they look next."""
        super().arm(timeout)
        self._signal()

    def complete(self) -> None:
        with self._lock:
            self._completed = True
        self._signal()

    def _signal(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            try:
                waiter()
            except Exception as exc:  # noqa: BLE001 - the fence is complete whatever a waiter does
                log.error("fence.waiter_failed", fence=self.name, error=repr(exc))
