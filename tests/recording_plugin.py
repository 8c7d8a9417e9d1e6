"""A plugin hook that records every acquire and release, for the finish-path matrices.

It holds one lease of its own pool from admission (PREFILLING or TRANSFERRING)
until the request leaves the running states (RETRACTED gives it back, as
RELEASED does), so every finish path, retraction and re-admission passes
through it. Registered as a factory, it gives each runtime (a decode engine
and its in-process prefill) a hook and a pool of its own; `Recorders` keeps
them all for the test to check: every acquired lease released exactly once.
"""

from __future__ import annotations

from collections import Counter

from helpers import CountingPool
from resources import ResourceExhausted, ResourceHook
from states import HELD_STATES, Handle, RequestState

S = RequestState


class RecordingHook(ResourceHook):
    name = "recorder"
    pool = "recorder_leases"
    acquire_on = frozenset({S.PREFILLING, S.TRANSFERRING})
    scope = HELD_STATES - {S.QUEUED, S.RETRACTED}
    after = ("kv",)

    def __init__(self, capacity: int = 64) -> None:
        self.leases = CountingPool(self.pool, capacity)
        self.pools = [self.leases]
        self.acquired: Counter = Counter()  # request id -> leases taken
        self.released: Counter = Counter()  # request id -> leases given back
        self.acquired_in: dict[str, set[str]] = {}  # request id -> the states it acquired on entering

    def acquire(self, request, into) -> Handle:
        if not self.leases.free:
            raise ResourceExhausted("no recorder lease")
        self.leases.free -= 1
        self.acquired[request.request_id] += 1
        self.acquired_in.setdefault(request.request_id, set()).add(into.name)
        return Handle(self.name, request.request_id, amount=1)

    def release(self, request, handle: Handle) -> None:
        self.leases.free += 1
        self.released[request.request_id] += 1


class Recorders:
    """A plugin factory building one `RecordingHook` per runtime, and the hooks it built."""

    def __init__(self) -> None:
        self.hooks: list[RecordingHook] = []

    def __call__(self, context) -> RecordingHook:
        hook = RecordingHook()
        self.hooks.append(hook)
        return hook

    def assert_balanced(self) -> None:
        """Every lease any runtime took was given back exactly once, and every pool is whole."""
        assert self.hooks, "no recorder was built"
        for hook in self.hooks:
            assert hook.acquired and hook.acquired == hook.released, (hook.acquired, hook.released)
            assert hook.leases.free == hook.leases.capacity
