"""KV cache events: what enters and leaves kvlife's prefix cache, published over ZeroMQ in vLLM's
`EventBatch` wire format (vLLM 0.33.0), so KV-aware routers (llm-d's precise prefix scorer, NVIDIA
Dynamo's ZMQ relay, ...) can follow an instance's cache (docs/scaling.md).

    async with publishing(engine, KVEventsConfig(endpoint="tcp://127.0.0.1:5557")) as publisher:
        ...                                                  # `kvlife serve --kv-events-endpoint ...`
    view = KVEventSubscriber("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")

Needs the ``kv-events`` extra (pyzmq, msgspec, cbor2). Rooms: `settings` (KVEventsConfig),
`hashing` (the chained block hash, recomputable from token ids), `wire` (the msgspec structs),
`publisher` (the observer of the radix cache and the publishing thread), `subscriber` (a reference
subscriber with replay). Imported lazily: nothing here loads unless events are turned on.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVEventPublisher", "KVEventSubscriber", "KVEventsConfig", "block_hashes", "publishing"]

_WHERE = {"KVEventPublisher": "publisher", "publishing": "publisher", "KVEventSubscriber": "subscriber",
          "KVEventsConfig": "settings", "block_hashes": "hashing"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine.kv_events' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"engine.kv_events.{_WHERE[name]}"), name)
