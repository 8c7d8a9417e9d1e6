"""Tests for engine.model.llama and engine.model.dense_reference: seeded weights,
non-degenerate greedy output, RoPE, MoE routing, image embeddings."""

from __future__ import annotations

import pytest
import torch

from engine.model.dense_reference import DenseCausalAttention, dense_forward
from engine.model.model_config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.rope import apply_rope
from engine.model.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return LlamaModel.from_seed(ModelConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def tiny_moe() -> LlamaModel:
    return LlamaModel.from_seed(ModelConfig.tiny_moe(), seed=0)


def _greedy(model: LlamaModel, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(dense_forward(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def _image(height: int, width: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=gen)


class TestFromSeed:
    def test_same_seed_gives_same_weights(self):
        """Two models from the same config and seed have identical state dicts."""
        first = LlamaModel.from_seed(ModelConfig.tiny(), seed=4).state_dict()
        second = LlamaModel.from_seed(ModelConfig.tiny(), seed=4).state_dict()
        assert first.keys() == second.keys()
        assert all(torch.equal(first[name], second[name]) for name in first)

    def test_different_seeds_give_different_weights(self):
        """Changing the seed changes the weights."""
        first = LlamaModel.from_seed(ModelConfig.tiny(), seed=4).state_dict()
        second = LlamaModel.from_seed(ModelConfig.tiny(), seed=5).state_dict()
        assert not torch.equal(
            first["model.layers.0.self_attn.q_proj.weight"], second["model.layers.0.self_attn.q_proj.weight"]
        )

    def test_dtype_override_casts_the_same_weights(self):
        """from_seed(dtype=bfloat16) holds the float32 weights cast to bfloat16, and its forward runs."""
        full = LlamaModel.from_seed(ModelConfig.tiny(), seed=4)
        half = LlamaModel.from_seed(ModelConfig.tiny(), seed=4, dtype=torch.bfloat16)
        assert half.dtype == torch.bfloat16
        weight = "model.layers.1.mlp.up_proj.weight"
        assert torch.equal(half.state_dict()[weight], full.state_dict()[weight].to(torch.bfloat16))
        logits = dense_forward(half, [1, 2, 3])
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


class TestGreedy:
    @pytest.mark.parametrize("prompt", ["Hello, world", "The quick brown fox", "a"])
    @pytest.mark.parametrize("config", [ModelConfig.tiny(), ModelConfig.tiny_moe()], ids=["dense", "moe"])
    def test_greedy_output_is_varied(self, config, prompt):
        """32 greedy tokens from the seeded model contain at least 8 distinct ids."""
        model = LlamaModel.from_seed(config, seed=0)
        output = _greedy(model, ByteTokenizer(add_bos=True).encode(prompt), 32)
        assert len(set(output)) >= 8, output

    def test_output_rows_select_logit_rows(self, tiny):
        """output_rows returns exactly those rows of the full logits, in that order."""
        ids = torch.tensor([5, 6, 7, 8, 9])
        positions = torch.arange(5)
        with torch.inference_mode():
            full = tiny(ids, positions, DenseCausalAttention())
            rows = tiny(ids, positions, DenseCausalAttention(), output_rows=torch.tensor([4, 1]))
        torch.testing.assert_close(rows, full[[4, 1]])


class TestRope:
    def test_scores_depend_only_on_relative_position(self):
        """q·k after RoPE is the same for positions (p, p') and (p + s, p' + s)."""
        model = LlamaModel.from_seed(ModelConfig.tiny(), seed=0)
        gen = torch.Generator().manual_seed(0)
        q, k = torch.randn(2, 1, 1, 64, generator=gen)

        def score(q_pos: int, k_pos: int) -> torch.Tensor:
            cos, sin = model.rotary.cos_sin(torch.tensor([q_pos, k_pos]), torch.float32)
            rotated = apply_rope(torch.cat([q, k]), cos, sin)
            return (rotated[0] * rotated[1]).sum()

        torch.testing.assert_close(score(7, 3), score(107, 103), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(score(7, 3), score(7, 4))


class TestMoE:
    def test_routing_counts_sum_to_tokens_times_layers_times_top_k(self, tiny_moe):
        """A forward's routing has one [T, top_k] tensor per layer; expert counts sum to T * layers * top_k."""
        config = tiny_moe.config
        tokens = 11
        routings: list = []
        dense_forward(tiny_moe, list(range(tokens)), routing=routings)
        assert len(routings) == config.num_layers
        counts = torch.zeros(config.num_experts, dtype=torch.long)
        for routing in routings:
            assert routing.shape == (tokens, config.num_experts_per_tok)
            assert all(len(set(row)) == config.num_experts_per_tok for row in routing.tolist())
            counts += torch.bincount(routing.flatten(), minlength=config.num_experts)
        assert int(counts.sum()) == tokens * config.num_layers * config.num_experts_per_tok
        assert int((counts > 0).sum()) > 1

    def test_moe_output_equals_per_token_weighted_expert_sum(self, tiny_moe):
        """The MoE FFN equals, per token, the renormalised-softmax-weighted sum of its top-k experts."""
        moe = tiny_moe.model.layers[0].mlp
        x = torch.randn(6, tiny_moe.config.hidden_size, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            out, expert_ids = moe(x)
            for t in range(x.shape[0]):
                logits = moe.gate(x[t])
                chosen = expert_ids[t]
                weights = torch.softmax(logits[chosen], dim=0)
                expected = sum(w * moe.experts[int(e)](x[t]) for w, e in zip(weights, chosen, strict=True))
                torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)
                assert set(chosen.tolist()) == set(torch.topk(logits, moe.top_k).indices.tolist())

    def test_dense_model_records_no_routing(self, tiny):
        """A dense model appends no routing during a forward."""
        routings: list = []
        dense_forward(tiny, [1, 2, 3], routing=routings)
        assert routings == []


class TestVision:
    @pytest.mark.parametrize(("height", "width", "tokens"), [(64, 64, 64), (16, 8, 2), (8, 8, 1)])
    def test_num_image_tokens_is_patch_count(self, tiny, height, width, tokens):
        """An HxW image takes (H / patch) * (W / patch) placeholder tokens."""
        assert tiny.num_image_tokens(_image(height, width)) == tokens

    @pytest.mark.parametrize(
        "image",
        [
            torch.zeros(12, 8, 3, dtype=torch.uint8),  # not a patch multiple
            torch.zeros(72, 8, 3, dtype=torch.uint8),  # over the size limit
            torch.zeros(8, 8, 3, dtype=torch.float32),  # not uint8
            torch.zeros(8, 8, dtype=torch.uint8),  # no channels
        ],
        ids=["ragged", "too-big", "float", "gray"],
    )
    def test_unacceptable_images_raise(self, tiny, image):
        """Images of the wrong dtype, shape or size raise ValueError."""
        with pytest.raises(ValueError, match="image"):
            tiny.num_image_tokens(image)

    def test_placeholders_are_replaced_by_patches_in_order(self, tiny):
        """Placeholder rows get the images' patch embeddings in order; other rows keep token embeddings."""
        image_id = tiny.config.image_token_id
        first, second = _image(8, 16, seed=1), _image(8, 8, seed=2)
        ids = torch.tensor([65, image_id, image_id, 66, image_id, 67])
        with torch.inference_mode():
            embeds = tiny.embed_with_images(ids, [first, second])
            token_embeds = tiny.model.embed_tokens(ids)
            patches = torch.cat([tiny.vision_projector(first), tiny.vision_projector(second)])
        torch.testing.assert_close(embeds[[1, 2, 4]], patches)
        torch.testing.assert_close(embeds[[0, 3, 5]], token_embeds[[0, 3, 5]])
        logits = dense_forward(tiny, ids, input_embeds=embeds)
        assert not torch.allclose(logits[-1], dense_forward(tiny, ids)[-1])

    def test_placeholder_count_must_match_patches(self, tiny):
        """embed_with_images raises ValueError when placeholders and patches differ in number."""
        ids = torch.tensor([65, tiny.config.image_token_id, 66])
        with pytest.raises(ValueError, match="placeholder"):
            tiny.embed_with_images(ids, [_image(8, 16)])

    def test_model_without_vision_rejects_images(self):
        """A model configured without a vision projector raises ValueError for images."""
        model = LlamaModel.from_seed(ModelConfig.tiny(vision=None), seed=0)
        with pytest.raises(ValueError, match="vision"):
            model.num_image_tokens(_image(8, 8))

    def test_text_model_embeds_without_an_image_token(self):
        """A model with no image_token_id embeds text as is and raises ValueError (not AttributeError) for images."""
        model = LlamaModel.from_seed(ModelConfig.tiny(vision=None, image_token_id=None), seed=0)
        ids = torch.tensor([65, 66, 67])
        with torch.inference_mode():
            torch.testing.assert_close(model.embed_with_images(ids, []), model.model.embed_tokens(ids))
        with pytest.raises(ValueError, match="vision"):
            model.embed_with_images(ids, [_image(8, 8)])
