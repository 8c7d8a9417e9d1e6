"""HiSparse's three leak-checked pools.

Memory layout (one tensor per layer; K and V of a token side by side)::

    host pool  (pinned host memory on CUDA)       unit: pages of page_size tokens
        kv[layer]:    [num_pages * page_size, 2, kv_heads, head_dim]   (0: K, 1: V)
        index[layer]: [num_pages * page_size, index_dim]               (on device)
        token location = page_id * page_size + offset_in_page; page 0 reserved

    device buffer pool (on device)                 unit: slots of one token
        kv[layer]:    [1 + num_slots, 2, kv_heads, head_dim]
        slot 0 is the padding slot: padded attention rows read it, masked out

    slot maps (host memory: LRU bookkeeping)       unit: one map per request
        table: [num_maps, num_layers, max_context]  token -> local slot, -1

Each pool answers `stats()` from two independent views, its own free list
and the ledger's record of what requests hold, so the leak check's
``free + evictable + held == capacity`` means something at every moment.
Only the hooks in `hisparse.hooks` allocate from or free into them.
"""

from __future__ import annotations

import numpy as np
import torch

from resources.ledger import Ledger, PoolStats
from resources.page_allocator import PageAllocator

HOST_PAGES = "hisparse_host_pages"
DEVICE_SLOTS = "hisparse_device_slots"
SLOT_MAPS = "hisparse_slot_maps"


def _stats(name: str, ledger: Ledger, capacity: int, free: int, unit: str) -> PoolStats:
    return PoolStats(capacity=capacity, free=free, evictable=0, held=ledger.held(name),
                     quarantined=ledger.quarantined(name), suspect=name in ledger.suspect, unit=unit)


class HostKVPool:
    """Every HiSparse token's full K/V in host memory, and its index keys on device."""

    name = HOST_PAGES

    def __init__(self, *, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 index_dim: int, dtype: torch.dtype, device: torch.device, ledger: Ledger) -> None:
        self.page_size = page_size
        self.ledger = ledger
        self.allocator = PageAllocator(num_tokens // page_size + 1, page_size)
        rows = self.allocator.num_pages * page_size
        pin = device.type == "cuda"
        self.kv = [torch.zeros((rows, 2, num_kv_heads, head_dim), dtype=dtype, pin_memory=pin)
                   for _ in range(num_layers)]
        self.index = [torch.zeros((rows, index_dim), dtype=dtype, device=device) for _ in range(num_layers)]
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def locations(self, pages: torch.Tensor) -> torch.Tensor:
        """Token locations (host rows) of `pages`, in order."""
        return (pages.unsqueeze(1) * self.page_size + self._offsets).reshape(-1)

    @property
    def bytes_per_token(self) -> int:
        """Host bytes of one token's K and V over all layers."""
        return sum(t[0].numel() * t.element_size() for t in self.kv)

    @property
    def index_bytes_per_token(self) -> int:
        """Device bytes of one token's index keys over all layers."""
        return sum(t[0].numel() * t.element_size() for t in self.index)

    def stats(self) -> PoolStats:
        a = self.allocator
        return _stats(self.name, self.ledger, a.capacity, a.num_free, "pages")


class DeviceBufferPool:
    """Device KV slots from which per-request buffers are cut."""

    name = DEVICE_SLOTS

    def __init__(self, *, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, ledger: Ledger) -> None:
        self.ledger = ledger
        self.allocator = PageAllocator(num_slots + 1, 1)  # slot 0: padding
        shape = (num_slots + 1, 2, num_kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one slot's K and V over all layers."""
        return sum(t[0].numel() * t.element_size() for t in self.kv)

    def stats(self) -> PoolStats:
        a = self.allocator
        return _stats(self.name, self.ledger, a.capacity, a.num_free, "slots")


class SlotMapPool:
    """Per-request token -> device-slot maps, one row of `table` each."""

    name = SLOT_MAPS

    def __init__(self, *, num_maps: int, num_layers: int, max_context: int, ledger: Ledger) -> None:
        self.ledger = ledger
        self.capacity = num_maps
        self.table = np.full((num_maps, num_layers, max_context), -1, dtype=np.int64)
        self._free = list(range(num_maps - 1, -1, -1))
        self._in_use = [False] * num_maps

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.capacity or not self._in_use[row]:
            raise ValueError(f"slot map {row} is not in use")
        self._in_use[row] = False
        self._free.append(row)

    @property
    def bytes_per_map(self) -> int:
        return self.table[0].nbytes

    def stats(self) -> PoolStats:
        return _stats(self.name, self.ledger, self.capacity, len(self._free), "maps")
