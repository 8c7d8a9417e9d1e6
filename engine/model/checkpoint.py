"""Load and save Hugging Face-format checkpoint directories.

A directory holds ``config.json`` (read by `engine.model.hf_config.read_hf_config`),
optionally ``generation_config.json`` (its ``eos_token_id`` are the stop
ids), one or more ``*.safetensors`` files whose tensor names are Hugging
Face's (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.
weight`` ...; Mixtral's ``block_sparse_moe.*`` names are read as
`engine.model.moe`'s), and ``tokenizer.json`` (+ ``tokenizer_config.json``);
see `engine.model.tokenizer.load_tokenizer` for a directory without one.

Every problem is a `CheckpointError` naming what is wrong: a missing or
unreadable file, missing or unexpected tensors, a tensor whose shape
contradicts config.json (name, expected, found), a family or option that is
not supported, or the `checkpoints` extra not installed.

Weights are loaded straight to the target device: the model is built on the
meta device, every file's tensor names and shapes are checked before any
tensor is read, and the loaded tensors are assigned into the model, so a
checkpoint is never held twice in memory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, overload

import attrs
import torch

from engine.errors import InvalidConfig
from engine.model.hf_config import CheckpointError, read_hf_config
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.tokenizer import EXTRA_HINT, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"

#: Tensors some checkpoints carry that this model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

#: Mixtral's checkpoint names -> the model's (Qwen-MoE) names.
_MIXTRAL_NAMES = [
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
]
_MIXTRAL_BACK = [(".mlp.gate.", ".block_sparse_moe.gate."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                 (".down_proj.", ".w2.")]


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[LlamaModel, ModelConfig, Tokenizer]:
    """The model (in eval mode, on `device`, cast to `dtype` or else the
    config's ``torch_dtype``), its config and its tokenizer, read from `path`."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError("EngineConfig.model", f"loading a checkpoint directory needs the `checkpoints` "
                              f"extra: {EXTRA_HINT}", str(path)) from None
    directory = Path(path)
    if not directory.is_dir():
        raise InvalidConfig("EngineConfig.model", "'tiny', 'tiny-moe', 'null' or a checkpoint directory", str(path))
    hf = _read_json(directory / CONFIG_FILE, required=True)
    generation = _read_json(directory / GENERATION_CONFIG_FILE, required=False)
    config = read_hf_config(hf, generation)
    if dtype is not None:
        config = _with_dtype(config, dtype)
    weight_files = sorted(directory.glob("*.safetensors"))
    if not weight_files:
        raise CheckpointError(str(directory / WEIGHTS_FILE), "missing: the checkpoint has no *.safetensors file")

    with torch.device("meta"):
        model = LlamaModel(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    located = _locate_tensors(weight_files, expected, hf.get("model_type"), tied=model.lm_head is None,
                              safe_open=safe_open)
    loaded: dict[str, torch.Tensor] = {}
    for weight_file, names in located.items():
        with _open(weight_file, safe_open, str(device)) as f:
            for stored, name in names:
                loaded[name] = f.get_tensor(stored).to(config.torch_dtype)
    model.load_state_dict(loaded, strict=True, assign=True)
    model.eval()
    byte_level = hf.get("kvlife", {}).get("tokenizer") == "bytes"
    return model, config, load_tokenizer(directory, config, byte_level=byte_level)


def save_checkpoint(model: LlamaModel, config: ModelConfig, path: str | Path) -> Path:
    """Write `model` as ``config.json`` + ``model.safetensors`` under `path`
    (created if needed), in the format `load_checkpoint` and Hugging Face
    read; a model whose ids fit the byte tokenizer is marked byte-level, so
    it loads with that tokenizer. Returns the directory."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    hf_config = _with_dtype(config, dtype_name).to_hf_config()
    try:
        ByteTokenizer.for_config(config)
    except ValueError:
        pass
    else:
        hf_config.setdefault("kvlife", {})["tokenizer"] = "bytes"
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


@overload
def _read_json(path: Path, *, required: Literal[True]) -> dict[str, Any]: ...
@overload
def _read_json(path: Path, *, required: Literal[False]) -> dict[str, Any] | None: ...
def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointError(str(path), "missing: a checkpoint directory needs a Hugging Face config.json")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(path), f"unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(str(path), "unreadable (not a JSON object)")
    return data


def _renamer(model_type: Any):
    """Checkpoint tensor name -> model parameter name, for `model_type`."""
    if model_type != "mixtral":
        return lambda name: name

    def rename(name: str) -> str:
        for pattern, replacement in _MIXTRAL_NAMES:
            name = pattern.sub(replacement, name)
        return name

    return rename


def _stored_name(name: str, model_type: Any) -> str:
    """The name a `model_type` checkpoint stores model parameter `name` under."""
    if model_type == "mixtral" and ".mlp." in name:
        for model_part, stored_part in _MIXTRAL_BACK:
            name = name.replace(model_part, stored_part)
        name = name.replace(".mlp.experts.", ".block_sparse_moe.experts.")
    return name


def _open(weight_file: Path, safe_open, device: str):
    try:
        return safe_open(str(weight_file), framework="pt", device=device)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types, and OSError
        raise CheckpointError(str(weight_file), f"unreadable safetensors file ({exc})") from None


def _locate_tensors(weight_files: list[Path], expected: dict[str, tuple[int, ...]], model_type: Any, *,
                    tied: bool, safe_open) -> dict[Path, list[tuple[str, str]]]:
    """Per file, the (stored name, model name) pairs to read. Raises one
    CheckpointError naming every misshapen, missing and unexpected tensor
    (its `field` is the first of them), from the files' headers, before any
    tensor is read."""
    rename = _renamer(model_type)
    located: dict[Path, list[tuple[str, str]]] = {}
    seen: set[str] = set()
    misshapen: list[tuple[str, str]] = []  # (stored name, what is wrong)
    unexpected: list[tuple[str, str]] = []
    for weight_file in weight_files:
        with _open(weight_file, safe_open, "cpu") as f:
            for stored in f.keys():
                name = rename(stored)
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                if name not in expected:
                    unexpected.append((stored, f"{stored!r} in {weight_file.name}"))
                    continue
                shape = tuple(f.get_slice(stored).get_shape())
                if shape != expected[name]:
                    misshapen.append((stored, f"tensor {stored!r} in {weight_file.name} has shape {list(shape)}, "
                                              f"config.json implies {list(expected[name])}"))
                    continue
                seen.add(name)
                located.setdefault(weight_file, []).append((stored, name))
    missing = [(stored, repr(stored)) for stored in (_stored_name(n, model_type) for n in expected if n not in seen)
               if stored not in {m for m, _ in misshapen}]
    problems = [text for _, text in misshapen]
    if missing:
        problems.append(f"missing tensor {_listed([text for _, text in missing])}")
    if unexpected:
        problems.append(f"unexpected tensor {_listed([text for _, text in unexpected])} "
                        "(an architecture variant kvlife does not run?)")
    if problems:
        raise CheckpointError((misshapen or missing or unexpected)[0][0], "; ".join(problems))
    return located


def _listed(items: list[str], shown: int = 5) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _with_dtype(config: ModelConfig, dtype: torch.dtype | str) -> ModelConfig:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return attrs.evolve(config, dtype=name)
