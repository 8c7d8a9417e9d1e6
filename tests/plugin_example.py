"""A plugin resource hook as a user would write one (docs/plugins.md shows it)."""

from __future__ import annotations

from resources import PoolStats, ResourceExhausted, ResourceHook
from states import HELD_STATES, Handle, RequestState


class LoraSlots:
    """A pool of adapter slots; the leak check covers it through `stats()`."""

    name = "lora_slots"

    def __init__(self, ledger, capacity: int = 4) -> None:
        self.ledger = ledger
        self.capacity = capacity
        self.free = list(range(capacity))

    def stats(self) -> PoolStats:
        held = self.ledger.held(self.name)
        return PoolStats(capacity=self.capacity, free=len(self.free), evictable=0, held=held,
                         quarantined=self.ledger.quarantined(self.name), unit="slots")


class LoraSlotHook(ResourceHook):
    name = "lora_slot"
    acquire_on = frozenset({RequestState.PREFILLING})
    scope = HELD_STATES - {RequestState.QUEUED, RequestState.RETRACTED}
    after = ("kv",)
    pool = LoraSlots.name

    def __init__(self, context) -> None:
        super().__init__()
        self.slots = LoraSlots(context.ledger)
        self.pools = [self.slots]

    def acquire(self, request, into) -> Handle:
        if not self.slots.free:
            raise ResourceExhausted("no LoRA slot free")
        slot = self.slots.free.pop()
        self.slots.ledger.hold(self.pool, request, 1)
        return Handle(self.name, request.request_id, slot, amount=1)

    def release(self, request, handle: Handle) -> None:
        self.slots.free.append(handle.payload)
        self.slots.ledger.drop(self.pool, request.request_id)
