"""A plugin resource hook as a user would write one (docs/plugins.md shows it)."""

from __future__ import annotations

from resources import PoolUsage, ResourceExhausted, ResourceHook
from states import HELD_STATES, Handle, RequestState


class LoraSlots:
    """A pool of adapter slots; the leak check covers it through `stats()`."""

    name = "lora_slots"

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self.free = list(range(capacity))

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.capacity, free=len(self.free), unit="slots")


class LoraSlotHook(ResourceHook):
    name = "lora_slot"
    acquire_on = frozenset({RequestState.PREFILLING})
    scope = HELD_STATES - {RequestState.QUEUED, RequestState.RETRACTED}
    after = ("kv",)
    pool = LoraSlots.name

    def __init__(self, context) -> None:
        self.slots = LoraSlots()
        self.pools = [self.slots]

    def acquire(self, request, into) -> Handle:
        if not self.slots.free:
            raise ResourceExhausted("no LoRA slot free")
        return Handle(self.name, request.request_id, self.slots.free.pop(), amount=1)

    def release(self, request, handle: Handle) -> None:
        self.slots.free.append(handle.payload)
