"""Deadlines: requests that must be finished by a monotonic time, found by the loop on a timer.

A request submitted with a deadline (``Engine.generate(..., deadline=seconds)``,
counted from submission) is registered here when the loop takes it. Each
iteration the loop asks for the requests now past their deadline (`due`) and
finishes each with `FinishReason.DEADLINE` through `Finisher.finish`, the one
release path, whatever state it is in (QUEUED, PREFILLING, TRANSFERRING,
STAGING, DECODING, RETRACTED; an unstarted one enters QUEUED holding nothing
first). The loop bounds every wait by `next_due()`, so a deadline is seen
when no traffic arrives and no step runs; while a model step is in flight it
is seen right after the step (a request in a step is never transitioned
during it), hence "within the deadline plus one step" (one decode run, with
`EngineConfig.decode_steps`).

NOTE: entries are a heap of (deadline, order, request). A request released
before its deadline is only forgotten (`discard`); its entry is dropped when
it surfaces, or when stale entries outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools

from states import Request


class DeadlineTimer:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()
        self._live: set[Request] = set()

    def __len__(self) -> int:
        """Requests with a deadline not yet released (0 once the engine is idle)."""
        return len(self._live)

    def add(self, request: Request) -> None:
        """Watch `request` if it has a deadline."""
        if request.deadline is None:
            return
        self._live.add(request)
        heapq.heappush(self._heap, (request.deadline, next(self._order), request))

    def discard(self, request: Request) -> None:
        """`request` was released: it no longer needs watching."""
        if request not in self._live:
            return
        self._live.discard(request)
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._live):
            self._heap = [entry for entry in self._heap if entry[2] in self._live]
            heapq.heapify(self._heap)

    def due(self, now: float) -> list[Request]:
        """The watched requests whose deadline is at or before `now` and that have not finished."""
        expired = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if request in self._live and not request.is_finished:
                expired.append(request)
        return expired

    def next_due(self) -> float | None:
        """The earliest deadline of a request still worth watching, or None."""
        heap = self._heap
        while heap and (heap[0][2] not in self._live or heap[0][2].is_finished):
            heapq.heappop(heap)
        return heap[0][0] if heap else None
