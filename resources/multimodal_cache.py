"""The multimodal embedding cache and the hook that references it.

The embedding cache holds vision-projector outputs keyed by content hash,
under a byte budget. The `multimodal` hook takes one reference per image of
the request from admission to RELEASED (kept through RETRACTED, so a
re-prefill reuses the embeddings) and drops them at release. Unreferenced
entries stay cached and are evicted least-recently-used when a new entry
needs room: that eviction, not a release, is how unowned memory leaves.

Accounting (pool ``mm_embeddings``, in bytes): free = budget - bytes cached;
evictable = bytes of unreferenced entries; shared = bytes of referenced ones.
The ledger lists each request holding references, so a leak names its owner.
The model side (placeholder expansion, embedding substitution) lives in
`engine.model.vision`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable

import attrs
import torch

from resources.contract import ResourceExhausted, ResourceHook
from resources.ledger import PoolUsage
from states import HELD_STATES, Handle, Request, RequestState

S = RequestState
MM_POOL = "mm_embeddings"


def image_key(image: torch.Tensor) -> str:
    data = image.detach().contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(repr(tuple(image.shape)).encode() + data).hexdigest()


@attrs.define
class _Entry:
    embedding: torch.Tensor
    nbytes: int
    refs: int = 0
    last_used: int = 0


class MultimodalCache:
    """Projector outputs by content hash, reference-counted, under a byte budget."""

    name = MM_POOL

    def __init__(self, budget_bytes: int) -> None:
        self.capacity = budget_bytes
        self.entries: dict[str, _Entry] = {}
        self.used_bytes = 0
        self._tick = itertools.count(1)

    def reference(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A referenced embedding for `key`, computing and caching it on a miss."""
        entry = self.entries.get(key)
        if entry is None:
            embedding = compute()
            nbytes = embedding.numel() * embedding.element_size()
            self._make_room(nbytes)
            entry = self.entries[key] = _Entry(embedding, nbytes)
            self.used_bytes += nbytes
        entry.refs += 1
        entry.last_used = next(self._tick)
        return entry.embedding

    def unreference(self, key: str) -> None:
        entry = self.entries[key]
        if entry.refs <= 0:
            raise ValueError(f"embedding {key[:12]} unreferenced more often than referenced")
        entry.refs -= 1

    def _make_room(self, nbytes: int) -> None:
        if self.used_bytes + nbytes <= self.capacity:
            return
        for key, entry in sorted(self.entries.items(), key=lambda kv: kv[1].last_used):
            if entry.refs == 0:
                del self.entries[key]
                self.used_bytes -= entry.nbytes
                if self.used_bytes + nbytes <= self.capacity:
                    return
        raise ResourceExhausted(f"multimodal cache: {nbytes} bytes needed, {self.capacity - self.used_bytes} free")

    def stats(self) -> PoolUsage:
        referenced = sum(e.nbytes for e in self.entries.values() if e.refs > 0)
        evictable = sum(e.nbytes for e in self.entries.values() if e.refs == 0)
        # NOTE: referenced + evictable is recomputed from the entries, free from the running
        # counter: the two only add up to the budget if every insert/evict was counted.
        return PoolUsage(capacity=self.capacity, free=self.capacity - self.used_bytes, evictable=evictable,
                         shared=referenced, unit="bytes")


class MultimodalHook(ResourceHook):
    name = "multimodal"
    acquire_on = frozenset({S.PREFILLING})
    scope = HELD_STATES
    pool = MM_POOL

    def __init__(self, cache: MultimodalCache, project: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.cache = cache
        self._project = project

    def acquire(self, request: Request, into: RequestState) -> Handle[tuple[list[str], torch.Tensor]] | None:
        if not request.mm_inputs:
            return None
        keys, embeddings = [], []
        try:
            for image in request.mm_inputs:
                key = image_key(image)
                embeddings.append(self.cache.reference(key, functools.partial(self._project, image)))
                keys.append(key)
        except BaseException:
            for key in keys:
                self.cache.unreference(key)
            raise
        # NOTE: amount 0: the bytes are the cache's (shared between requests with the same
        # image); the ledger entry names the request as a holder of references.
        return Handle(self.name, request.request_id, (keys, torch.cat(embeddings)), amount=0)

    def release(self, request: Request, handle: Handle[tuple[list[str], torch.Tensor]]) -> None:
        keys, _ = handle.payload
        for key in keys:
            self.cache.unreference(key)

    def embeddings(self, request: Request) -> torch.Tensor | None:
        """The request's image embeddings, all images' patches in order; None without images."""
        handle = request.handles.get(self.name)
        return None if handle is None else handle.payload[1]
