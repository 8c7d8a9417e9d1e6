"""kvlife's rows of the foundation workloads (see `foundation_workloads`).

Allocator rows:

- ``kvlife PageAllocator``: the bare allocator, pages as numpy arrays end to
  end: `alloc_array`, then `free_chunks` of the request's arrays (their
  concatenation inside the timed free, as the anchor workload asks).
- ``kvlife page-table rows (hook as it should)``: each request's pages kept
  in its row of a host numpy page table, filled by `alloc_into` at admission
  and `alloc_one` per decode page, freed as one view at release.
- ``kvlife machine + KVHook``: the whole path: `RequestMachine` admission
  (request slot, pages, request -> token table, ledger), `KVHook.grow` per
  decode page, FINISHED -> RELEASED.

Prefix rows:

- ``kvlife radix (hook arrays)``: `RadixCache` + `PageAllocator` driven the way
  the KV hook should drive them: `match_pages` / `lock`, `alloc_array` (evicting
  with `evict_pages` first when short), one table write per admission and per
  new page, `insert_pages` / `free_chunks` / `unlock` at finish.
- ``kvlife machine + KVHook``: the engine's own pattern through the machine,
  the KV hook (page-table rows) and the pool.
"""

from __future__ import annotations

import os

import logging

import numpy as np
import structlog
import torch

from benchmarks.foundation_workloads import ALLOC_POOL_TOKENS, PAGE, PREFIX_POOL_TOKENS, PageLists
from resources.page_allocator import DoubleFree, PageAllocator
from resources.radix_cache import RadixCache
from resources.contract import order_hooks
from resources.kv_hook import KVHook
from resources.kv_pool import KVPool
from resources.ledger import Ledger, check_memory
from resources.request_slots import RequestSlotHook
from states import FinishReason, Request, RequestMachine
from states import RequestState as S

MAX_CONTEXT = 2048 + 1024 + 64 + 2 * PAGE

# what an embedding application does: debug events off, loggers cached
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                    cache_logger_on_first_use=True)


def _rejects_double_free(alloc: PageAllocator) -> bool:
    pages = alloc.alloc_array(1)
    alloc.free(pages)
    before = alloc.num_free
    try:
        alloc.free(pages)
    except DoubleFree:
        return alloc.num_free == before
    return False


class BareAllocator(PageLists):
    def __init__(self) -> None:
        self.allocator = PageAllocator(ALLOC_POOL_TOKENS // PAGE + 1, PAGE)

    def alloc(self, n: int) -> np.ndarray | None:
        return self.allocator.alloc_array(n)

    def free(self, chunks: list) -> None:
        self.allocator.free_chunks(chunks)

    def leaked(self) -> int:
        return self.allocator.capacity - self.allocator.num_free

    def rejects_double_free(self) -> bool:
        return _rejects_double_free(self.allocator)


class PageTableAllocator:
    """The KV hook's record as it should be: each request's pages in its row of
    a host page table (numpy), filled by `alloc_into` at admission and
    `alloc_one` per decode page, freed as one view: no list, no tensor, no
    concatenation."""

    page_size = PAGE

    def __init__(self, live: int = 32) -> None:
        self.allocator = PageAllocator(ALLOC_POOL_TOKENS // PAGE + 1, PAGE)
        self.pages = np.zeros((live, MAX_CONTEXT // PAGE + 1), dtype=np.int64)
        self.rows = list(self.pages)  # one view per slot
        self.count = [0] * live
        self.free_slots = list(range(live - 1, -1, -1))

    def admit(self, prompt: int) -> int:
        slot = self.free_slots.pop()
        n = -(-prompt // PAGE)
        assert self.allocator.alloc_into(self.rows[slot][:n])
        self.count[slot] = n
        return slot

    def grow(self, slot: int) -> None:
        n = self.count[slot]
        page = self.allocator.alloc_one()
        assert page is not None
        self.rows[slot][n] = page
        self.count[slot] = n + 1

    def finish(self, slot: int) -> None:
        self.allocator.free(self.rows[slot][: self.count[slot]])
        self.free_slots.append(slot)

    def leaked(self) -> int:
        return self.allocator.capacity - self.allocator.num_free

    def rejects_double_free(self) -> bool:
        return _rejects_double_free(self.allocator)


class _Machine:
    """Requests through RequestMachine + KVHook + RequestSlotHook + KVPool, as the engine assembles them."""

    def __init__(self, *, num_pages: int, live: int, prefix_cache: bool) -> None:
        self.ledger = Ledger()
        self.kv = KVPool(num_pages=num_pages, page_size=PAGE, max_running=live, max_context=MAX_CONTEXT,
                         device=os.environ.get("KVLIFE_BENCH_DEVICE", "cpu"), prefix_cache=prefix_cache)
        self.machine = RequestMachine(order_hooks([KVHook(self.kv), RequestSlotHook(self.kv.slots)]),
                                      ledger=self.ledger)
        self.count = 0

    def start(self, prompt: list[int]) -> Request:
        self.count += 1
        request = Request(f"r{self.count}", prompt, None)
        self.machine.start(request)
        self.machine.advance(request, S.PREFILLING)
        cached = request.kv_len
        request.kv_len = len(prompt)
        return request, cached

    def grow(self, request: Request) -> None:
        """The workload grows at page starts only: the tokens up to the next one
        decoded without needing memory, and the new one needs a page."""
        request.kv_len = -(-request.kv_len // PAGE) * PAGE
        assert self.machine.grow(request, request.kv_len + 1)
        request.kv_len += 1

    def end(self, request: Request) -> None:
        self.machine.finish(request, FinishReason.STOP)
        self.machine.try_release(request)

    def check(self) -> dict:
        check_memory([self.kv, self.kv.slots], self.ledger, idle=True)
        return {"leak_check": "pass"}


class MachineAllocator:
    page_size = PAGE

    def __init__(self) -> None:
        self.m = _Machine(num_pages=ALLOC_POOL_TOKENS // PAGE + 1, live=32, prefix_cache=False)

    def admit(self, prompt: int) -> Request:
        request, _ = self.m.start([1] * prompt)
        return request

    def grow(self, request: Request) -> None:
        self.m.grow(request)

    def finish(self, request: Request) -> None:
        self.m.end(request)

    def leaked(self) -> int:
        alloc = self.m.kv.allocator
        return alloc.capacity - alloc.num_free

    def rejects_double_free(self) -> bool:
        return _rejects_double_free(self.m.kv.allocator)


# ------------------------------------------------------------------ prefix
class _Live:
    __slots__ = ("prompt", "decode", "slot", "node", "cached", "chunks", "num_pages")


class RadixArrays:
    """RadixCache + PageAllocator + the request -> token table, the way the KV hook should drive them."""

    def __init__(self, live: int = 16) -> None:
        num_pages = PREFIX_POOL_TOKENS // PAGE + 1
        self.alloc = PageAllocator(num_pages, PAGE)
        self.radix = RadixCache(PAGE)
        self.table = torch.zeros((live, MAX_CONTEXT), dtype=torch.int64)
        self.free_slots = list(range(live - 1, -1, -1))
        self.offsets = np.arange(PAGE, dtype=np.int64)

    def _take(self, n: int) -> np.ndarray:
        short = n - self.alloc.num_free
        if short > 0:
            self.alloc.free(self.radix.evict_pages(short))
        pages = self.alloc.alloc_array(n)
        assert pages is not None
        return pages

    def _write(self, slot: int, first_page: int, pages: np.ndarray) -> None:
        locs = (pages[:, None] * PAGE + self.offsets).reshape(-1)
        start = first_page * PAGE
        self.table[slot, start : start + locs.shape[0]] = torch.from_numpy(locs)

    def admit(self, prompt: list[int], decode: list[int]):
        r = _Live()
        r.prompt, r.decode = prompt, decode
        r.slot = self.free_slots.pop()
        cached, r.node = self.radix.match_pages(prompt[:-1])
        self.radix.lock(r.node)
        r.cached = cached.shape[0]
        own = self._take(-(-len(prompt) // PAGE) - r.cached)
        r.chunks = [cached, own]
        r.num_pages = r.cached + own.shape[0]
        self._write(r.slot, 0, np.concatenate(r.chunks))
        return r, r.cached * PAGE

    def grow(self, r: _Live) -> None:
        page = self._take(1)
        self._write(r.slot, r.num_pages, page)
        r.chunks.append(page)
        r.num_pages += 1

    def finish(self, r: _Live) -> None:
        pages = np.concatenate(r.chunks)
        tokens = r.prompt + r.decode
        full = min(len(tokens) // PAGE, r.num_pages)
        duplicates = self.radix.insert_pages(tokens[: full * PAGE], pages[:full])
        self.alloc.free_chunks([duplicates, pages[full:]] if duplicates.size else [pages[full:]])
        # NOTE: the matched prefix's pages belong to the cache: never freed here
        self.radix.unlock(r.node)
        self.free_slots.append(r.slot)

    def check(self) -> dict:
        total = self.alloc.num_free + self.radix.evictable_pages + self.radix.protected_pages
        ok = total == self.alloc.capacity and self.radix.protected_pages == 0
        return {"leak_check": "pass" if ok else "FAIL", "cached_pages": self.radix.total_pages}


class RadixMachine:
    def __init__(self, live: int = 16) -> None:
        self.m = _Machine(num_pages=PREFIX_POOL_TOKENS // PAGE + 1, live=live, prefix_cache=True)

    def admit(self, prompt: list[int], decode: list[int]):
        request, cached = self.m.start(prompt)
        request.extras["decode"] = iter(decode)
        request.output_token_ids.append(next(request.extras["decode"]))
        self.m.machine.advance(request, S.PREBUILT)
        self.m.machine.advance(request, S.DECODING)
        return request, cached

    def grow(self, request: Request) -> None:
        self.m.grow(request)

    def finish(self, request: Request) -> None:
        for token in request.extras["decode"]:
            request.output_token_ids.append(token)
        request.kv_len = request.num_tokens
        self.m.end(request)

    def check(self) -> dict:
        return self.m.check()


ADAPTERS = {
    "allocator": {"kvlife PageAllocator": BareAllocator,
                  "kvlife page-table rows (hook as it should)": PageTableAllocator,
                  "kvlife machine + KVHook": MachineAllocator},
    "prefix": {"kvlife radix (hook arrays)": RadixArrays, "kvlife machine + KVHook": RadixMachine},
}
