"""Reading a Hugging Face ``config.json`` into a `ModelConfig`, family by
family, as transformers reads it; and `CheckpointError`, which names the
field (or tensor, or file) that stops a checkpoint from loading.

Families (``model_type``): llama, mistral, qwen2, qwen3, gemma, mixtral,
qwen2_moe, qwen3_moe, and kvlife's own kvlife_moe (the tiny MoE). Anything a
family's config asks for that the model does not implement is refused here,
before a tensor is read, with the field's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.errors import InvalidConfig
from engine.model.model_config import DTYPES, ROPE_TYPES, ModelConfig, RopeScaling, VisionConfig


class CheckpointError(InvalidConfig):
    """A checkpoint cannot be loaded: a file is missing or unreadable, a
    tensor is missing, unexpected or of the wrong shape, or config.json asks
    for a family or option kvlife does not support. `field` names it (a
    config.json field, a tensor, a file); the message says what is wrong.

    An `InvalidConfig`, so the CLI and callers treat it as a bad
    configuration (exit code 2, one line)."""

    def __init__(self, field: str, problem: str, value: Any = None) -> None:
        ValueError.__init__(self, f"{field}: {problem}")
        self.field = field
        self.limit = problem
        self.value = value


Fields = dict[str, Any]


def read_hf_config(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """`ModelConfig` of ``config.json`` `hf`; stop ids from
    ``generation_config.json`` `generation` when it names any (as
    transformers' ``generate`` uses them), else from config.json."""
    model_type = hf.get("model_type", "llama")
    family = _FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError("config.json model_type", f"{model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(_FAMILIES))})", model_type)
    defaults = _DEFAULTS.get(model_type, {})
    fields = _common(hf, defaults)
    fields.update(family(hf))
    fields.update(_special_ids(hf, generation))
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise CheckpointError("config.json", str(exc)) from None


def _require(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise CheckpointError(f"config.json {key}", "missing")
    return hf[key]


def _refuse(field: str, value: Any, supported: str) -> CheckpointError:
    return CheckpointError(f"config.json {field}", f"{value!r} is not supported ({supported})", value)


def _common(hf: dict[str, Any], defaults: dict[str, Any]) -> Fields:
    num_heads = _require(hf, "num_attention_heads")
    hidden_size = _require(hf, "hidden_size")
    expected_act = defaults.get("hidden_act", "silu")
    act = hf.get("hidden_act") or expected_act
    if act == "gelu" and expected_act == "gelu_pytorch_tanh":
        act = expected_act  # Gemma's legacy spelling, read as transformers reads it
    if act != expected_act:
        raise _refuse("hidden_act", act, f"this family runs {expected_act!r}")
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype not in DTYPES:
        raise _refuse("torch_dtype", dtype, f"supported: {', '.join(DTYPES)}")
    max_positions = hf.get("max_position_embeddings") or defaults.get("max_position_embeddings", 4096)
    theta, scaling = _rope(hf, max_positions, defaults.get("rope_theta", 10000.0))
    return dict(
        vocab_size=_require(hf, "vocab_size"),
        hidden_size=hidden_size,
        num_layers=_require(hf, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden_size // num_heads,
        intermediate_size=_require(hf, "intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=hf.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False)),
        hidden_act=act,
        max_position_embeddings=max_positions,
        dtype=dtype,
    )


def _rope(hf: dict[str, Any], max_positions: int, default_theta: float) -> tuple[float, RopeScaling | None]:
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params: dict[str, Any] = hf.get(key) or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise _refuse(key, sorted(params), "per-layer-type RoPE parameters are not supported")
    theta = params.get("rope_theta") or hf.get("rope_theta") or default_theta
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "only 1.0: RoPE over the whole head")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise _refuse(f"{key}.rope_type", rope_type, f"supported: default, {', '.join(ROPE_TYPES)}")
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        original = max_positions  # as transformers' standardize_rope_params does
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        assert original is not None  # set just above for yarn
        factor = max_positions / original
    if factor is None:
        raise CheckpointError(f"config.json {key}.factor", f"missing: {rope_type} RoPE scaling needs a factor", params)
    optional = {name: params[name] for name in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale",
                                                "mscale_all_dim", "truncate") if params.get(name) is not None}
    for name in ("beta_fast", "beta_slow"):
        if params.get(name):  # transformers reads 0 / None as the default
            optional[name] = params[name]
    try:
        return theta, RopeScaling(rope_type=rope_type, factor=factor, original_max_position_embeddings=original,
                                  **optional)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json {key}", str(exc), params) from None


def _special_ids(hf: dict[str, Any], generation: dict[str, Any] | None) -> Fields:
    eos = (generation or {}).get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    pad = hf.get("pad_token_id")
    extras = hf.get("kvlife", {})
    return dict(
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos_ids[0] if eos_ids else None,
        extra_eos_token_ids=eos_ids[1:],
        pad_token_id=pad if pad is not None else (eos_ids[0] if eos_ids else None),
        image_token_id=extras.get("image_token_id"),
    )


# ------------------------------------------------------------------ windows
def _layer_types(hf: dict[str, Any], default: Callable[[int], bool]) -> tuple[int, ...]:
    """Indices of the sliding layers: config.json's ``layer_types`` when it has
    them, else `default(layer)`."""
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        return tuple(i for i in range(num_layers) if default(i))
    if len(types) != num_layers:
        raise _refuse("layer_types", types, f"one entry per layer ({num_layers})")
    for i, kind in enumerate(types):
        if kind not in ("full_attention", "sliding_attention"):
            raise _refuse(f"layer_types[{i}]", kind, "full_attention or sliding_attention")
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _qwen_window(hf: dict[str, Any], default: Callable[[int], bool] | None) -> Fields:
    """Qwen families: a window only when ``use_sliding_window``; `default` picks
    the sliding layers when config.json has no ``layer_types`` (None: all)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if not window:
        return {}
    layers = None if default is None else _layer_types(hf, default)
    return dict(sliding_window=window, sliding_window_layers=layers)


def _mistral_window(hf: dict[str, Any], default: int | None) -> Fields:
    """Mistral/Mixtral: ``sliding_window`` (when not null) in every layer."""
    window = hf.get("sliding_window", default)
    return dict(sliding_window=window) if window else {}


# ---------------------------------------------------------------------- moe
def _moe(hf: dict[str, Any], *, experts_key: str, width_key: str, norm_topk_default: bool) -> Fields:
    for key, trivial in (("mlp_only_layers", []), ("decoder_sparse_step", 1)):
        if hf.get(key, trivial) not in (trivial, None):
            raise _refuse(key, hf[key], "only MoE in every layer: mlp_only_layers [] and decoder_sparse_step 1")
    num_experts = hf.get(experts_key) or hf.get("num_experts") or hf.get("num_local_experts")
    if not num_experts:
        raise CheckpointError(f"config.json {experts_key}", "missing")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=_require(hf, "num_experts_per_tok"),
        moe_intermediate_size=_require(hf, width_key),
        norm_topk_prob=hf.get("norm_topk_prob", norm_topk_default),
    )


# ----------------------------------------------------------------- families
def _llama(hf: dict[str, Any]) -> Fields:
    """Llama's ``attention_bias`` biases q, k, v and o (so do Qwen3's and Gemma's)."""
    bias = bool(hf.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def _mistral(hf: dict[str, Any]) -> Fields:
    return _mistral_window(hf, default=4096)


def _qwen2_window(hf: dict[str, Any]) -> Fields:
    max_window_layers = hf.get("max_window_layers", 28)
    return _qwen_window(hf, lambda i: i >= max_window_layers)


def _qwen2(hf: dict[str, Any]) -> Fields:
    return dict(attention_bias=True, **_qwen2_window(hf))


def _qwen3(hf: dict[str, Any]) -> Fields:
    return dict(_llama(hf), mlp_bias=False, qk_norm=True, **_qwen2_window(hf))


def _gemma(hf: dict[str, Any]) -> Fields:
    if hf.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", True, "causal attention only")
    return dict(_llama(hf), mlp_bias=False, gemma_norm=True, scale_embeddings=True)


def _mixtral(hf: dict[str, Any]) -> Fields:
    return dict(_moe(hf, experts_key="num_local_experts", width_key="intermediate_size", norm_topk_default=True),
                norm_topk_prob=True, router_weights_float32=True, **_mistral_window(hf, default=None))


def _qwen2_moe(hf: dict[str, Any]) -> Fields:
    max_window_layers = hf.get("max_window_layers", 28)
    return dict(
        _moe(hf, experts_key="num_experts", width_key="moe_intermediate_size", norm_topk_default=False),
        attention_bias=bool(hf.get("qkv_bias", True)),
        shared_expert_intermediate_size=_require(hf, "shared_expert_intermediate_size"),
        **_qwen_window(hf, lambda i: bool((i + 1) % 2) and i < max_window_layers),
    )


def _qwen3_moe(hf: dict[str, Any]) -> Fields:
    return dict(
        _moe(hf, experts_key="num_experts", width_key="moe_intermediate_size", norm_topk_default=False),
        **_llama(hf),
        qk_norm=True,
        **_qwen_window(hf, None),
    ) | {"mlp_bias": False}


def _kvlife_moe(hf: dict[str, Any]) -> Fields:
    """The tiny MoE as `ModelConfig.to_hf_config` writes it: sizes in extras."""
    extras = hf.get("kvlife", {})
    keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "attention_bias", "qk_norm",
            "norm_topk_prob", "router_weights_float32", "shared_expert_intermediate_size")
    return dict(_llama(hf), **{key: extras[key] for key in keys if key in extras})


def _with_vision(reader: Callable[[dict[str, Any]], Fields]) -> Callable[[dict[str, Any]], Fields]:
    """kvlife checkpoints of the tiny model carry its vision projector in extras."""

    def read(hf: dict[str, Any]) -> Fields:
        fields = reader(hf)
        vision = hf.get("kvlife", {}).get("vision")
        if vision:
            fields["vision"] = VisionConfig(**vision)
        return fields

    return read


_FAMILIES: dict[str, Callable[[dict[str, Any]], Fields]] = {
    "llama": _with_vision(_llama),
    "mistral": _mistral,
    "qwen2": _with_vision(_qwen2),
    "qwen3": _with_vision(_qwen3),
    "gemma": _gemma,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "kvlife_moe": _with_vision(_kvlife_moe),
}

#: transformers' config defaults where they differ from kvlife's, for keys a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "mistral": {"rms_norm_eps": 1e-6},
}
