"""The messages on the wire: vLLM 0.33.0's ``vllm/distributed/kv_events.py`` structs, field for field
(msgspec MessagePack; a batch kvlife encodes is byte-identical to vLLM's encoding of the same events).

An `EventBatch` is a positional array ``[ts, [events...], data_parallel_rank]``; each event is a
map tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with its fields
by name (vLLM switched events from arrays to maps in vllm-project/vllm#42892, before 0.26.0).
Defaults are omitted. Each ZeroMQ message is three frames ``[topic, seq (8 bytes, big-endian),
payload]``; a replay answer is ``[topic, seq, payload]`` per batch and ``[b"", -1 (8 bytes,
signed), b""]`` at the end.

kvlife sets, on `BlockStored`: ``block_hashes`` (the 64-bit hashes of the pages, engine.kv_events.
hashing), ``parent_block_hash`` (the page before them, null at the start of a sequence),
``token_ids`` (all the pages' tokens), ``block_size`` (the page size), ``lora_id`` and
``lora_name`` (null), ``medium``, ``group_idx`` 0 and ``kv_cache_spec_kind`` "full_attention".
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (the tag is the class name, under "type")."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    """The batch as a subscriber decodes it."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
