"""Shape and vocabulary of a Llama-family decoder: what the model, the loader
and the engine's admission checks all read.

`ModelConfig.tiny()` and `ModelConfig.tiny_moe()` describe the embedded
default model (byte-level vocabulary, random weights);
`engine.model.hf_config.read_hf_config` reads a Hugging Face ``config.json``
of a supported family and `to_hf_config` writes one back. kvlife-only fields (image token, vision
projector, the tiny MoE's sizes) travel in the ``"kvlife"`` key of that dict,
which Hugging Face loaders ignore.
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

#: RoPE scalings the model implements (`engine.model.rope`).
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")

#: Activations of the gated MLP: SiLU (SwiGLU) and tanh-approximated GELU (Gemma's GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

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
    """A RoPE scaling as Hugging Face's ``rope_parameters`` describe it.

    - ``linear``: frequencies divided by `factor`.
    - ``dynamic``: NTK scaling that only acts past ``max_position_embeddings``
      (see `engine.model.rope`).
    - ``llama3``: needs `low_freq_factor`, `high_freq_factor` and
      `original_max_position_embeddings`.
    - ``yarn``: needs `original_max_position_embeddings`; `beta_fast`,
      `beta_slow`, `attention_factor`, `mscale`, `mscale_all_dim`, `truncate`
      as transformers reads them.
    """

    rope_type: str = attrs.field(validator=attrs.validators.in_(ROPE_TYPES))
    factor: float = attrs.field(validator=_positive)
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __attrs_post_init__(self) -> None:
        if not math.isfinite(self.factor):
            raise ValueError(f"rope scaling factor must be finite, got {self.factor}")
        needs = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "yarn": ("original_max_position_embeddings",)}.get(self.rope_type, ())
        for name in needs:
            if getattr(self, name) is None:
                raise ValueError(f"{self.rope_type} rope scaling needs {name}")
        if self.rope_type == "llama3":
            assert self.high_freq_factor is not None and self.low_freq_factor is not None
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict transformers and `read_hf_config` read."""
        return {name: value for name, value in attrs.asdict(self).items() if value is not None}


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Hyperparameters of a decoder-only Llama-family model.

    Attention: `attention_bias` adds biases to the q/k/v projections (Qwen2),
    `o_proj_bias` to the output projection (Llama/Qwen3/Gemma
    ``attention_bias``); `qk_norm` RMS-normalises each head's query and key
    before RoPE (Qwen3). `sliding_window` (None: full attention) limits each
    query to the last `sliding_window` positions, itself included, in the
    layers `sliding_window_layers` names (None: every layer); see
    `layer_windows`.

    FFN: `num_experts == 0` means a dense gated MLP of `intermediate_size` in
    every layer; otherwise every layer's FFN is a mixture of `num_experts`
    gated experts of width `moe_intermediate_size`, `num_experts_per_tok`
    routed per token, their weights renormalised when `norm_topk_prob`, kept
    in float32 when `router_weights_float32` (Mixtral) and else cast to the
    model's dtype (Qwen), plus a sigmoid-gated shared expert of width
    `shared_expert_intermediate_size` when that is > 0 (Qwen2-MoE).

    Gemma: `gemma_norm` (RMSNorm scales by ``1 + weight``, in float32) and
    `scale_embeddings` (embeddings times ``sqrt(hidden_size)``).
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
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = attrs.field(default="silu", validator=attrs.validators.in_(ACTIVATIONS))
    gemma_norm: bool = False
    scale_embeddings: bool = False
    max_position_embeddings: int = attrs.field(default=4096, validator=_positive)
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(DTYPES))
    num_experts: int = attrs.field(default=0, validator=_non_negative)
    num_experts_per_tok: int = attrs.field(default=0, validator=_non_negative)
    moe_intermediate_size: int = attrs.field(default=0, validator=_non_negative)
    norm_topk_prob: bool = True
    router_weights_float32: bool = False
    shared_expert_intermediate_size: int = attrs.field(default=0, validator=_non_negative)
    vision: VisionConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    image_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size must be > 0 when num_experts > 0")
        elif self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_intermediate_size needs num_experts > 0")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be None or > 0, got {self.sliding_window}")
        for layer in self.sliding_window_layers or ():
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"sliding_window_layers must be in [0, num_layers={self.num_layers}), got {layer}")
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
        """EOS and every extra end-of-sequence id, in that order, each once."""
        ids = (() if self.eos_token_id is None else (self.eos_token_id,)) + self.extra_eos_token_ids
        return tuple(dict.fromkeys(ids))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window (None: full causal attention)."""
        layers = range(self.num_layers) if self.sliding_window_layers is None else self.sliding_window_layers
        windowed = set(layers) if self.sliding_window is not None else set()
        return tuple(self.sliding_window if i in windowed else None for i in range(self.num_layers))

    @property
    def has_sliding_window(self) -> bool:
        return any(window is not None for window in self.layer_windows)

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

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that `engine.model.hf_config.read_hf_config` reads back unchanged;
        dense models are written as ``llama``, ``qwen2`` (q/k/v biases) or
        ``qwen3`` (q/k norm), so Hugging Face loaders read them too; MoE
        models as kvlife's own ``kvlife_moe``."""
        if self.gemma_norm or self.scale_embeddings or self.hidden_act != "silu" or self.mlp_bias or (
            self.sliding_window is not None
        ):
            raise ValueError("to_hf_config writes llama, qwen2, qwen3 and kvlife_moe configs, without windows")
        if self.is_moe:
            model_type, arch = "kvlife_moe", "KvlifeMoeForCausalLM"
        elif self.qk_norm:
            model_type, arch = "qwen3", "Qwen3ForCausalLM"
        elif self.attention_bias:
            model_type, arch = "qwen2", "Qwen2ForCausalLM"
        else:
            model_type, arch = "llama", "LlamaForCausalLM"
        if (model_type == "qwen2" and self.o_proj_bias) or (
            model_type in ("llama", "qwen3") and self.attention_bias != self.o_proj_bias
        ):
            raise ValueError(f"{model_type} cannot express attention_bias={self.attention_bias}, "
                             f"o_proj_bias={self.o_proj_bias}")
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
            "attention_bias": self.o_proj_bias,
            "mlp_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.stop_token_ids) if self.extra_eos_token_ids else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = self.rope_scaling.to_hf()
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
                attention_bias=self.attention_bias,
                qk_norm=self.qk_norm,
                norm_topk_prob=self.norm_topk_prob,
                router_weights_float32=self.router_weights_float32,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        if extras:
            hf["kvlife"] = extras
        return hf
