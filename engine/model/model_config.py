"""Shape and vocabulary of a Llama-style decoder: what the model, the loader
and the engine's admission checks all read.

`ModelConfig.tiny()` and `ModelConfig.tiny_moe()` describe the embedded
default model (byte-level vocabulary, random weights); `from_hf_config` reads
a Llama/Qwen2-style ``config.json`` and `to_hf_config` writes one back.
kvlife-only fields (image token, vision projector, extra stop tokens) travel
in the ``"kvlife"`` key of that dict, which Hugging Face loaders ignore.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

#: dtype names accepted in `ModelConfig.dtype`, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

#: ``model_type`` values whose weights `engine.model.checkpoint` knows how to load.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "kvlife_moe"})

#: Byte-level vocabulary of the tiny model: 256 bytes, then the specials.
BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_IMAGE_ID = 256, 257, 258, 259
TINY_VOCAB_SIZE = 264  # 260 used ids rounded up to a multiple of 8


def _positive(instance: Any, attribute: attrs.Attribute, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen(kw_only=True)
class VisionConfig:
    """The tiny vision projector: square patches of an RGB uint8 image, each
    linearly projected to one embedding; images up to `max_image_size` pixels
    on a side, both sides multiples of `patch_size`."""

    patch_size: int = attrs.field(default=8, validator=_positive)
    max_image_size: int = attrs.field(default=64, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.max_image_size % self.patch_size:
            raise ValueError(
                f"max_image_size ({self.max_image_size}) must be a multiple of patch_size ({self.patch_size})"
            )

    @property
    def patch_dim(self) -> int:
        """Input features of one patch: patch_size * patch_size * 3 channels."""
        return self.patch_size * self.patch_size * 3


@attrs.frozen(kw_only=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float = attrs.field(validator=_positive)
    low_freq_factor: float = attrs.field(validator=_positive)
    high_freq_factor: float = attrs.field(validator=_positive)
    original_max_position_embeddings: int = attrs.field(validator=_positive)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Hyperparameters of a decoder-only Llama/Qwen2-style model.

    `num_experts == 0` means a dense SwiGLU MLP in every layer; otherwise every
    layer's FFN is a mixture of `num_experts` SwiGLU experts of width
    `moe_intermediate_size`, `num_experts_per_tok` routed per token.
    `attention_bias` adds biases to the q/k/v projections (Qwen2).
    """

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive)
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = attrs.field(default=1e-6, validator=_positive)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = attrs.field(default=4096, validator=_positive)
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(DTYPES))
    num_experts: int = attrs.field(default=0, validator=_non_negative)
    num_experts_per_tok: int = attrs.field(default=0, validator=_non_negative)
    moe_intermediate_size: int = attrs.field(default=0, validator=_non_negative)
    vision: VisionConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int = attrs.field(validator=_non_negative)
    pad_token_id: int = attrs.field(validator=_non_negative)
    image_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size must be > 0 when num_experts > 0")
        if self.vision is not None and self.image_token_id is None:
            raise ValueError("a model with a vision projector needs image_token_id")
        named_ids = {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            **{f"extra_eos_token_ids[{i}]": t for i, t in enumerate(self.extra_eos_token_ids)},
        }
        for name, token_id in named_ids.items():
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{name} must be in [0, vocab_size={self.vocab_size}), got {token_id}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS and every extra end-of-sequence id, in that order."""
        return (self.eos_token_id, *self.extra_eos_token_ids)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """The embedded default: byte vocabulary, 4 layers, GQA 4:2, with an
        8-pixel-patch vision projector for images up to 64x64."""
        fields: dict[str, Any] = dict(
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=1024,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            vision=VisionConfig(patch_size=8, max_image_size=64),
            bos_token_id=BYTE_BOS_ID,
            eos_token_id=BYTE_EOS_ID,
            pad_token_id=BYTE_PAD_ID,
            image_token_id=BYTE_IMAGE_ID,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def tiny_moe(cls, **overrides: Any) -> ModelConfig:
        """`tiny()` with an 8-expert, top-2 MoE FFN of width 256 in every layer."""
        fields: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
        fields.update(overrides)
        return cls.tiny(**fields)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Llama/Mistral/Qwen2 ``config.json`` (or one written by
        `to_hf_config`). Raises ValueError naming anything unsupported."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {sorted(SUPPORTED_MODEL_TYPES)})")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        if model_type != "qwen2" and hf.get("attention_bias"):
            raise ValueError("attention_bias=true (o_proj bias) is only supported for qwen2")
        extras: dict[str, Any] = hf.get("kvlife", {})
        rope_params: dict[str, Any] = hf.get("rope_parameters") or {}
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if eos_ids[0] is None:
            raise ValueError("config.json has no eos_token_id")
        pad = hf.get("pad_token_id")
        vision = extras.get("vision")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            rope_theta=hf.get("rope_theta") or rope_params.get("rope_theta", 10000.0),
            rope_scaling=_read_rope_scaling(hf.get("rope_scaling") or rope_params),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2",
            max_position_embeddings=_context_limit(hf, model_type),
            dtype=_read_dtype(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            num_experts=extras.get("num_experts", 0),
            num_experts_per_tok=extras.get("num_experts_per_tok", 0),
            moe_intermediate_size=extras.get("moe_intermediate_size", 0),
            vision=VisionConfig(**vision) if vision else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids[0],
            pad_token_id=eos_ids[0] if pad is None else pad,
            image_token_id=extras.get("image_token_id"),
            extra_eos_token_ids=eos_ids[1:],
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that `from_hf_config` reads back unchanged;
        dense models are written as ``llama`` (or ``qwen2`` with q/k/v biases)
        so Hugging Face loaders read them too."""
        if self.is_moe:
            model_type, arch = "kvlife_moe", "KvlifeMoeForCausalLM"
        elif self.attention_bias:
            model_type, arch = "qwen2", "Qwen2ForCausalLM"
        else:
            model_type, arch = "llama", "LlamaForCausalLM"
        hf: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.stop_token_ids) if self.extra_eos_token_ids else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **attrs.asdict(self.rope_scaling)}
        extras: dict[str, Any] = {}
        if self.image_token_id is not None:
            extras["image_token_id"] = self.image_token_id
        if self.vision is not None:
            extras["vision"] = attrs.asdict(self.vision)
        if self.is_moe:
            extras.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
            )
        if extras:
            hf["kvlife"] = extras
        return hf


def _context_limit(hf: dict[str, Any], model_type: str) -> int:
    """max_position_embeddings, capped at the sliding window when one is in
    force: attention here is always full, which equals sliding-window
    attention only while the context fits in the window."""
    limit = hf.get("max_position_embeddings", 4096)
    window = hf.get("sliding_window")
    window_in_force = hf.get("use_sliding_window", model_type == "mistral")
    if window and window_in_force:
        limit = min(limit, window)
    return limit


def _read_dtype(name: str) -> str:
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (supported: {sorted(DTYPES)})")
    return name


def _read_rope_scaling(spec: dict[str, Any]) -> RopeScaling | None:
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (only 'llama3')")
    scaling = RopeScaling(
        factor=spec["factor"],
        low_freq_factor=spec["low_freq_factor"],
        high_freq_factor=spec["high_freq_factor"],
        original_max_position_embeddings=spec["original_max_position_embeddings"],
    )
    if not math.isfinite(scaling.factor) or scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return scaling
