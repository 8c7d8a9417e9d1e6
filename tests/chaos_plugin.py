"""The stateful test's chaos plugin: a duck-typed resource hook with its own pool that fails as
requests are tagged, so the state machine can attack the plugin seam like any other."""

from __future__ import annotations

from collections.abc import Callable

from helpers import CountingPool
from resources import ResourceExhausted
from states import Handle, RequestState

CAPACITY = 64


class ChaosLease:
    """A duck-typed plugin hook (no base class) with its own pool, failing as requests are tagged:
    ``plugin:acquire`` raises a bug at admission, ``plugin:busy`` refuses it once as exhausted,
    ``plugin:release`` raises after giving the lease back, ``plugin:grow`` raises while decoding."""

    name = "chaos_lease"
    pool = "chaos_leases"
    acquire_on = frozenset({RequestState.PREFILLING, RequestState.TRANSFERRING})
    scope = frozenset(RequestState) - {RequestState.QUEUED, RequestState.RETRACTED, RequestState.RELEASED}
    before: tuple[str, ...] = ()
    after = ("kv",)

    def __init__(self, tags_of: Callable[[str], frozenset[str]]) -> None:
        self.tags_of = tags_of
        self.leases = CountingPool(self.pool, CAPACITY)
        self.refused: set[str] = set()
        self.pools = [self.leases]

    def acquire(self, request, into):
        tags = self.tags_of(request.request_id)
        if "plugin:acquire" in tags:
            raise RuntimeError("chaos: acquire bug")
        if "plugin:busy" in tags and request.request_id not in self.refused:
            self.refused.add(request.request_id)
            raise ResourceExhausted("chaos: leases busy")
        self.leases.free -= 1
        return Handle(self.name, request.request_id, amount=1)

    def release(self, request, handle):
        self.leases.free += 1
        if "plugin:release" in self.tags_of(request.request_id):
            raise RuntimeError("chaos: release bug")

    def grow(self, request, handle, num_tokens):
        if "plugin:grow" in self.tags_of(request.request_id):
            raise RuntimeError("chaos: grow bug")
        return True
