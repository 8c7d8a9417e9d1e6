"""HiSparseConfig: how many tokens to attend, how many to keep on device, how
much host memory to back them with.

Validated at construction (each field on its own) and again against the
engine's config (`validate_against`, called by `EngineConfig`), raising
`engine.errors.InvalidConfig` naming the field and the limit.

NOTE: `engine.errors` is the one module of `engine` this package touches
(the engine's error type is part of its public contract); it is imported
lazily so `hisparse` never imports the engine package at import time.
"""

from __future__ import annotations

import math
from typing import Any

import attrs


def _fail(field: str, limit: str, value: Any) -> None:
    from engine.errors import InvalidConfig

    raise InvalidConfig(field, limit, value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(low: int):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (_is_int(value) and value >= low):
            _fail(f"HiSparseConfig.{attribute.name}", f"an integer >= {low}", value)

    return check


@attrs.frozen
class HiSparseConfig:
    """Hierarchical sparse attention for decoding.

    - `top_k`: context tokens each decode step attends per layer (the recent
      window included), plus the new token itself.
    - `device_buffer_size`: device KV slots per request (>= top_k); one more
      slot is reserved for the newest token.
    - `host_pool_tokens`: host KV capacity in tokens; when None it is
      `host_pool_ratio` times the device KV pool's tokens.
    - `index_dim`: size of the per-token index key (per layer, on device)
      used to score tokens; at least the model's ``num_kv_heads * head_dim``
      makes scoring exact.
    - `recent_window`: the last tokens before the new one, always selected
      (counted within top_k); default min(16, top_k).
    """

    top_k: int = attrs.field(default=256, validator=_int_at_least(1))
    device_buffer_size: int = attrs.field(default=512, validator=_int_at_least(1))
    host_pool_tokens: int | None = attrs.field(default=None)
    host_pool_ratio: float = attrs.field(default=4.0)
    index_dim: int = attrs.field(default=16, validator=_int_at_least(1))
    recent_window: int = attrs.field(  # the factory runs before validators: top_k may be anything here
        default=attrs.Factory(lambda self: min(16, self.top_k) if _is_int(self.top_k) else 0, takes_self=True),
        validator=_int_at_least(0))

    def __attrs_post_init__(self) -> None:
        p = "HiSparseConfig"
        if self.device_buffer_size < self.top_k:
            _fail(f"{p}.device_buffer_size", f">= top_k = {self.top_k}", self.device_buffer_size)
        if self.recent_window > self.top_k:
            _fail(f"{p}.recent_window", f"<= top_k = {self.top_k}", self.recent_window)
        if self.host_pool_tokens is not None and not (_is_int(self.host_pool_tokens) and self.host_pool_tokens >= 1):
            _fail(f"{p}.host_pool_tokens", "None or an integer >= 1", self.host_pool_tokens)
        ratio = self.host_pool_ratio
        if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio)
                and ratio > 0):
            _fail(f"{p}.host_pool_ratio", "a finite number > 0", ratio)

    # ------------------------------------------------------- engine checks
    def host_tokens(self, engine_config: Any) -> int:
        """Host pool capacity in tokens, whole pages (rounded up)."""
        tokens = self.host_pool_tokens
        if tokens is None:
            tokens = int(self.host_pool_ratio * engine_config.pool_tokens)
        page = engine_config.page_size
        return -(-tokens // page) * page

    def validate_against(self, engine_config: Any) -> None:
        """Raise InvalidConfig if this config cannot serve `engine_config`."""
        p = "HiSparseConfig"
        if self.device_buffer_size > engine_config.max_context:
            _fail(f"{p}.device_buffer_size", f"<= EngineConfig.max_context = {engine_config.max_context}",
                  self.device_buffer_size)
        need = -(-engine_config.max_context // engine_config.page_size) * engine_config.page_size
        have = self.host_tokens(engine_config)
        if have < need:
            field = "host_pool_tokens" if self.host_pool_tokens is not None else "host_pool_ratio"
            value = self.host_pool_tokens if self.host_pool_tokens is not None else self.host_pool_ratio
            _fail(f"{p}.{field}", f"large enough for one max_context request ({need} tokens, got {have})",
                  value)
