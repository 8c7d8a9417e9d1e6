"""Which model an `EngineConfig` names, and loading it: the built-in seeded
models ("tiny", "tiny-moe", and "null", the tiny model's shapes for the
no-compute runner) or a local checkpoint directory."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfig
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.tokenizer import ByteTokenizer

BUILTIN_MODELS = {"tiny": ModelConfig.tiny, "tiny-moe": ModelConfig.tiny_moe, "null": ModelConfig.tiny}


def load_model(config: EngineConfig, device: torch.device):
    """(model config, model, tokenizer) for `config.model`."""
    dtype = getattr(torch, config.dtype)
    if config.model in BUILTIN_MODELS:
        model_config = BUILTIN_MODELS[config.model]()
        model = LlamaModel.from_seed(model_config, config.seed, device=device, dtype=dtype)
        return model_config, model, ByteTokenizer.for_config(model_config)
    from engine.model.checkpoint import CheckpointError, load_checkpoint

    try:
        model, model_config, tokenizer = load_checkpoint(config.model, device=device, dtype=dtype)
    except CheckpointError as exc:
        raise InvalidConfig("EngineConfig.model", "'tiny', 'tiny-moe', 'null' or a checkpoint directory",
                            config.model) from exc
    return model_config, model, tokenizer
