"""Small builders shared by the engine tests."""

from __future__ import annotations

from engine.config import EngineConfig


def small_config(**overrides) -> EngineConfig:
    """A fast engine: small pools, small pages, the built-in tiny model."""
    fields = dict(page_size=4, num_kv_pages=256, max_running=8, max_context=256, max_prefill_tokens=64,
                  use_entry_points=False)
    fields.update(overrides)
    return EngineConfig(**fields)


async def collect(stream) -> list:
    """Every output of a stream, in order."""
    return [output async for output in stream]
