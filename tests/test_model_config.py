"""Tests for engine.model.model_config and engine.model.hf_config: validation
messages, the config.json round trip, each family's reading, and refusals
that name the field."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidConfig
from engine.model.checkpoint import CheckpointError
from engine.model.hf_config import read_hf_config
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
            (dict(sliding_window=0), "sliding_window"),
            (dict(sliding_window=8, sliding_window_layers=(4,)), "sliding_window_layers"),
            (dict(shared_expert_intermediate_size=8), "shared_expert_intermediate_size"),
            (dict(head_dim=63), "head_dim"),
            (dict(hidden_act="relu"), "hidden_act"),
        ],
    )
    def test_invalid_fields_raise_with_the_field_name(self, overrides, message):
        """An invalid field raises ValueError whose message names it."""
        with pytest.raises(ValueError, match=message):
            ModelConfig.tiny(**overrides)


    def test_layer_windows(self):
        """layer_windows gives each layer its window: the named layers, or every layer when none are named."""
        assert ModelConfig.tiny().layer_windows == (None,) * 4
        assert ModelConfig.tiny(sliding_window=8).layer_windows == (8,) * 4
        assert ModelConfig.tiny(sliding_window=8, sliding_window_layers=(1, 3)).layer_windows == (None, 8, None, 8)


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
                    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
            ),
        ],
        ids=["tiny", "moe", "qwen2", "llama3-rope"],
    )
    def test_round_trip(self, config):
        """from_hf_config(to_hf_config(c)) == c."""
        assert read_hf_config(config.to_hf_config()) == config

    def test_reads_llama3_config(self):
        """A Llama 3.2 config.json reads with defaults filled in and every EOS id kept."""
        config = read_hf_config(_LLAMA3_CONFIG)
        assert config.head_dim == 64 and config.num_kv_heads == 8
        assert config.stop_token_ids == (128001, 128008, 128009)
        assert config.pad_token_id == 128001
        assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0
        assert config.dtype == "bfloat16" and config.image_token_id is None

    def test_qwen2_gets_attention_bias(self):
        """model_type qwen2 means q/k/v biases."""
        config = read_hf_config({**_LLAMA3_CONFIG, "model_type": "qwen2", "rope_scaling": None})
        assert config.attention_bias and config.rope_scaling is None

    @pytest.mark.parametrize(
        ("changes", "window", "layers"),
        [
            ({"model_type": "mistral", "sliding_window": 4096}, 4096, None),
            ({"model_type": "mistral", "sliding_window": None}, None, None),
            ({"model_type": "mistral"}, 4096, None),  # transformers' MistralConfig default
            ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, None, None),
            ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, None, None),
            ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 12},
             4096, tuple(range(12, 16))),
            ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
              "layer_types": ["sliding_attention", "full_attention"] * 8}, 64, tuple(range(0, 16, 2))),
            ({"model_type": "qwen2_moe", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 6,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
              "shared_expert_intermediate_size": 8}, 64, (0, 2, 4)),
            ({"model_type": "qwen3_moe", "sliding_window": 64, "use_sliding_window": True, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 8}, 64, None),
        ],
        ids=["mistral", "mistral-null", "mistral-default", "mixtral-default", "qwen2-off", "qwen2-max-window-layers",
             "qwen2-layer-types", "qwen2-moe-odd-layers", "qwen3-moe-all-layers"],
    )
    def test_sliding_window_settings_read_as_transformers_reads_them(self, changes, window, layers):
        """sliding_window / use_sliding_window / max_window_layers / layer_types give transformers' per-layer windows."""
        config = read_hf_config({**_LLAMA3_CONFIG, "rope_scaling": None, **changes})
        assert (config.sliding_window, config.sliding_window_layers) == (window, layers)
        assert config.max_position_embeddings == 131072  # the window no longer caps the context
        assert sum(w is not None for w in config.layer_windows) == (0 if window is None else len(layers or range(16)))

    def test_generation_config_eos_ids_are_the_stop_ids(self):
        """generation_config.json's eos_token_id list, when given, is the stop set (as generate uses it)."""
        config = read_hf_config({**_LLAMA3_CONFIG, "eos_token_id": 128001}, {"eos_token_id": [128009, 7]})
        assert config.stop_token_ids == (128009, 7)
        assert read_hf_config({**_LLAMA3_CONFIG, "eos_token_id": 5}, {}).stop_token_ids == (5,)

    def test_no_eos_anywhere_means_no_stop_ids(self):
        """A config without any eos_token_id loads; generation then runs to max_new_tokens or a stop id."""
        config = read_hf_config({**_LLAMA3_CONFIG, "eos_token_id": None, "pad_token_id": None})
        assert config.stop_token_ids == () and config.pad_token_id is None

    @pytest.mark.parametrize(
        ("spec", "expected"),
        [
            ({"rope_type": "linear", "factor": 2.0}, RopeScaling(rope_type="linear", factor=2.0)),
            ({"type": "dynamic", "factor": 2.0}, RopeScaling(rope_type="dynamic", factor=2.0)),
            ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
             RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
            ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0},  # 0 means the default; original from the config
             RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=131072)),
        ],
        ids=["linear", "legacy-type-key", "yarn", "yarn-defaults"],
    )
    def test_rope_scalings_are_read(self, spec, expected):
        """rope_scaling (v4) and rope_parameters (v5) give the scaling transformers computes with."""
        for key in ("rope_scaling", "rope_parameters"):
            config = read_hf_config({**_LLAMA3_CONFIG, "rope_scaling": None, key: spec})
            assert config.rope_scaling == expected

    def test_v5_rope_parameters_carry_theta_and_dtype_key(self):
        """transformers 5 writes rope_theta inside rope_parameters and `dtype` instead of `torch_dtype`."""
        hf = {**_LLAMA3_CONFIG, "rope_scaling": None, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
              "dtype": "float16"}
        del hf["torch_dtype"]
        config = read_hf_config(hf)
        assert (config.rope_theta, config.rope_scaling, config.dtype) == (5e5, None, "float16")

    @pytest.mark.parametrize(
        ("changes", "field"),
        [
            ({"model_type": "gpt2"}, "config.json model_type"),
            ({"model_type": "gemma2"}, "config.json model_type"),
            ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "config.json rope_scaling.rope_type"),
            ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "config.json rope_scaling"),
            ({"rope_scaling": {"rope_type": "linear"}}, "config.json rope_scaling.factor"),
            ({"partial_rotary_factor": 0.5}, "config.json partial_rotary_factor"),
            ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "config.json rope_parameters"),
            ({"hidden_act": "gelu"}, "config.json hidden_act"),
            ({"torch_dtype": "float64"}, "config.json torch_dtype"),
            ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["x"] * 16},
             "config.json layer_types[0]"),
            ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
              "mlp_only_layers": [1]}, "config.json mlp_only_layers"),
            ({"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
              "shared_expert_intermediate_size": 8, "decoder_sparse_step": 2}, "config.json decoder_sparse_step"),
            ({"model_type": "gemma", "use_bidirectional_attention": True, "hidden_act": "gelu_pytorch_tanh"},
             "config.json use_bidirectional_attention"),
            ({"num_attention_heads": None}, "config.json num_attention_heads"),
            ({"eos_token_id": 999999}, "config.json"),
        ],
    )
    def test_unsupported_features_raise_checkpoint_error_naming_the_field(self, changes, field):
        """Families and options the model cannot run raise CheckpointError (an InvalidConfig) naming the field."""
        with pytest.raises(CheckpointError) as caught:
            read_hf_config({**_LLAMA3_CONFIG, **changes})
        assert caught.value.field == field and str(caught.value).startswith(field)
        assert isinstance(caught.value, InvalidConfig)


class TestFamilies:
    @pytest.mark.parametrize(
        ("model_type", "extra", "expected"),
        [
            ("llama", {"attention_bias": True, "mlp_bias": True},
             dict(attention_bias=True, o_proj_bias=True, mlp_bias=True)),
            ("qwen2", {}, dict(attention_bias=True, o_proj_bias=False, qk_norm=False)),
            ("qwen3", {}, dict(attention_bias=False, o_proj_bias=False, qk_norm=True)),
            ("gemma", {"hidden_act": "gelu"}, dict(gemma_norm=True, scale_embeddings=True,
                                                    hidden_act="gelu_pytorch_tanh")),
            ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2},
             dict(num_experts=8, moe_intermediate_size=8192, norm_topk_prob=True, router_weights_float32=True)),
            ("qwen2_moe", {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                           "shared_expert_intermediate_size": 5632},
             dict(num_experts=60, norm_topk_prob=False, shared_expert_intermediate_size=5632, attention_bias=True)),
            ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                           "norm_topk_prob": True},
             dict(num_experts=128, norm_topk_prob=True, qk_norm=True, router_weights_float32=False)),
        ],
    )
    def test_family_features(self, model_type, extra, expected):
        """Each family's config.json turns on the parts of the model that family uses."""
        config = read_hf_config({**_LLAMA3_CONFIG, "rope_scaling": None, "model_type": model_type,
                                             **extra})
        assert {name: getattr(config, name) for name in expected} == expected
