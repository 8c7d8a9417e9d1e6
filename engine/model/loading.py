"""Which model an `EngineConfig` names, and loading it: the built-in seeded
models ("tiny", "tiny-moe", and "null", the tiny model's shapes for the
no-compute runner) or a local checkpoint directory.

``EngineConfig.dtype="auto"`` (the default) means float32 for the built-in
models and the checkpoint's own ``torch_dtype`` for a directory. The returned
`ModelConfig.dtype` is always the dtype the weights were loaded in, which is
what the KV buffers follow unless ``EngineConfig.kv_cache_dtype`` names
another (`kv_cache_dtype`). The model comes back packed in
``EngineConfig.weight_layout`` (`LlamaModel.pack`).
"""

from __future__ import annotations

import attrs
import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfig
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.llama import LlamaModel, SelfAttention
from engine.model.model_config import ModelConfig
from engine.model.native_kernels import NativeKernels, kernels_for
from engine.model.tokenizer import ByteTokenizer, Tokenizer

BUILTIN_MODELS = {"tiny": ModelConfig.tiny, "tiny-moe": ModelConfig.tiny_moe, "null": ModelConfig.tiny}


def kv_cache_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    """The dtype the KV buffers store: ``config.kv_cache_dtype``, or the model's for "auto"."""
    return model_config.torch_dtype if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)


def load_model(config: EngineConfig, device: torch.device) -> tuple[ModelConfig, LlamaModel, Tokenizer]:
    """(model config, model, tokenizer) for `config.model`; a checkpoint that
    cannot be loaded raises `CheckpointError` (an `InvalidConfig`) naming why."""
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    bundle: tuple[ModelConfig, LlamaModel, Tokenizer]
    if config.model in BUILTIN_MODELS:
        model_config = BUILTIN_MODELS[config.model]()
        model_config = attrs.evolve(model_config, dtype="float32" if dtype is None else config.dtype)
        model = LlamaModel.from_seed(model_config, config.seed, device=device)
        bundle = model_config, model, ByteTokenizer.for_config(model_config)
    else:
        from engine.model.checkpoint import load_checkpoint

        model, model_config, tokenizer = load_checkpoint(config.model, device=device, dtype=dtype)
        bundle = model_config, model, tokenizer
    model = bundle[1]
    try:
        model.pack(config.weight_layout)
    except ValueError as exc:  # "onednn" for a dtype it does not cover
        raise InvalidConfig("EngineConfig.weight_layout", f"'auto' or 'packed' for this model ({exc})",
                            config.weight_layout) from exc
    try:
        model.use_verified_head(config.greedy_head)
    except ValueError as exc:  # "verified" where it does not apply
        raise InvalidConfig("EngineConfig.greedy_head", f"'auto' or 'full' for this model ({exc})",
                            config.greedy_head) from exc
    install_native_kernels(model, kernels_for(config.native_kernels, device, model_config.torch_dtype))
    if config.hisparse is not None and model_config.has_sliding_window:
        raise InvalidConfig("EngineConfig.hisparse", "None for a model with sliding-window attention "
                            f"(sliding_window={model_config.sliding_window})", config.hisparse)
    return bundle


def install_native_kernels(model: LlamaModel, kernels: NativeKernels | None) -> None:
    """Hand kvlife's native kernels (`engine.model.native_kernels`) to `model`'s fused path: its
    RMSNorms (Llama's; Gemma's keep torch's ops), its attention layers' RoPE, its SwiGLU MLPs'
    activation and its verified greedy head's search (when it has one: call after
    `use_verified_head`). None takes them back. ValueError for a model that is not float32 on a CPU (the
    calls check layouts only)."""
    if kernels is not None and (model.dtype != torch.float32 or model.device.type != "cpu"):
        raise ValueError(f"the native kernels take a float32 model on a CPU, not {model.dtype} on {model.device}")
    if model.verified_head is not None:
        model.verified_head.native = kernels
    for module in model.modules():
        if isinstance(module, RMSNorm) and not module.gemma:
            module.native = kernels
        elif isinstance(module, (SelfAttention, GatedMLP)):
            module.native = kernels
