"""HiSparse's three leak-checked pools.

Memory layout (one tensor per layer; K and V of a token side by side)::

    host pool  (pinned host memory on CUDA, exactly its size: `pinned_empty`)
                                                   unit: pages of page_size tokens
        kv[layer]:    [num_pages * page_size, 2, kv_heads, head_dim]   (0: K, 1: V)
        index[layer]: [num_pages * page_size, index_dim]               (on device)
        token location = page_id * page_size + offset_in_page; page 0 reserved

    device buffer pool (on device)                 unit: slots of one token
        kv[layer]:    [1 + num_slots, 2, kv_heads, head_dim]
        slot 0 is the padding slot: padded attention rows read it, masked out

    slot maps (host memory: LRU bookkeeping)       unit: one map per request
        table: [num_maps, num_layers, max_context]  token -> local slot, -1

Each pool answers `stats()` from its own free list; the ledger's record of
what requests hold (kept by the machine) is independent, so the leak check's
``free + evictable + held == capacity`` means something at every moment.
Only the hooks in `hisparse.hooks` allocate from or free into them.
"""

from __future__ import annotations

import numpy as np
import torch

from resources.device_io import pinned_empty
from resources.free_list import FreeList
from resources.ledger import PoolUsage
from resources.page_allocator import PageAllocator
from resources.paging import pages_for

HOST_PAGES = "hisparse_host_pages"
DEVICE_SLOTS = "hisparse_device_slots"
SLOT_MAPS = "hisparse_slot_maps"


class HostKVPool:
    """Every HiSparse token's full K/V in host memory, and its index keys on device."""

    name = HOST_PAGES

    def __init__(self, *, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 index_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_tokens // page_size + 1, page_size)
        rows = self.allocator.num_pages * page_size
        # NOTE: pinned in place, not through torch's host allocator, which rounds each block
        # up to a power of two (a pool just over 2**n bytes would pin nearly twice its size)
        pin = device.type == "cuda"
        self.kv = [pinned_empty((rows, 2, num_kv_heads, head_dim), dtype, pin=pin) for _ in range(num_layers)]
        self.index = [torch.zeros((rows, index_dim), dtype=dtype, device=device) for _ in range(num_layers)]
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

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

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.allocator.capacity, free=self.allocator.num_free, unit="pages")


class DeviceBufferPool:
    """Device KV slots from which per-request buffers are cut."""

    name = DEVICE_SLOTS

    def __init__(self, *, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.allocator = PageAllocator(num_slots + 1, 1)  # slot 0: padding
        shape = (num_slots + 1, 2, num_kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one slot's K and V over all layers."""
        return sum(t[0].numel() * t.element_size() for t in self.kv)

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.allocator.capacity, free=self.allocator.num_free, unit="slots")


class SlotMapPool:
    """Per-request token -> device-slot maps, one row of `table` each."""

    name = SLOT_MAPS

    def __init__(self, *, num_maps: int, num_layers: int, max_context: int) -> None:
        self.capacity = num_maps
        self.table = np.full((num_maps, num_layers, max_context), -1, dtype=np.int64)
        self._free = FreeList(num_maps, what="slot map")

    def alloc(self) -> int | None:
        return self._free.alloc()

    def free(self, row: int) -> None:
        self._free.free(row)

    @property
    def bytes_per_map(self) -> int:
        return self.table[0].nbytes

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.capacity, free=self._free.num_free, unit="maps")
