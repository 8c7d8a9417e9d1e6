"""Load and save Llama/Qwen2-style checkpoint directories.

A directory holds ``config.json`` (Hugging Face format, read by
`ModelConfig.from_hf_config`), one or more ``*.safetensors`` files whose
tensor names are Hugging Face's (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight`` ...; see `engine.model.llama`),
and optionally ``tokenizer.json``; without it the byte tokenizer is used,
which only fits models with a byte-level vocabulary.

Weights are loaded straight to the target device: the model is built on the
meta device and the loaded tensors are assigned into it, so a checkpoint is
never held twice in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch

from engine.model.model_config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"

#: Tensors some checkpoints carry that this model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or tensor, or a tensor has the
    wrong shape; the message names it."""


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[LlamaModel, ModelConfig, Tokenizer]:
    """The model (in eval mode, on `device`, cast to `dtype` or else the
    config's dtype), its config and its tokenizer, read from `path`."""
    from safetensors.torch import load_file

    directory = Path(path)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {CONFIG_FILE}")
    config = ModelConfig.from_hf_config(json.loads(config_path.read_text()))
    weight_files = sorted(directory.glob("*.safetensors"))
    if not weight_files:
        raise CheckpointError(f"checkpoint {directory} has no *.safetensors file")
    if dtype is not None:
        config = _with_dtype(config, dtype)
    target_dtype = config.torch_dtype

    with torch.device("meta"):
        model = LlamaModel(config)
    expected = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for weight_file in weight_files:
        for name, tensor in load_file(weight_file, device=str(device)).items():
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
                continue
            if name not in expected:
                raise CheckpointError(
                    f"{weight_file.name} has tensor {name!r}, which this model does not have "
                    f"(unsupported architecture variant?)"
                )
            if tensor.shape != expected[name].shape:
                raise CheckpointError(
                    f"tensor {name!r} in {weight_file.name} has shape {list(tensor.shape)}, "
                    f"config.json implies {list(expected[name].shape)}"
                )
            loaded[name] = tensor.to(target_dtype)
    missing = [name for name in expected if name not in loaded]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {directory} is missing tensor {shown}{more}")
    model.load_state_dict(loaded, strict=True, assign=True)
    model.eval()

    tokenizer_path = directory / TOKENIZER_FILE
    tokenizer: Tokenizer
    if tokenizer_path.is_file():
        tokenizer = HFTokenizer.from_file(tokenizer_path, config)
    else:
        tokenizer = ByteTokenizer.for_config(config)
    return model, config, tokenizer


def save_checkpoint(model: LlamaModel, config: ModelConfig, path: str | Path) -> Path:
    """Write `model` as ``config.json`` + ``model.safetensors`` under `path`
    (created if needed), in the format `load_checkpoint` and Hugging Face
    read. Returns the directory."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    hf_config = _with_dtype(config, dtype_name).to_hf_config()
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def _with_dtype(config: ModelConfig, dtype: torch.dtype | str) -> ModelConfig:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return attrs.evolve(config, dtype=name)
