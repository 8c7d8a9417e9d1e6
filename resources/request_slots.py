"""Request slots, the request -> token-location table, and the slot hook.

Each admitted request holds one slot: a row of `req_to_token`, a
``[max_running, width]`` tensor on the configured device whose column `i`
is the KV-buffer location of the request's token `i`. The model runner
gathers context locations from it; the KV hook writes it when pages are
allocated. `width` is `max_context` rounded up to whole pages, so every page
a request can hold has its locations in the row.

The slot hook is acquired before the KV hook and released after it (the KV
pages are written into the slot's row).
"""

from __future__ import annotations

import torch

from resources.contract import ResourceExhausted, ResourceHook
from resources.free_list import FreeList
from resources.ledger import PoolUsage
from resources.paging import round_up
from states import Handle, Request, RequestState

S = RequestState
REQUEST_SLOTS = "request_slots"
#: Where a request holds its KV pages (and so its slot), unless HiSparse narrows it.
KV_SCOPE = frozenset({S.TRANSFERRING, S.PREFILLING, S.PREBUILT, S.STAGING, S.DECODING, S.FINISHED})


class RequestSlots:
    """The slot free list and the token table (pool ``request_slots``)."""

    name = REQUEST_SLOTS

    def __init__(self, max_running: int, max_context: int, page_size: int, device: torch.device | str) -> None:
        self.capacity = max_running
        self.width = round_up(max_context, page_size)
        self.req_to_token = torch.zeros((max_running, self.width), dtype=torch.int64, device=device)
        self._free = FreeList(max_running, what="request slot")

    @property
    def num_free(self) -> int:
        return self._free.num_free

    def alloc(self) -> int | None:
        return self._free.alloc()

    def free(self, slot: int) -> None:
        self._free.free(slot)

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.capacity, free=self.num_free, unit="slots")


class RequestSlotHook(ResourceHook):
    """One request slot (a row of the token table) per admitted request."""

    name = "request_slot"
    pool = REQUEST_SLOTS
    acquire_on = frozenset({S.PREFILLING, S.TRANSFERRING})
    scope = KV_SCOPE
    after = ("kv",)

    def __init__(self, slots: RequestSlots, *, scope: frozenset[RequestState] | None = None,
                 acquire_on: frozenset[RequestState] | None = None) -> None:
        self.slots = slots
        if scope is not None:  # HiSparse narrows it with the KV hook's
            self.scope = frozenset(scope)
        if acquire_on is not None:  # HiSparse's decode role: no slot for a transfer into host rows
            self.acquire_on = frozenset(acquire_on)

    @staticmethod
    def slot(request: Request) -> int:
        """The request's row of the token table (the request must hold a slot)."""
        slot = request.handles[RequestSlotHook.name].payload
        assert isinstance(slot, int)
        return slot

    def acquire(self, request: Request, into: RequestState) -> Handle[int]:
        slot = self.slots.alloc()
        if slot is None:
            raise ResourceExhausted(f"all {self.slots.capacity} request slots are in use")
        return Handle(self.name, request.request_id, slot, amount=1)

    def release(self, request: Request, handle: Handle[int]) -> None:
        self.slots.free(handle.payload)
