"""The KV hook: a request's KV pages and its prefix-cache lock.

Acquired on admission (entering PREFILLING, or TRANSFERRING in the decode
role, where the pages are pre-allocated to receive a transfer), after the
request slot whose token-table row it writes. Held until FINISHED;
RETRACTED is outside its scope, so preemption releases it.

`handle.amount` is the number of pages the request owns (the matched prefix
is the cache's, locked, and reported as the pool's shared pages). The
matched prefix is complete KV: `KVHook.cached_tokens(request)` says how many
tokens it covers, and the runtime's step applier (the one writer of
`Request.kv_len`) starts the request's progress there.

Release, in this order: insert the request's complete KV (its first
`kv_len` tokens, whole pages only) into the prefix cache, free the pages the
cache did not take, unlock the matched prefix. Incomplete KV (aborted
mid-prefill, failed transfer) is never cached, because `kv_len` only ever
counts tokens whose KV is complete, and neither is the KV of a handle that
was quarantined (a late copy may have written it).

Two declared shrinks (`resources.contract`), besides the release:

- `trim`: when every layer of the model has a sliding window, the request's
  own pages that lie wholly before the widest window are given back before
  each growth (no query can attend them again); only the pages before the
  freed ones can then be cached at release (with the prefix cache on, the
  prompt's whole pages are kept for that).
- `publish`: an n > 1 leader's complete whole prompt pages go to the prefix
  cache when it has its first token, so the other sequences match them.

The request's page ids live in its slot's row of the pool's `page_table`
(numpy, filled in place); a quarantined handle takes its own copy, since its
slot is given back at once.

NOTE: a request with images neither matches nor inserts prefixes. Its
placeholder token ids are the same for every image, so token-keyed pages
would hand one request's image KV to another request with a different
image (caching them needs keys that include the image content).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from resources.contract import ResourceExhausted, ResourceHook
from resources.kv_pool import KV_PAGES, KVPool
from resources.request_slots import KV_SCOPE, RequestSlotHook
from states import Handle, Request, RequestState

S = RequestState


@attrs.define(eq=False)
class KVBlock:
    """The KV hook's record: the slot, its page-table row (page ids in token order, the
    first `num_pages` valid), the locked prefix, and the pages freed outside the window."""

    slot: int
    row: npt.NDArray[np.int64]
    num_pages: int = 0
    num_prefix_pages: int = 0
    prefix_node: Any = None  # the radix node locked for the prefix
    #: tokens of the prefix matched at admission (complete KV: the prefix cache's)
    cached_tokens: int = 0
    #: pages [drop_from, drop_from + num_dropped) were freed because every layer's sliding
    #: window has left them (their table entries stay, masked out by the window)
    drop_from: int = 0
    num_dropped: int = 0

    @property
    def pages(self) -> list[int]:
        ids: list[int] = self.row[: self.num_pages].tolist()
        return ids

    def held_pages(self) -> npt.NDArray[np.int64]:
        """The page ids the request owns (not the cache's prefix, not the freed ones)."""
        own = self.row[self.num_prefix_pages : self.num_pages]
        if not self.num_dropped:
            return own
        start = self.drop_from - self.num_prefix_pages
        return np.concatenate((own[:start], own[start + self.num_dropped :]))


class KVHook(ResourceHook):
    name = "kv"
    acquire_on = frozenset({S.PREFILLING, S.TRANSFERRING})
    scope = KV_SCOPE
    pool = KV_PAGES

    def __init__(self, kv: KVPool, *, scope: frozenset[RequestState] | None = None,
                 window: int | None = None, acquire_on: frozenset[RequestState] | None = None) -> None:
        self.kv = kv
        #: the widest sliding window when every layer has one (`SlidingWindowKVHook` trims)
        self.window = window
        if scope is not None:  # HiSparse narrows it: device pages only until staging is done
            self.scope = frozenset(scope)
        if acquire_on is not None:  # HiSparse's decode role: a transfer lands in host rows, not pages
            self.acquire_on = frozenset(acquire_on)

    @staticmethod
    def cached_tokens(request: Request) -> int:
        """Tokens of the request's prompt found in the prefix cache at its admission (0 when
        it holds no KV handle)."""
        handle = request.handles.get(KVHook.name)
        return 0 if handle is None else KVHook.block(handle).cached_tokens

    @staticmethod
    def block(handle: Handle[Any]) -> KVBlock:
        """The KV handle's record."""
        payload = handle.payload
        assert isinstance(payload, KVBlock)
        return payload

    # ------------------------------------------------------------- acquire
    def acquire(self, request: Request, into: RequestState) -> Handle[KVBlock]:
        kv = self.kv
        slot = RequestSlotHook.slot(request)
        num_tokens = request.num_tokens
        row = kv.page_table[slot]
        num_prefix, node = 0, None
        # issue 21: a request that wants prompt logprobs computes its whole prompt (`skip_prefix_match`)
        if self._caches(request) and into is S.PREFILLING and not request.skip_prefix_match:
            # leave at least one token to compute: its logits give the next token
            prefix, node = kv.radix.match_pages(request.first_tokens(num_tokens - 1))
            num_prefix = prefix.shape[0]
            if num_prefix:
                kv.radix.lock(node)
                row[:num_prefix] = prefix
            else:
                node = None
        num_pages = kv.pages_for(num_tokens)
        if not kv.alloc_into(row[num_prefix:num_pages]):
            if node is not None:
                kv.radix.unlock(node)
            raise ResourceExhausted(f"need {num_pages - num_prefix} KV pages, {kv.available_pages} available")
        kv.write_locations(slot, 0, row[:num_pages])
        if node is not None:
            kv.prefix_locks[request] = (node, num_prefix)
        block = KVBlock(slot, row, num_pages, num_prefix, node, cached_tokens=num_prefix * kv.page_size)
        return Handle(self.name, request.request_id, block, amount=num_pages - num_prefix)

    def grow(self, request: Request, handle: Handle[KVBlock], num_tokens: int) -> bool:
        """Make the request's pages cover `num_tokens` tokens; False if the pool is short."""
        block = handle.payload
        n = block.num_pages
        need = self.kv.pages_for(num_tokens) - n
        if need <= 0:
            return True
        if need == 1:
            page = self.kv.alloc_one()
            if page is None:
                return False
            block.row[n] = page
        elif not self.kv.alloc_into(block.row[n : n + need]):
            return False
        self.kv.write_locations(block.slot, n, block.row[n : n + need])
        block.num_pages = n + need
        handle.amount += need
        return True

    def extend(self, request: Request, handle: Handle[KVBlock], num_tokens: int) -> bool:
        """Speculative decoding: pages for the draft tokens too (a growth like any other)."""
        return self.grow(request, handle, num_tokens)

    def rollback(self, request: Request, handle: Handle[KVBlock], num_tokens: int) -> None:
        """Give back the pages wholly past `num_tokens` tokens: they hold only the KV of
        draft tokens the model rejected (never the cache's prefix, never a page in use)."""
        block = handle.payload
        keep = max(self.kv.pages_for(num_tokens), block.num_prefix_pages, block.drop_from + block.num_dropped)
        if keep >= block.num_pages:
            return
        self.kv.allocator.free(block.row[keep : block.num_pages])
        handle.amount -= block.num_pages - keep
        block.num_pages = keep

    # ------------------------------------------------------------- release
    def release(self, request: Request, handle: Handle[KVBlock]) -> None:
        kv = self.kv
        block = handle.payload
        to_free = [block.held_pages()]
        if self._caches(request) and not handle.was_quarantined:  # NOTE: see the module docstring
            full = min(request.kv_len // kv.page_size, block.num_pages)
            if block.num_dropped:  # only the pages before the freed ones still form a prefix
                full = min(full, block.drop_from)
            if full > block.num_prefix_pages:
                duplicates = kv.radix.insert_pages(request.first_tokens(full * kv.page_size), block.row[:full])
                rest = block.row[full : block.num_pages]
                if block.num_dropped:
                    rest = np.concatenate((block.row[full : block.drop_from],
                                           block.row[block.drop_from + block.num_dropped : block.num_pages]))
                to_free = [duplicates, rest]
        chunks = [chunk for chunk in to_free if chunk.shape[0]]
        if chunks:
            kv.allocator.free_chunks(chunks)
        if block.prefix_node is not None:
            kv.radix.unlock(block.prefix_node)
            kv.prefix_locks.pop(request, None)

    def publish(self, request: Request, handle: Handle[KVBlock]) -> None:
        """Hand the request's complete whole prompt pages to the prefix cache now (not at
        release), keeping them locked, so the other sequences of its prompt match them.

        Pages the cache already holds for the same tokens replace the request's own
        copies (the token table is rewritten, the copies freed). The request then owns
        only the pages past the published prefix (`handle.amount`)."""
        kv, block = self.kv, handle.payload
        ps = kv.page_size
        full = min(request.kv_len, request.num_prompt_tokens) // ps
        if full <= block.num_prefix_pages or not self._caches(request):
            return
        tokens = request.prompt_token_ids[: full * ps]
        duplicates = kv.radix.insert_pages(tokens, block.row[:full])
        cached, node = kv.radix.match_pages(tokens)
        kv.radix.lock(node)
        if block.prefix_node is not None:
            kv.radix.unlock(block.prefix_node)
        changed = np.flatnonzero(block.row[:full] != cached)
        block.row[:full] = cached
        for index in changed.tolist():
            kv.write_locations(block.slot, index, block.row[index : index + 1])
        if duplicates.shape[0]:
            kv.allocator.free(duplicates)
        block.num_prefix_pages, block.prefix_node = full, node
        kv.prefix_locks[request] = (node, full)
        handle.amount = block.num_pages - full - block.num_dropped

    def quarantine(self, request: Request, handle: Handle[KVBlock]) -> None:
        """A copy may still write the request's own pages: they stay allocated until the
        fence completes. The matched prefix is only read, so its lock goes now; the slot
        is given back at once, so the block keeps its own copy of the page ids."""
        block = handle.payload
        block.row = block.row[: block.num_pages].copy()
        if block.prefix_node is not None:
            self.kv.radix.unlock(block.prefix_node)
            self.kv.prefix_locks.pop(request, None)
            block.prefix_node = None

    def _caches(self, request: Request) -> bool:
        return (self.kv.prefix_cache or request.shares_prompt) and not request.mm_inputs


class SlidingWindowKVHook(KVHook):
    """The KV hook of a model whose every layer has a sliding window: it also trims (the
    declared shrink of `resources.contract`)."""

    def __init__(self, kv: KVPool, *, window: int, scope: frozenset[RequestState] | None = None,
                 acquire_on: frozenset[RequestState] | None = None) -> None:
        super().__init__(kv, scope=scope, window=window, acquire_on=acquire_on)

    def trim(self, request: Request, handle: Handle[KVBlock], num_tokens: int) -> None:
        """Free the own pages no query can attend any more (every layer has a sliding window):
        the step computes position num_tokens - 1, and later queries only go further, so a
        page whose last position is before `num_tokens - window` is dead in every layer. The
        prompt's whole pages stay when the request caches (they are what others can reuse)."""
        assert self.window is not None  # NOTE: given at construction
        block = handle.payload
        ps = self.kv.page_size
        if not block.num_dropped:
            keep = request.num_prompt_tokens // ps if self._caches(request) else 0
            block.drop_from = max(block.num_prefix_pages, keep)
        first = block.drop_from + block.num_dropped
        dead = max(0, (num_tokens - self.window) // ps)
        if dead <= first:
            return
        self.kv.allocator.free(block.row[first:dead])
        block.num_dropped += dead - first
        handle.amount -= dead - first
