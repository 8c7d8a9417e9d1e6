"""Tests for engine.model_config: validation messages and the Hugging Face
config.json round trip."""

from __future__ import annotations

import pytest
import torch

from engine.model.model_config import ModelConfig, RopeScaling, VisionConfig

_LLAMA3_CONFIG = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "max_position_embeddings": 131072,
}


class TestValidation:
    def test_tiny_shapes(self):
        """tiny() is the documented byte-level 4-layer GQA model with a vision projector."""
        config = ModelConfig.tiny()
        assert (config.vocab_size, config.hidden_size, config.num_layers) == (264, 256, 4)
        assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 64)
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id, config.image_token_id) == (
            256,
            257,
            258,
            259,
        )
        assert config.vision == VisionConfig(patch_size=8, max_image_size=64)
        assert not config.is_moe and config.torch_dtype == torch.float32

    def test_tiny_moe_shapes(self):
        """tiny_moe() has 8 experts, top-2, expert width 256."""
        config = ModelConfig.tiny_moe()
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 256)
        assert config.is_moe

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            (dict(num_kv_heads=3), "multiple of num_kv_heads"),
            (dict(eos_token_id=264), "eos_token_id"),
            (dict(image_token_id=None), "image_token_id"),
            (dict(hidden_size=0), "hidden_size"),
            (dict(dtype="int8"), "dtype"),
            (dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8), "num_experts_per_tok"),
            (dict(num_experts=4, num_experts_per_tok=1), "moe_intermediate_size"),
            (dict(extra_eos_token_ids=(999,)), "extra_eos_token_ids"),
        ],
    )
    def test_invalid_fields_raise_with_the_field_name(self, overrides, message):
        """An invalid field raises ValueError whose message names it."""
        with pytest.raises(ValueError, match=message):
            ModelConfig.tiny(**overrides)


class TestHFConfig:
    @pytest.mark.parametrize(
        "config",
        [
            ModelConfig.tiny(),
            ModelConfig.tiny_moe(),
            ModelConfig.tiny(attention_bias=True, tie_word_embeddings=True, vision=None, image_token_id=None),
            ModelConfig.tiny(
                extra_eos_token_ids=(1, 2),
                dtype="bfloat16",
                rope_scaling=RopeScaling(
                    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
                ),
            ),
        ],
        ids=["tiny", "moe", "qwen2", "llama3-rope"],
    )
    def test_round_trip(self, config):
        """from_hf_config(to_hf_config(c)) == c."""
        assert ModelConfig.from_hf_config(config.to_hf_config()) == config

    def test_reads_llama3_config(self):
        """A Llama 3.2 config.json reads with defaults filled in and every EOS id kept."""
        config = ModelConfig.from_hf_config(_LLAMA3_CONFIG)
        assert config.head_dim == 64 and config.num_kv_heads == 8
        assert config.stop_token_ids == (128001, 128008, 128009)
        assert config.pad_token_id == 128001
        assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0
        assert config.dtype == "bfloat16" and config.image_token_id is None

    def test_qwen2_gets_attention_bias(self):
        """model_type qwen2 means q/k/v biases."""
        config = ModelConfig.from_hf_config({**_LLAMA3_CONFIG, "model_type": "qwen2", "rope_scaling": None})
        assert config.attention_bias and config.rope_scaling is None

    @pytest.mark.parametrize(
        ("changes", "limit"),
        [
            ({"model_type": "mistral", "sliding_window": 4096}, 4096),
            ({"model_type": "mistral", "sliding_window": None}, 131072),
            ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, 131072),
            ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, 4096),
        ],
    )
    def test_sliding_window_caps_the_context(self, changes, limit):
        """A sliding window in force caps max_position_embeddings, since attention here is always full."""
        config = ModelConfig.from_hf_config({**_LLAMA3_CONFIG, "rope_scaling": None, **changes})
        assert config.max_position_embeddings == limit

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"model_type": "gpt2"}, "model_type"),
            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
            ({"hidden_act": "gelu"}, "hidden_act"),
            ({"attention_bias": True}, "attention_bias"),
            ({"torch_dtype": "float64"}, "float64"),
        ],
    )
    def test_unsupported_features_raise(self, changes, message):
        """Architectures and options the model cannot run raise ValueError naming them."""
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_config({**_LLAMA3_CONFIG, **changes})
