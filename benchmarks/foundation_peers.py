"""SGLang's and vLLM's rows of the foundation workloads (see `foundation_workloads`).

Imported only in a separate environment where those packages are installed
(never the project's). Each adapter calls the peer's own allocator or cache
API the way that engine's scheduler does; nothing of theirs is copied.

Allocator rows: SGLang ``PagedTokenToKVPoolAllocator`` (page 16: token-index
tensors, ``alloc(tokens)`` / ``free(indices)``), SGLang
``TokenToKVPoolAllocator`` (page 1: one index per token), vLLM v1
``BlockPool`` (page 16, caching off: ``get_new_blocks`` / ``free_blocks``).

Prefix row: SGLang ``RadixCache`` (page 16) over its paged allocator:
``match_prefix`` + ``path_device_indices`` + ``inc_lock_ref`` at admission,
``evict`` when the allocator is short, ``insert`` + free of the duplicate
and unaligned tail + ``dec_lock_ref`` at finish (what its
``cache_finished_req`` does).
"""

from __future__ import annotations

import torch

from benchmarks.foundation_workloads import ALLOC_POOL_TOKENS, PAGE, PREFIX_POOL_TOKENS, PageLists


class SGLangPaged(PageLists):
    def __init__(self, tokens: int = ALLOC_POOL_TOKENS) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        self.alloc_ = PagedTokenToKVPoolAllocator(tokens, PAGE, torch.float32, "cpu", None, False)
        self.capacity = tokens

    def alloc(self, n: int):
        return self.alloc_.alloc(n * PAGE)

    def free(self, chunks: list) -> None:
        self.alloc_.free(torch.cat(chunks) if len(chunks) > 1 else chunks[0])

    def leaked(self) -> int:
        return (self.capacity - self.alloc_.available_size()) // PAGE

    def rejects_double_free(self) -> bool:
        pages = self.alloc_.alloc(PAGE)
        self.alloc_.free(pages)
        before = self.alloc_.available_size()
        try:
            self.alloc_.free(pages)
        except Exception:
            return self.alloc_.available_size() == before
        return False


class SGLangToken(SGLangPaged):
    page_size = 1

    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        self.alloc_ = TokenToKVPoolAllocator(ALLOC_POOL_TOKENS, torch.float32, "cpu", None, False)
        self.capacity = ALLOC_POOL_TOKENS

    def alloc(self, n: int):
        return self.alloc_.alloc(n)

    def leaked(self) -> int:
        return self.capacity - self.alloc_.available_size()

    def rejects_double_free(self) -> bool:
        pages = self.alloc_.alloc(1)
        self.alloc_.free(pages)
        before = self.alloc_.available_size()
        try:
            self.alloc_.free(pages)
        except Exception:
            return self.alloc_.available_size() == before
        return False


class VLLMBlockPool(PageLists):
    def __init__(self) -> None:
        from vllm.v1.core.block_pool import BlockPool

        self.pool = BlockPool(ALLOC_POOL_TOKENS // PAGE + 1, enable_caching=False, hash_block_size=PAGE)
        self.capacity = self.pool.get_num_free_blocks()

    def alloc(self, n: int):
        return self.pool.get_new_blocks(n)

    def free(self, chunks: list) -> None:
        self.pool.free_blocks([block for chunk in chunks for block in chunk])

    def leaked(self) -> int:
        return self.capacity - self.pool.get_num_free_blocks()

    def rejects_double_free(self) -> bool:
        blocks = self.pool.get_new_blocks(1)
        self.pool.free_blocks(blocks)
        before = self.pool.get_num_free_blocks()
        try:
            self.pool.free_blocks(blocks)
        except Exception:
            return self.pool.get_num_free_blocks() == before
        ok = blocks[0].ref_cnt >= 0 and self.pool.get_num_free_blocks() == before
        blocks[0].ref_cnt = 0  # undo the accepted duplicate so the leak count stays honest
        return ok


class _Req:
    __slots__ = ("tokens", "indices", "node", "cached")


class SGLangRadix:
    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.alloc = PagedTokenToKVPoolAllocator(PREFIX_POOL_TOKENS, PAGE, torch.float32, "cpu", None, False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                               token_to_kv_pool_allocator=self.alloc, page_size=PAGE))
        self.Key, self.Match, self.Insert, self.Evict = RadixKey, MatchPrefixParams, InsertParams, EvictParams

    def _take(self, tokens: int) -> torch.Tensor:
        short = tokens - self.alloc.available_size()
        if short > 0:
            self.tree.evict(self.Evict(num_tokens=short))
        out = self.alloc.alloc(tokens)
        assert out is not None
        return out

    def admit(self, prompt: list[int], decode: list[int]):
        r = _Req()
        r.tokens = prompt + decode
        match = self.tree.match_prefix(self.Match(key=self.Key(prompt[:-1])))
        r.node = match.last_device_node
        self.tree.inc_lock_ref(r.node)
        cached = self.tree.path_device_indices(r.node)
        r.cached = cached.shape[0]
        need = -(-len(prompt) // PAGE) * PAGE - r.cached
        r.indices = [cached, self._take(need)]
        return r, r.cached

    def grow(self, r: _Req) -> None:
        r.indices.append(self._take(PAGE))

    def finish(self, r: _Req) -> None:
        indices = torch.cat(r.indices)
        full = min(len(r.tokens) // PAGE * PAGE, indices.shape[0])
        result = self.tree.insert(self.Insert(key=self.Key(r.tokens[:full]), value=indices[:full]))
        # the part that was already cached under other indices, and the unaligned tail
        self.alloc.free(indices[r.cached : result.prefix_len])
        self.alloc.free(indices[full:])
        self.tree.dec_lock_ref(r.node)

    def check(self) -> dict:
        total = self.alloc.available_size() + self.tree.evictable_size() + self.tree.protected_size()
        return {"leak_check": "pass" if total == PREFIX_POOL_TOKENS else f"FAIL ({total})"}


ADAPTERS = {
    "allocator": {"sglang PagedTokenToKVPoolAllocator (page 16)": SGLangPaged,
                  "sglang TokenToKVPoolAllocator (page 1)": SGLangToken,
                  "vllm v1 BlockPool (page 16)": VLLMBlockPool},
    "prefix": {"sglang RadixCache (page 16)": SGLangRadix},
}
