"""Request slots and the request -> token-location table.

Each running request holds one slot, a row of `req_to_token`, a
[max_running, max_context] tensor on the configured device: row `slot`,
column `i` is the KV-buffer location of the request's token `i`. The model
runner gathers context locations from it; the KV hook writes it when pages
are allocated.
"""

from __future__ import annotations

import torch


class NoFreeSlot(Exception):
    pass


class RequestSlots:
    def __init__(self, max_running: int, max_context: int, device: torch.device | str) -> None:
        self.capacity = max_running
        self.max_context = max_context
        self.req_to_token = torch.zeros((max_running, max_context), dtype=torch.int64, device=device)
        self._free = list(range(max_running - 1, -1, -1))
        self._in_use = [False] * max_running

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._in_use[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise ValueError(f"foreign request slot {slot}")
        if not self._in_use[slot]:
            raise ValueError(f"request slot {slot} freed twice")
        self._in_use[slot] = False
        self._free.append(slot)
