"""RoPE scalings: kvlife's inverse frequencies and attention factor are
exactly transformers' for every supported scaling, and a Llama checkpoint
with each scaling gives transformers' greedy ids and logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import parity_models as pm  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model.checkpoint import load_checkpoint  # noqa: E402
from engine.model.dense_reference import dense_forward  # noqa: E402
from engine.model.hf_config import read_hf_config  # noqa: E402
from engine.model.rope import scaled_inverse_frequencies  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

_MORE_YARN = {
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                         "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "attention_factor": 1.5},
}


def _hf_config(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                                    rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("rope", [*pm.ROPE_SCALINGS.values(), *_MORE_YARN.values()],
                         ids=[*pm.ROPE_SCALINGS, *_MORE_YARN])
def test_inverse_frequencies_are_transformers_bit_for_bit(rope):
    """For each scaling, kvlife's inverse frequencies and cos/sin factor equal transformers' exactly."""
    hf_config = _hf_config(rope)
    expected, expected_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, torch.device("cpu"))
    config = read_hf_config(hf_config.to_dict())
    got, factor = scaled_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                             torch.device("cpu"))
    assert torch.equal(got, expected.float())
    assert factor == pytest.approx(expected_factor, rel=0, abs=0)


@pytest.fixture(scope="module", params=list(pm.ROPE_SCALINGS))
def scaled_llama(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"llama-{request.param}")
    return directory, pm.write_checkpoint(directory, "llama", rope=pm.ROPE_SCALINGS[request.param])


@pytest.mark.anyio
async def test_greedy_ids_equal_transformers(scaled_llama):
    """A Llama checkpoint with each RoPE scaling gives transformers' greedy ids for every prompt."""
    directory, model = scaled_llama
    config = EngineConfig(model=str(directory), page_size=4, num_kv_pages=128, max_context=128,
                          max_prefill_tokens=16, use_entry_points=False)
    async with Engine(config) as engine:
        got = [(await engine.complete(p, SamplingParams(max_new_tokens=pm.MAX_NEW))).token_ids for p in pm.ID_PROMPTS]
    assert got == [pm.hf_greedy(model, p, pm.MAX_NEW)[0] for p in pm.ID_PROMPTS]


def test_logits_equal_transformers(scaled_llama):
    """Logits over a long prompt and its continuation are within 1e-4 of transformers'."""
    directory, model = scaled_llama
    loaded, config, _ = load_checkpoint(directory)
    assert config.rope_scaling is not None
    tokens = pm.ID_PROMPTS[1] + pm.hf_greedy(model, pm.ID_PROMPTS[1], pm.MAX_NEW)[0]
    torch.testing.assert_close(dense_forward(loaded, tokens), pm.hf_logits(model, tokens), atol=1e-4, rtol=0)
