"""HiSparseConfig: how many tokens to attend, how many to keep on device, how
much host memory to back them with.

Validated at construction (each field on its own) and again against the
engine's config (`validate_against`, called by `EngineConfig`), raising
`InvalidConfig` naming the field and the limit, with the validators every
config shares (`states.validation`).
"""

from __future__ import annotations

from typing import Any

import attrs

from resources.paging import round_up
from states.validation import InvalidConfig, int_at_least, is_int, number_above, optional_int_at_least, require


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

    top_k: int = attrs.field(default=256, validator=int_at_least(1))
    device_buffer_size: int = attrs.field(default=512, validator=int_at_least(1))
    host_pool_tokens: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    host_pool_ratio: float = attrs.field(default=4.0, validator=number_above(0))
    index_dim: int = attrs.field(default=16, validator=int_at_least(1))
    recent_window: int = attrs.field(  # the factory runs before validators: top_k may be anything here
        default=attrs.Factory(lambda self: min(16, self.top_k) if is_int(self.top_k) else 0, takes_self=True),
        validator=int_at_least(0))

    def __attrs_post_init__(self) -> None:
        p = "HiSparseConfig"
        require(self.device_buffer_size >= self.top_k, InvalidConfig, f"{p}.device_buffer_size",
                f">= top_k = {self.top_k}", self.device_buffer_size)
        require(self.recent_window <= self.top_k, InvalidConfig, f"{p}.recent_window", f"<= top_k = {self.top_k}",
                self.recent_window)

    # ------------------------------------------------------- engine checks
    def host_tokens(self, engine_config: Any) -> int:
        """Host pool capacity in tokens, whole pages (rounded up)."""
        tokens = self.host_pool_tokens
        if tokens is None:
            tokens = int(self.host_pool_ratio * engine_config.pool_tokens)
        return round_up(tokens, engine_config.page_size)

    def validate_against(self, engine_config: Any, max_context: int) -> None:
        """Raise InvalidConfig if this config cannot serve `engine_config` at `max_context`."""
        p = "HiSparseConfig"
        require(self.device_buffer_size <= max_context, InvalidConfig, f"{p}.device_buffer_size",
                f"<= EngineConfig.max_context = {max_context}", self.device_buffer_size)
        need = round_up(max_context, engine_config.page_size)
        have = self.host_tokens(engine_config)
        field = "host_pool_tokens" if self.host_pool_tokens is not None else "host_pool_ratio"
        value = self.host_pool_tokens if self.host_pool_tokens is not None else self.host_pool_ratio
        require(have >= need, InvalidConfig, f"{p}.{field}",
                f"large enough for one max_context request ({need} tokens, got {have})", value)
