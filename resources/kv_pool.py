"""KV memory: pages, request slots and the prefix cache, as two leak-checked pools.

`KVPool` composes the page allocator, the request slots (with the
request -> token-location table) and the radix prefix cache, and exposes
them to the leak check as two pools:

- ``kv_pages``: capacity = usable pages; free = allocator; evictable =
  unlocked prefix-cache pages; held = pages owned by requests (ledger) +
  prefix-cache pages locked by running requests.
- ``request_slots``: capacity = max_running; held = slots owned (ledger).

Only `resources.kv_hook.KVHook` allocates from or frees into it.
"""

from __future__ import annotations

import torch

from resources.ledger import Ledger, Owner, PoolStats
from resources.page_allocator import PageAllocator
from resources.radix_cache import RadixCache
from resources.request_slots import RequestSlots

KV_PAGES = "kv_pages"
REQUEST_SLOTS = "request_slots"


class KVPool:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_running: int,
        max_context: int,
        device: torch.device | str,
        ledger: Ledger,
        prefix_cache: bool = True,
    ) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.ledger = ledger
        self.allocator = PageAllocator(num_pages, page_size)
        self.slots = RequestSlots(max_running, max_context, device)
        self.radix = RadixCache(page_size) if prefix_cache else None
        #: request id -> (locked radix node, pages it protects), for attribution
        self.prefix_locks: dict[str, tuple[object, int]] = {}
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.pools = (_PageStatsView(self), _SlotStatsView(self))

    # ----------------------------------------------------------- queries
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def available_pages(self) -> int:
        """Pages an allocation could get now: free plus evictable."""
        evictable = self.radix.evictable_pages if self.radix else 0
        return self.allocator.num_free + evictable

    # ------------------------------------------------- used by the KV hook
    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """Allocate `n` pages, evicting unlocked prefix-cache pages if needed."""
        short = n - self.allocator.num_free
        if short > 0:
            if self.radix is None or short > self.radix.evictable_pages:
                return None
            evicted = self.radix.evict(short)
            self.allocator.free(torch.tensor(evicted, dtype=torch.int64))
        return self.allocator.alloc(n)

    def write_locations(self, slot: int, first_page_index: int, pages: torch.Tensor) -> None:
        """Fill `req_to_token[slot]` for `pages`, starting at page index `first_page_index`."""
        if pages.numel() == 0:
            return
        ps = self.page_size
        locs = (pages.to(self.device).unsqueeze(1) * ps + self._offsets).reshape(-1)
        start = first_page_index * ps
        self.slots.req_to_token[slot, start : start + locs.numel()] = locs


class _PageStatsView:
    name = KV_PAGES

    def __init__(self, kv: KVPool) -> None:
        self.kv = kv

    def stats(self) -> PoolStats:
        kv = self.kv
        radix = kv.radix
        return PoolStats(
            capacity=kv.allocator.capacity,
            free=kv.allocator.num_free,
            evictable=radix.evictable_pages if radix else 0,
            held=kv.ledger.held(KV_PAGES) + (radix.protected_pages if radix else 0),
            quarantined=kv.ledger.quarantined(KV_PAGES),
            suspect=KV_PAGES in kv.ledger.suspect,
            unit="pages",
        )

    def owners(self) -> list[Owner]:
        owners = self.kv.ledger.owners(KV_PAGES)
        for rid, (_node, pages) in self.kv.prefix_locks.items():
            req = self.kv.ledger.request(rid)
            owners.append(Owner(rid, req.state if req else None, req.finish_reason if req else None, pages))
        return owners


class _SlotStatsView:
    name = REQUEST_SLOTS

    def __init__(self, kv: KVPool) -> None:
        self.kv = kv

    def stats(self) -> PoolStats:
        kv = self.kv
        return PoolStats(
            capacity=kv.slots.capacity,
            free=kv.slots.num_free,
            evictable=0,
            held=kv.ledger.held(REQUEST_SLOTS),
            quarantined=kv.ledger.quarantined(REQUEST_SLOTS),
            suspect=REQUEST_SLOTS in kv.ledger.suspect,
            unit="slots",
        )
