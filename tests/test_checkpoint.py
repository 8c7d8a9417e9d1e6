"""Tests for engine.model.checkpoint: save/load round trips, errors that name
the file or tensor, and (when transformers is installed) transformers reading
kvlife's own checkpoints with the same logits."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import InvalidConfig
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
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8,
        )
    ),
    "qwen3-qk-norm": ModelConfig.tiny(qk_norm=True, vision=None, image_token_id=None),
    "yarn-rope": ModelConfig.tiny(
        rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
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

    def test_dtype_comes_from_the_config(self, tmp_path):
        """With no dtype asked for, a bfloat16 checkpoint loads as bfloat16 (its config's torch_dtype)."""
        model = LlamaModel.from_seed(ModelConfig.tiny(), seed=0, dtype=torch.bfloat16)
        directory = save_checkpoint(model, ModelConfig.tiny(), tmp_path / "ckpt")
        loaded, config, _ = load_checkpoint(directory)
        assert loaded.dtype == torch.bfloat16 and config.dtype == "bfloat16"


class TestBrokenCheckpoints:
    def test_missing_config_names_the_file(self, tmp_path):
        """A directory without config.json raises CheckpointError naming config.json."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        (directory / "config.json").unlink()
        with pytest.raises(CheckpointError, match="config.json"):
            load_checkpoint(directory)

    def test_not_a_directory_is_a_bad_model_name(self, tmp_path):
        """A model path that is no directory is an InvalidConfig on EngineConfig.model, as any unknown name."""
        with pytest.raises(InvalidConfig) as caught:
            load_checkpoint(tmp_path / "nowhere")
        assert caught.value.field == "EngineConfig.model" and "checkpoint directory" in str(caught.value)

    @pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
    def test_unreadable_file_is_named(self, tmp_path, name):
        """A corrupt config.json or safetensors file raises CheckpointError naming the file."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        (directory / name).write_bytes(b"\x00garbage")
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(directory)
        assert caught.value.field.endswith(name) and "unreadable" in str(caught.value)

    def test_missing_weights_file_is_named(self, tmp_path):
        """A directory without safetensors files raises CheckpointError saying so."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        (directory / "model.safetensors").unlink()
        with pytest.raises(CheckpointError, match="safetensors"):
            load_checkpoint(directory)

    def test_missing_tensor_is_named(self, tmp_path):
        """A checkpoint lacking a tensor raises CheckpointError whose field is that tensor."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        _rewrite_weights(directory, lambda t: t.pop("model.layers.2.mlp.down_proj.weight"))
        with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.down_proj\.weight'") as caught:
            load_checkpoint(directory)
        assert caught.value.field == "model.layers.2.mlp.down_proj.weight"

    def test_unknown_tensor_is_named(self, tmp_path):
        """A tensor the model does not have (e.g. a q_norm) raises CheckpointError naming it."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        _rewrite_weights(directory, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(64)}))
        with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
            load_checkpoint(directory)

    def test_wrong_shape_names_tensor_expected_and_found(self, tmp_path):
        """A tensor whose shape contradicts config.json: its name, the shape found and the shape expected."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        config = json.loads((directory / "config.json").read_text())
        config["intermediate_size"] = 512
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(directory)
        message = str(caught.value)
        assert re.match(r"model\.layers\.0\.mlp\.\w+_proj\.weight$", caught.value.field)
        assert "has shape [1024, 256], config.json implies [512, 256]" in message
        assert "missing" not in message  # a misshapen tensor is reported once, not also as missing

    def test_mixtral_names_are_reported_as_stored(self, tmp_path):
        """A Mixtral checkpoint's missing expert is named by its block_sparse_moe name."""
        transformers = pytest.importorskip("transformers")
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
        load_checkpoint(tmp_path)  # loads as is
        _rewrite_weights(tmp_path, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.1.w3.weight"))
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(tmp_path)
        assert caught.value.field == "model.layers.0.block_sparse_moe.experts.1.w3.weight"

    @pytest.mark.parametrize("module", ["safetensors", "tokenizers"])
    def test_missing_extra_names_the_install_command(self, tmp_path, monkeypatch, module):
        """Without the checkpoints extra, loading says `pip install 'kvlife[checkpoints]'`."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        (directory / "tokenizer.json").write_text("{}")
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(CheckpointError, match=re.escape("pip install 'kvlife[checkpoints]'")):
            load_checkpoint(directory)

    def test_legacy_inv_freq_tensors_are_ignored(self, tmp_path):
        """Old checkpoints' rotary_emb.inv_freq buffers load without error."""
        _, directory = _save(tmp_path, ModelConfig.tiny())
        _rewrite_weights(
            directory, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)})
        )
        load_checkpoint(directory)

    def test_checkpoint_error_is_an_invalid_config(self):
        """CheckpointError is an InvalidConfig, so the CLI and callers treat it as a bad configuration."""
        assert issubclass(CheckpointError, InvalidConfig)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied", "llama3-rope", "qwen3-qk-norm", "yarn-rope"])
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
