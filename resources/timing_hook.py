"""The timing hook: the completion time is stamped on every path.

It holds no memory (no pool); its handle is acquired when the request enters
QUEUED and released last of all hooks, so whatever way a request ends,
reaching RELEASED stamps `completion_time`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from resources.contract import ResourceHook
from states import HELD_STATES, Handle, Request, RequestState


class TimingHook(ResourceHook):
    name = "timing"
    acquire_on = frozenset({RequestState.QUEUED})
    scope = HELD_STATES

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, after: tuple[str, ...] = ()) -> None:
        self.clock = clock
        #: every other hook: it is released last
        self.after = tuple(after)

    def acquire(self, request: Request, into: RequestState) -> Handle[None]:
        return Handle(self.name, request.request_id)

    def release(self, request: Request, handle: Handle[None]) -> None:
        request.completion_time = self.clock()
