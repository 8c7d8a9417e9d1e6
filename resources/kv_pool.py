"""KV memory: pages and the prefix cache, as the leak-checked pool ``kv_pages``.

`KVPool` composes the page allocator, the request slots (with the request
-> token-location table) and the radix prefix cache. The ``kv_pages`` pool
reports: capacity = usable pages; free = the allocator's free pages;
evictable = unlocked prefix-cache pages; shared = prefix-cache pages locked
by running requests. The ledger adds the pages requests own, so

    free + evictable + shared + owned == capacity

Only `resources.kv_hook.KVHook` allocates from or frees into it; unlocked
prefix-cache pages leave by eviction when an allocation needs room.

Each request slot has a row of `page_table` (host int64, numpy): the
request's page ids in token order, filled in place (no list, no tensor on
the hot path). `req_to_token` (on the device) is written from it, once per
allocation, by `write_locations`: in place on the host, else by one
asynchronous copy from pinned memory, ordered before the next step.

The radix cache always exists: `prefix_cache=False` only stops ordinary
requests from matching and inserting.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from resources.device_io import upload
from resources.ledger import Owner, PoolUsage
from resources.page_allocator import PageAllocator
from resources.paging import pages_for
from resources.radix_cache import RadixCache
from resources.request_slots import RequestSlots
from states import Request

KV_PAGES = "kv_pages"


class KVPool:
    name = KV_PAGES

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_running: int,
        max_context: int,
        device: torch.device | str,
        prefix_cache: bool = True,
    ) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.prefix_cache = prefix_cache
        self.allocator = PageAllocator(num_pages, page_size)
        self.slots = RequestSlots(max_running, max_context, page_size, device)
        self.page_table = np.zeros((max_running, pages_for(max_context, page_size)), dtype=np.int64)
        self.radix = RadixCache(page_size)
        #: request -> (locked radix node, pages it protects), for attribution
        self.prefix_locks: dict[Request, tuple[object, int]] = {}
        #: issue 21: session anchor -> (locked radix node, pages): a session's kept KV, locked by
        #: `resources.session_hook` (reported as `kept`, held legitimately while idle)
        self.session_locks: dict[Request, tuple[Any, int]] = {}
        self._offsets = np.arange(page_size, dtype=np.int64)
        #: the token table itself when it lives in host memory (written in place), else None
        self._table_np = self.slots.req_to_token.numpy() if self.device.type == "cpu" else None

    # ----------------------------------------------------------- queries
    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def available_pages(self) -> int:
        """Pages an allocation could get now: free plus evictable."""
        return self.allocator.num_free + self.radix.evictable_pages

    def stats(self) -> PoolUsage:
        kept = self.radix.path_pages([node for node, _ in self.session_locks.values()]) if self.session_locks else 0
        return PoolUsage(capacity=self.allocator.capacity, free=self.allocator.num_free,
                         evictable=self.radix.evictable_pages, shared=self.radix.protected_pages, unit="pages",
                         kept=kept)

    def shared_owners(self) -> list[Owner]:
        """The requests (and sessions) holding locked prefix-cache pages (shared, so possibly overlapping)."""
        return [Owner.of(request, pages) for locks in (self.prefix_locks, self.session_locks)
                for request, (_node, pages) in locks.items()]

    # ------------------------------------------------- used by the KV hook
    def alloc_into(self, out: np.ndarray) -> bool:
        """Fill `out` (a slice of a page-table row) with fresh pages, evicting unlocked
        prefix-cache pages if needed; False (changing nothing) if the pool is short."""
        if not self._make_room(out.shape[0]):
            return False
        return self.allocator.alloc_into(out)

    def alloc_one(self) -> int | None:
        """One fresh page (evicting if needed), or None if the pool is short."""
        if not self._make_room(1):
            return None
        return self.allocator.alloc_one()

    def _make_room(self, n: int) -> bool:
        short = n - self.allocator.num_free
        if short <= 0:
            return True
        if short > self.radix.evictable_pages:
            return False
        self.allocator.free(self.radix.evict_pages(short))
        return True

    def flush_prefix_cache(self) -> tuple[int, int]:
        """Free every prefix-cache page no request holds: the whole cache (`RadixCache.clear`) when
        nothing is locked, else the evictable pages. Returns (pages freed, pages still cached)."""
        pages = self.radix.evict_pages(self.radix.evictable_pages) if self.radix.protected_pages else self.radix.clear()
        self.allocator.free(pages)
        return int(pages.shape[0]), self.radix.total_pages

    def write_locations(self, slot: int, first_page_index: int, pages: np.ndarray) -> None:
        """Fill `req_to_token[slot]` for `pages`, starting at page index `first_page_index`."""
        if not pages.shape[0]:
            return
        ps = self.page_size
        locs = (pages[:, None] * ps + self._offsets).reshape(-1)
        start = first_page_index * ps
        if self._table_np is not None:
            self._table_np[slot, start : start + locs.shape[0]] = locs
        else:  # NOTE: from pinned memory, asynchronously: no wait on the event loop's thread
            self.slots.req_to_token[slot, start : start + locs.shape[0]].copy_(upload(locs, self.device))
