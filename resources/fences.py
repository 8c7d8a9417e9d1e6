"""Concrete fences: in-flight operations that a release must wait for.

A fence is done when its `poll` says so. On CUDA, `for_cuda_event` polls an
event recorded on the stream that did the copy; on CPU copies complete at
once (`completed`) or in a worker thread (`for_future`). `ManualFence` is
completed by whoever holds it: tests and fault injection use it to make a
copy that never finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any


class CopyFence:
    """Satisfies `states.Fence`: name, protects, deadline, done()."""

    def __init__(
        self,
        name: str,
        protects: Iterable[str],
        *,
        poll: Callable[[], bool],
        timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.protects = frozenset(protects)
        self.deadline = clock() + timeout
        self._poll = poll
        self._done = False

    def done(self) -> bool:
        if not self._done:
            self._done = bool(self._poll())
        return self._done

    def __repr__(self) -> str:
        return f"CopyFence({self.name!r}, protects={sorted(self.protects)}, done={self._done})"

    @classmethod
    def completed(cls, name: str, protects: Iterable[str]) -> "CopyFence":
        return cls(name, protects, poll=lambda: True)

    @classmethod
    def for_cuda_event(cls, name: str, protects: Iterable[str], event: Any, timeout: float = 30.0) -> "CopyFence":
        return cls(name, protects, poll=event.query, timeout=timeout)

    @classmethod
    def for_future(cls, name: str, protects: Iterable[str], future: Future, timeout: float = 30.0) -> "CopyFence":
        return cls(name, protects, poll=future.done, timeout=timeout)


class ManualFence(CopyFence):
    """A fence that is done only once `complete()` is called."""

    def __init__(self, name: str, protects: Iterable[str], *, timeout: float = 30.0, clock=time.monotonic) -> None:
        self._completed = False
        super().__init__(name, protects, poll=lambda: self._completed, timeout=timeout, clock=clock)

    def complete(self) -> None:
        self._completed = True
