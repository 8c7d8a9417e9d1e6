"""EngineConfig and SamplingParams: frozen, validated at construction.

Every validation error names the field and the limit (`InvalidConfig` for
the engine, `InvalidRequest` for a request's sampling parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from engine.errors import InvalidConfig, InvalidRequest



def _check(cls_error: type[InvalidRequest], prefix: str, name: str, value: Any, ok: bool, limit: str) -> None:
    if not ok:
        raise cls_error(f"{prefix}.{name}", limit, value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_at_least(low: int) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        error = InvalidRequest if isinstance(inst, SamplingParams) else InvalidConfig
        _check(error, type(inst).__name__, attribute.name, value, _int(value) and value >= low, f"an integer >= {low}")

    return check


def _one_of(*choices: Any) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        _check(InvalidConfig, type(inst).__name__, attribute.name, value, value in choices, f"one of {choices}")

    return check


def _tuple_if_sequence(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


@attrs.frozen
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy; `top_k=0` is off."""

    max_new_tokens: int = attrs.field(default=16, validator=_int_at_least(1))
    temperature: float = attrs.field(default=0.0)
    top_p: float = attrs.field(default=1.0)
    top_k: int = attrs.field(default=0, validator=_int_at_least(0))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(v) if isinstance(v, (list, tuple)) else v)
    ignore_eos: bool = attrs.field(default=False)
    seed: int | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        p = "SamplingParams"
        _check(InvalidRequest, p, "temperature", self.temperature,
               _number(self.temperature) and self.temperature >= 0, "a finite number >= 0")
        _check(InvalidRequest, p, "top_p", self.top_p,
               _number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]")
        _check(InvalidRequest, p, "stop_token_ids", self.stop_token_ids,
               isinstance(self.stop_token_ids, tuple) and all(_int(t) and t >= 0 for t in self.stop_token_ids),
               "a list of non-negative integers")
        _check(InvalidRequest, p, "ignore_eos", self.ignore_eos, isinstance(self.ignore_eos, bool), "a bool")
        _check(InvalidRequest, p, "seed", self.seed, self.seed is None or (_int(self.seed) and self.seed >= 0),
               "None or an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@attrs.frozen
class EngineConfig:
    """Everything an Engine needs. Defaults run the built-in tiny model on CPU."""

    model: str = attrs.field(default="tiny")
    device: str = attrs.field(default="cpu")
    dtype: str = attrs.field(default="float32", validator=_one_of("float32", "float16", "bfloat16"))
    seed: int = attrs.field(default=0, validator=_int_at_least(0))
    page_size: int = attrs.field(default=16, validator=_int_at_least(1))
    num_kv_pages: int = attrs.field(default=1024, validator=_int_at_least(2))
    max_running: int = attrs.field(default=64, validator=_int_at_least(1))
    max_context: int = attrs.field(default=2048, validator=_int_at_least(2))
    max_prefill_tokens: int = attrs.field(default=512, validator=_int_at_least(1))
    max_queued: int = attrs.field(default=4096, validator=_int_at_least(1))
    prefix_cache: bool = attrs.field(default=True)
    hisparse: Any = attrs.field(default=None)
    disaggregation: str = attrs.field(default="none", validator=_one_of("none", "decode"))
    #: decode role: prefill servers in other processes (an engine.disagg.RemotePrefill); None: in-process worker
    remote_prefill: Any = attrs.field(default=None)
    leak_check: str = attrs.field(default="raise", validator=_one_of("raise", "log", "off"))
    resources: tuple[Any, ...] = attrs.field(default=(), converter=_tuple_if_sequence)
    use_entry_points: bool = attrs.field(default=True)
    fence_timeout: float = attrs.field(default=30.0)
    mm_cache_bytes: int = attrs.field(default=64 << 20, validator=_int_at_least(1))

    def __attrs_post_init__(self) -> None:
        p = "EngineConfig"
        _check(InvalidConfig, p, "model", self.model, isinstance(self.model, str) and self.model != "",
               "'tiny', 'tiny-moe' or a checkpoint directory")
        _check(InvalidConfig, p, "device", self.device, isinstance(self.device, str) and self.device != "",
               "a torch device string such as 'cpu' or 'cuda'")
        _check(InvalidConfig, p, "fence_timeout", self.fence_timeout,
               _number(self.fence_timeout) and self.fence_timeout > 0, "a finite number > 0")
        _check(InvalidConfig, p, "max_context", self.max_context,
               self.max_context <= (self.num_kv_pages - 1) * self.page_size,
               f"<= (num_kv_pages - 1) * page_size = {(self.num_kv_pages - 1) * self.page_size}")
        _check(InvalidConfig, p, "seed", self.seed, self.seed < 2**63, "an integer < 2**63")
        for name in ("prefix_cache", "use_entry_points"):
            _check(InvalidConfig, p, name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool")
        _check(InvalidConfig, p, "resources", self.resources,
               isinstance(self.resources, tuple) and all(callable(r) or hasattr(r, "release") for r in self.resources),
               "a list of resource hooks or hook factories")
        from hisparse.config import HiSparseConfig  # lazy: hisparse sits below engine

        _check(InvalidConfig, p, "hisparse", self.hisparse,
               self.hisparse is None or isinstance(self.hisparse, HiSparseConfig), "None or a hisparse.HiSparseConfig")
        if self.hisparse is not None:
            self.hisparse.validate_against(self)
        from engine.disagg.settings import RemotePrefill  # lazy, like hisparse

        _check(InvalidConfig, p, "remote_prefill", self.remote_prefill,
               self.remote_prefill is None or isinstance(self.remote_prefill, RemotePrefill),
               "None or an engine.disagg.RemotePrefill")
        if self.remote_prefill is not None:
            self.remote_prefill.validate_against(self)

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool can hold (page 0 is reserved)."""
        return (self.num_kv_pages - 1) * self.page_size
