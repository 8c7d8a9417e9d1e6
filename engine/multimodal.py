"""Multimodal inputs: image validation, the embedding cache and its hook.

Images are uint8 ``[H, W, 3]`` tensors. A prompt's image placeholder tokens
(the tokenizer's `image_token_id`) are expanded so each image gets one
placeholder per patch; a prompt without placeholders gets them prepended.

The embedding cache holds projector outputs keyed by content hash, under a
byte budget. The `multimodal` hook takes one reference per image of the
request from admission to RELEASED (kept through RETRACTED, so a re-prefill
reuses the embeddings) and drops them at release. Unreferenced entries stay
cached and are evicted least-recently-used when a new entry needs room.

Accounting (pool ``mm_embeddings``, in bytes): free = budget - bytes cached;
evictable = bytes of unreferenced entries; held = bytes of referenced ones.
The ledger counts each request's references, so a leak names its owner.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from engine.errors import InvalidRequest
from resources import Ledger, Owner, PoolStats, ResourceExhausted, ResourceHook
from states import HELD_STATES, Handle, Request, RequestState

S = RequestState
MM_POOL = "mm_embeddings"


def prepare_images(model: Any, image_token_id: int | None, token_ids: list[int],
                   images: Sequence[Any]) -> list[int]:
    """Validate `images` and return the prompt with one placeholder per patch."""
    if image_token_id is None or getattr(model, "vision_projector", None) is None:
        raise InvalidRequest("mm_inputs", "empty: this model takes no images", list(images))
    vision = model.config.vision
    limit = (f"a uint8 [H, W, 3] torch tensor with H and W positive multiples of {vision.patch_size}"
             f" up to {vision.max_image_size}")
    counts = []
    for i, image in enumerate(images):
        if not isinstance(image, torch.Tensor):
            raise InvalidRequest(f"mm_inputs[{i}]", limit, type(image).__name__)
        try:
            counts.append(model.num_image_tokens(image))
        except ValueError:
            raise InvalidRequest(f"mm_inputs[{i}]", limit, f"{image.dtype} {list(image.shape)}") from None
    marks = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if not marks:
        return [image_token_id] * sum(counts) + token_ids
    if len(marks) != len(images):
        raise InvalidRequest("prompt", f"one image placeholder per image ({len(images)})", len(marks))
    out: list[int] = []
    images_iter = iter(counts)
    for t in token_ids:
        out.extend([image_token_id] * next(images_iter) if t == image_token_id else [t])
    return out


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

    def __init__(self, budget_bytes: int, ledger: Ledger) -> None:
        self.capacity = budget_bytes
        self.ledger = ledger
        self.entries: dict[str, _Entry] = {}
        self.used_bytes = 0
        self._tick = itertools.count(1)

    def reference(self, key: str, compute) -> torch.Tensor:
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

    def stats(self) -> PoolStats:
        held = sum(e.nbytes for e in self.entries.values() if e.refs > 0)
        evictable = sum(e.nbytes for e in self.entries.values() if e.refs == 0)
        # NOTE: held + evictable is recomputed from the entries, free from the running
        # counter: the two only add up to the budget if every insert/evict was counted.
        return PoolStats(capacity=self.capacity, free=self.capacity - self.used_bytes, evictable=evictable,
                         held=held, quarantined=0, suspect=MM_POOL in self.ledger.suspect, unit="bytes")

    def owners(self) -> list[Owner]:
        return self.ledger.owners(MM_POOL)


class MultimodalHook(ResourceHook):
    name = "multimodal"
    acquire_on = frozenset({S.PREFILLING})
    scope = HELD_STATES
    pool = MM_POOL

    def __init__(self, cache: MultimodalCache, model: Any) -> None:
        super().__init__()
        self.cache = cache
        self.model = model

    def acquire(self, request: Request, into: RequestState) -> Handle | None:
        if not request.mm_inputs:
            return None
        keys, embeddings = [], []
        try:
            for image in request.mm_inputs:
                key = image_key(image)
                embeddings.append(self.cache.reference(key, lambda image=image: self._project(image)))
                keys.append(key)
        except BaseException:
            for key in keys:
                self.cache.unreference(key)
            raise
        self.cache.ledger.hold(MM_POOL, request, len(keys))
        return Handle(self.name, request.request_id, (keys, torch.cat(embeddings)), amount=len(keys))

    def release(self, request: Request, handle: Handle) -> None:
        keys, _ = handle.payload
        for key in keys:
            self.cache.unreference(key)
        self.cache.ledger.drop(MM_POOL, request.request_id)

    @torch.inference_mode()
    def _project(self, image: torch.Tensor) -> torch.Tensor:
        return self.model.vision_projector(image)


def make_embedder(model: Any, image_token_id: int, hook_name: str = "multimodal"):
    """The runner's `embedder`: token embeddings with image rows substituted, or
    None when no request in the batch has images (the common, fast path)."""

    def embed(seqs, ids: torch.Tensor) -> torch.Tensor | None:
        if not any(hook_name in s.request.handles for s in seqs):
            return None
        embeds = model.model.embed_tokens(ids)
        offset = 0
        for s in seqs:
            handle = s.request.handles.get(hook_name)
            if handle is not None and s.start < s.request.num_prompt_tokens:
                prompt = s.request.prompt_token_ids
                marks = [i for i, t in enumerate(prompt) if t == image_token_id]
                for row, pos in enumerate(marks):
                    if s.start <= pos < s.start + s.num_tokens:
                        embeds[offset + pos - s.start] = handle.payload[1][row].to(embeds.dtype)
            offset += s.num_tokens
        return embeds

    return embed
