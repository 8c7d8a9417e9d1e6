"""Tests for engine.model.checkpoint: save/load round trips, clear errors for
broken directories, and (when transformers is installed) agreement with
Hugging Face's own Llama/Qwen2 implementation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from engine.model.dense_reference import dense_forward
from engine.model.model_config import ModelConfig, RopeScaling
from engine.model.llama import LlamaModel
from engine.model.tokenizer import ByteTokenizer, HFTokenizer

_PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]

_VARIANTS = {
    "llama-gqa": ModelConfig.tiny(),
    "moe": ModelConfig.tiny_moe(),
    "qwen2-bias-tied": ModelConfig.tiny(attention_bias=True, tie_word_embeddings=True),
    "llama3-rope": ModelConfig.tiny(
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8
        )
    ),
}


def _save(tmp_path: Path, config: ModelConfig, seed: int = 0) -> tuple[LlamaModel, Path]:
    model = LlamaModel.from_seed(config, seed=seed)
    return model, save_checkpoint(model, config, tmp_path / "ckpt")


def _rewrite_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


class TestRoundTrip:
    @pytest.mark.parametrize("config", list(_VARIANTS.values()), ids=list(_VARIANTS))
    def test_save_then_load_gives_identical_logits(self, tmp_path, config):
        """load_checkpoint(save_checkpoint(m)) has the same config and bit-identical logits."""
        model, directory = _save(tmp_path, config)
        loaded, loaded_config, tokenizer = load_checkpoint(directory, device="cpu")
        assert loaded_config == config
        assert isinstance(tokenizer, ByteTokenizer) and tokenizer.eos_token_id == config.eos_token_id
        assert torch.equal(dense_forward(loaded, _PROMPT), dense_forward(model, _PROMPT))

    def test_dtype_argument_casts_weights_and_config(self, tmp_path):
        """load_checkpoint(dtype=bfloat16) returns bfloat16 weights and a config saying so."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        loaded, config, _ = load_checkpoint(directory, device="cpu", dtype=torch.bfloat16)
        assert loaded.dtype == torch.bfloat16 and config.dtype == "bfloat16"

    def test_tokenizer_json_is_used_when_present(self, tmp_path):
        """A tokenizer.json next to the weights is loaded as an HFTokenizer."""
        tokenizers = pytest.importorskip("tokenizers")
        _, directory = _save(tmp_path, ModelConfig.tiny())
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]"))
        backend.save(str(directory / "tokenizer.json"))
        _, _, tokenizer = load_checkpoint(directory)
        assert isinstance(tokenizer, HFTokenizer) and tokenizer.encode("hi") == [0]


class TestBrokenCheckpoints:
    def test_missing_config_names_the_file(self, tmp_path):
        """A directory without config.json raises CheckpointError naming config.json."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        (directory / "config.json").unlink()
        with pytest.raises(CheckpointError, match="config.json"):
            load_checkpoint(directory)

    def test_missing_weights_file_is_named(self, tmp_path):
        """A directory without safetensors files raises CheckpointError saying so."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        (directory / "model.safetensors").unlink()
        with pytest.raises(CheckpointError, match="safetensors"):
            load_checkpoint(directory)

    def test_missing_tensor_is_named(self, tmp_path):
        """A checkpoint lacking a tensor raises CheckpointError naming that tensor."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        _rewrite_weights(directory, lambda t: t.pop("model.layers.2.mlp.down_proj.weight"))
        with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.down_proj\.weight"):
            load_checkpoint(directory)

    def test_unknown_tensor_is_named(self, tmp_path):
        """A tensor the model does not have (e.g. a q_norm) raises CheckpointError naming it."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        _rewrite_weights(directory, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(64)}))
        with pytest.raises(CheckpointError, match="q_norm"):
            load_checkpoint(directory)

    def test_wrong_shape_is_named(self, tmp_path):
        """A tensor whose shape contradicts config.json raises CheckpointError naming it."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        config = json.loads((directory / "config.json").read_text())
        config["intermediate_size"] = 512
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight"):
            load_checkpoint(directory)

    def test_legacy_inv_freq_tensors_are_ignored(self, tmp_path):
        """Old checkpoints' rotary_emb.inv_freq buffers load without error."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        _rewrite_weights(
            directory, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)})
        )
        load_checkpoint(directory)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied", "llama3-rope"])
def test_transformers_reads_the_same_model(tmp_path, variant):
    """Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM give the same logits for a saved checkpoint."""
    transformers = pytest.importorskip("transformers")
    model, directory = _save(tmp_path, _VARIANTS[variant], seed=1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([_PROMPT])).logits[0].float()
    torch.testing.assert_close(dense_forward(model, _PROMPT), expected, atol=1e-4, rtol=1e-4)
