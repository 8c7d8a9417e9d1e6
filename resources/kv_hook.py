"""The KV hook: a request's KV pages and its prefix-cache lock.

Acquired on admission (entering PREFILLING, or TRANSFERRING in the decode
role, where the pages are pre-allocated to receive a transfer), after the
request slot whose token-table row it writes. Held until FINISHED;
RETRACTED is outside its scope, so preemption releases it.

`handle.amount` is the number of pages the request owns (the matched prefix
is the cache's, locked, and reported as the pool's shared pages).

Release, in this order: insert the request's complete KV (its first
`kv_len` tokens, whole pages only) into the prefix cache, free the pages the
cache did not take, unlock the matched prefix. Incomplete KV (aborted
mid-prefill, failed transfer) is never cached, because `kv_len` only ever
counts tokens whose KV is complete, and neither is the KV of a handle that
was quarantined (a late copy may have written it).

Sliding windows: when every layer of the model has one, growth also frees
the request's own pages that lie wholly before the widest window (no query
can attend them again); such a request caches nothing at release, since its
KV no longer starts at token 0.

NOTE: a request with images neither matches nor inserts prefixes. Its
placeholder token ids are the same for every image, so token-keyed pages
would hand one request's image KV to another request with a different
image (caching them needs keys that include the image content).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from resources.contract import ResourceExhausted, ResourceHook
from resources.kv_pool import KV_PAGES, KVPool
from resources.request_slots import KV_SCOPE, RequestSlotHook
from states import Handle, Request, RequestState

S = RequestState


@attrs.define
class KVBlock:
    """The KV hook's record: slot, page ids in token order, the locked prefix."""

    slot: int
    pages: list[int]
    num_prefix_pages: int = 0
    prefix_node: Any = None  # the radix node locked for the prefix
    #: pages [drop_from, drop_from + num_dropped) were freed because every layer's sliding
    #: window has left them (their table entries stay, masked out by the window)
    drop_from: int = 0
    num_dropped: int = 0


class KVHook(ResourceHook):
    name = "kv"
    acquire_on = frozenset({S.PREFILLING, S.TRANSFERRING})
    scope = KV_SCOPE
    pool = KV_PAGES

    def __init__(self, kv: KVPool, *, scope: frozenset[RequestState] | None = None,
                 window: int | None = None) -> None:
        self.kv = kv
        #: the widest sliding window when every layer has one: pages wholly before it are freed
        self.window = window
        if scope is not None:  # HiSparse narrows it: device pages only until staging is done
            self.scope = frozenset(scope)

    # ------------------------------------------------------------- acquire
    def acquire(self, request: Request, into: RequestState) -> Handle:
        kv = self.kv
        tokens = request.all_token_ids
        slot = RequestSlotHook.slot(request)
        prefix_pages: list[int] = []
        node = None
        if self._caches(request) and into is S.PREFILLING:
            # leave at least one token to compute: its logits give the next token
            prefix_pages, node = kv.radix.match(tokens[: len(tokens) - 1])
            if prefix_pages:
                kv.radix.lock(node)
            else:
                node = None
        need = kv.pages_for(len(tokens)) - len(prefix_pages)
        pages = kv.alloc_pages(need)
        if pages is None:
            if node is not None:
                kv.radix.unlock(node)
            raise ResourceExhausted(f"need {need} KV pages, {kv.available_pages} available")
        if prefix_pages:
            kv.write_locations(slot, 0, torch.tensor(prefix_pages, dtype=torch.int64))
        kv.write_locations(slot, len(prefix_pages), pages)
        block = KVBlock(slot, prefix_pages + pages.tolist(), len(prefix_pages), node)
        if node is not None:
            kv.prefix_locks[request] = (node, len(prefix_pages))
        request.kv_len = len(prefix_pages) * kv.page_size
        return Handle(self.name, request.request_id, block, amount=need)

    def grow(self, request: Request, handle: Handle, num_tokens: int) -> bool:
        """Make the request's pages cover `num_tokens` tokens; False if the pool is short."""
        block: KVBlock = handle.payload
        if self.window is not None:
            self._drop_outside_window(request, block, handle, num_tokens)
        need = self.kv.pages_for(num_tokens) - len(block.pages)
        if need <= 0:
            return True
        pages = self.kv.alloc_pages(need)
        if pages is None:
            return False
        self.kv.write_locations(block.slot, len(block.pages), pages)
        block.pages.extend(pages.tolist())
        handle.amount += need
        return True

    def _drop_outside_window(self, request: Request, block: KVBlock, handle: Handle, num_tokens: int) -> None:
        """Free the own pages no query can attend any more: the step computes position
        num_tokens - 1, and later queries only go further, so a page whose last position
        is before `num_tokens - window` is dead in every layer. The prompt's whole pages
        stay when the request caches (they are what other requests can reuse)."""
        assert self.window is not None
        ps = self.kv.page_size
        if not block.num_dropped:
            keep = request.num_prompt_tokens // ps if self._caches(request) else 0
            block.drop_from = max(block.num_prefix_pages, keep)
        first = block.drop_from + block.num_dropped
        dead = max(0, (num_tokens - self.window) // ps)
        if dead <= first:
            return
        self.kv.allocator.free(torch.tensor(block.pages[first:dead], dtype=torch.int64))
        block.num_dropped += dead - first
        handle.amount -= dead - first

    # ------------------------------------------------------------- release
    def release(self, request: Request, handle: Handle) -> None:
        kv = self.kv
        block: KVBlock = handle.payload
        dropped = range(block.drop_from, block.drop_from + block.num_dropped)
        held = [i for i in range(block.num_prefix_pages, len(block.pages)) if i not in dropped]
        to_free = [block.pages[i] for i in held]
        if self._caches(request) and not handle.was_quarantined:  # NOTE: see the module docstring
            full = min(request.kv_len // kv.page_size, len(block.pages))
            if block.num_dropped:  # only the pages before the freed ones still form a prefix
                full = min(full, block.drop_from)
            if full > block.num_prefix_pages:
                tokens = request.all_token_ids[: full * kv.page_size]
                duplicates = kv.radix.insert(tokens, block.pages[:full])
                to_free = duplicates + [block.pages[i] for i in held if i >= full]
        if to_free:
            kv.allocator.free(torch.tensor(to_free, dtype=torch.int64))
        if block.prefix_node is not None:
            kv.radix.unlock(block.prefix_node)
            kv.prefix_locks.pop(request, None)

    def publish(self, request: Request, handle: Handle) -> None:
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
        duplicates = kv.radix.insert(tokens, block.pages[:full])
        cached, node = kv.radix.match(tokens)
        kv.radix.lock(node)
        if block.prefix_node is not None:
            kv.radix.unlock(block.prefix_node)
        for index in (i for i in range(full) if block.pages[i] != cached[i]):
            kv.write_locations(block.slot, index, torch.tensor([cached[index]], dtype=torch.int64))
        if duplicates:
            kv.allocator.free(torch.tensor(duplicates, dtype=torch.int64))
        block.pages[:full] = cached
        block.num_prefix_pages, block.prefix_node = full, node
        kv.prefix_locks[request] = (node, full)
        handle.amount = len(block.pages) - full

    def quarantine(self, request: Request, handle: Handle) -> None:
        """A copy may still write the request's own pages: they stay allocated until the
        fence completes. The matched prefix is only read, so its lock goes now."""
        block: KVBlock = handle.payload
        if block.prefix_node is not None:
            self.kv.radix.unlock(block.prefix_node)
            self.kv.prefix_locks.pop(request, None)
            block.prefix_node = None

    def _caches(self, request: Request) -> bool:
        return (self.kv.prefix_cache or request.shares_prompt) and not request.mm_inputs
