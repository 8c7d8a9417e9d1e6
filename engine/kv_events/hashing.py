"""The chained page hash of KV events: vLLM 0.33.0's ``sha256_cbor`` block hash, so a subscriber
recomputes it from token ids alone (llm-d's precise prefix scorer tokenizes prompts and does).

For the pages of a token sequence, page by page (``page_size`` tokens each, whole pages only):

    NONE_HASH = sha256(cbor(seed))                                  # seed: "vllm-none-hash"
    digest[i] = sha256(cbor([digest[i-1] or NONE_HASH, [tokens of page i], null]))
    hash[i]   = int.from_bytes(digest[i], "big") & (2**64 - 1)     # the last 8 bytes, unsigned

with canonical CBOR (RFC 8949 §4.2) as the ``cbor2`` package writes it (``canonical=True``). It is
what vLLM 0.33.0 computes with ``--prefix-caching-hash-algo sha256_cbor``, PYTHONHASHSEED unset
(or set to the seed) and ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (its default), no LoRA, no
multimodal inputs, no cache salt. The first page's ``parent_block_hash`` in an event is null.

    block_hashes(token_ids, page_size=16)     # the hashes of every whole page, in order
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

import cbor2

DEFAULT_SEED = "vllm-none-hash"
_MASK = (1 << 64) - 1


@lru_cache(maxsize=8)
def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """The parent digest of a sequence's first page."""
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def page_digest(parent: bytes | None, tokens: Sequence[int], seed: str = DEFAULT_SEED) -> bytes:
    """The 32-byte digest of one page given its parent page's digest (None: the first page)."""
    payload = (parent or none_hash(seed), tuple(tokens), None)
    return hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()


def external(digest: bytes) -> int:
    """The 64-bit hash an event carries (vLLM's int block hash)."""
    return int.from_bytes(digest, "big") & _MASK


def chain(parent: bytes | None, tokens: Sequence[int], page_size: int,
          seed: str = DEFAULT_SEED) -> Iterable[bytes]:
    """The digests of the whole pages of `tokens`, chained from `parent`."""
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        parent = page_digest(parent, tokens[start : start + page_size], seed)
        yield parent


def block_hashes(token_ids: Sequence[int], page_size: int, seed: str = DEFAULT_SEED) -> list[int]:
    """The event hashes of every whole page of a token sequence, in order (what a subscriber matches
    a prompt's prefix against)."""
    return [external(digest) for digest in chain(None, list(token_ids), page_size, seed)]


def cache_hashes(radix: Any, page_size: int, seed: str = DEFAULT_SEED) -> set[int]:
    """The event hashes of every page a `resources.radix_cache.RadixCache` holds, recomputed from its
    token ids: what a subscriber that missed nothing holds (tests and debugging)."""
    digests: dict[int, bytes] = {}
    for parent_page, tokens, pages in radix.walk():
        parent = None if parent_page is None else digests[parent_page]
        for page, digest in zip(pages.tolist(), chain(parent, tokens, page_size, seed)):
            digests[page] = digest
    return {external(digest) for digest in digests.values()}
