"""The fused decode step against the reference path: the packed projections in
each weight layout, the norm with its residual add, RoPE in place from the
table; logits within 1e-4 of the unpacked reference (transformers' ops in its
order) and greedy ids equal, for every model shape the families use, through
chunked prefill and batched decode on paged KV."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engine import Engine, SamplingParams
from engine.model import rope as rope_module
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.layers import RMSNorm
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig, RopeScaling
from engine.model.projection import Projection, onednn_applies, resolve_layout
from resources.paging import size_class
from engine.model.rope import RotaryEmbedding, apply_rope, apply_rope_
from helpers import small_config
from resources.kv_buffers import KVBuffers

PAGE = 4
CONFIGS = {
    "llama-gqa": ModelConfig.tiny(),
    "moe": ModelConfig.tiny_moe(),
    "mha-bias-tied": ModelConfig.tiny(num_kv_heads=4, attention_bias=True, tie_word_embeddings=True),
    "qwen3-qk-norm": ModelConfig.tiny(qk_norm=True),
    "gemma": ModelConfig.tiny(gemma_norm=True, scale_embeddings=True, hidden_act="gelu_pytorch_tanh"),
    "windowed": ModelConfig.tiny(sliding_window=6, sliding_window_layers=(0,)),
    "mlp-bias-yarn": ModelConfig.tiny(mlp_bias=True, o_proj_bias=True, rope_scaling=RopeScaling(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
}
LAYOUTS = ["packed", "onednn"] if onednn_applies(torch.device("cpu"), torch.float32) else ["packed"]


def _decode_greedy(model: LlamaModel, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill the prompts in chunks of 5 (all in one step), then `steps` batched greedy decode steps on paged
    KV; returns each sequence's new ids and every step's logits stacked."""
    config = model.config
    kv = KVBuffers(num_layers=config.num_layers, num_pages=64, page_size=PAGE, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, dtype=model.dtype, device="cpu")
    order = list(range(1, 64))
    random.Random(1).shuffle(order)
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    pages: list[list[int]] = [[] for _ in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    all_logits = []
    while len(new[0]) < steps:
        counts = [min(5, len(t) - c) for t, c in zip(tokens, cached)]
        ids, positions, locs = [], [], []
        for b, n in enumerate(counts):
            end = cached[b] + n
            while len(pages[b]) * PAGE < end:
                pages[b].append(order.pop())
            ids += tokens[b][cached[b]:end]
            positions += range(cached[b], end)
            locs.append(torch.tensor([pages[b][i // PAGE] * PAGE + i % PAGE for i in range(end)]))
        meta = AttentionMetadata.from_locations(locs, counts)
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.tensor(positions), PagedAttention(kv, meta, config.layer_windows))
        rows = torch.tensor(counts).cumsum(0) - 1
        for b, n in enumerate(counts):
            cached[b] += n
            if cached[b] == len(tokens[b]):  # the sequence's last token: sample
                token = int(logits[rows[b]].argmax())
                tokens[b].append(token)
                new[b].append(token)
        all_logits.append(logits[rows])
    return new, torch.cat(all_logits)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_step_equals_the_reference(name, layout):
    """Chunked prefill then 12 batched decode steps of three prompts: the packed model's logits are within
    1e-4 of the reference's and its greedy ids are equal."""
    reference = LlamaModel.from_seed(CONFIGS[name], seed=4)
    fused = copy.deepcopy(reference)
    fused.pack(layout)
    assert reference.weight_layout is None and fused.weight_layout == layout
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 11, 17)]
    expected_ids, expected = _decode_greedy(reference, prompts, 12)
    got_ids, got = _decode_greedy(fused, prompts, 12)
    assert got_ids == expected_ids
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


class TestProjection:
    @pytest.mark.parametrize("tokens", [1, 2, 3, 9, 16, 37])
    @pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_projection_equals_the_matmul(self, layout, bias, tokens):
        """Each layout computes x @ W.T + b (float32 rounding apart), small and large matrices alike."""
        gen = torch.Generator().manual_seed(tokens)
        for features in ((64, 96), (256, 4096)):  # under and over SMALL_BYTES
            weight = torch.randn(features[1], features[0], generator=gen)
            b = torch.randn(features[1], generator=gen) if bias else None
            x = torch.randn(tokens, features[0], generator=gen)
            got = Projection(weight.t().contiguous(), b, layout)(x)
            expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
            assert got.shape == (tokens, features[1])  # padded rows (oneDNN) never leak out
            torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)

    def test_onednn_sees_few_shapes(self, monkeypatch):
        """oneDNN caches a primitive (with memory of its own) per input shape: every row count from 1 to
        512 reaches it as one of a few size classes, each at most a quarter larger."""
        seen: set[int] = set()
        real = torch.ops.mkldnn._linear_pointwise

        def spy(x, *args):
            seen.add(x.shape[0])
            return real(x, *args)

        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
        projection = Projection(torch.randn(64, 1024), None, LAYOUTS[-1])  # onednn where this build has it
        for rows in range(1, 513):
            assert projection(torch.randn(rows, 64)).shape == (rows, 1024)
        assert len(seen) <= 40 and all(size_class(n) == n for n in seen)

    def test_layout_names_resolve_or_fail_clearly(self):
        """auto picks onednn only where it applies; an unknown name or onednn for float16 raises ValueError."""
        cpu = torch.device("cpu")
        assert resolve_layout("auto", cpu, torch.float16) == "packed"
        assert resolve_layout("packed", cpu, torch.float32) == "packed"
        assert resolve_layout("auto", cpu, torch.float32) == ("onednn" if "onednn" in LAYOUTS else "packed")
        with pytest.raises(ValueError, match="one of"):
            resolve_layout("fast", cpu, torch.float32)
        with pytest.raises(ValueError, match="float16"):
            resolve_layout("onednn", cpu, torch.float16)

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_loading_weights_refreshes_every_layout(self, layout):
        """load_state_dict into a packed model changes what its fused forward computes, blocked copies included."""
        model = LlamaModel.from_seed(ModelConfig.tiny(), seed=1)
        model.pack(layout)
        other = LlamaModel.from_seed(ModelConfig.tiny(), seed=9)
        model.load_state_dict(other.state_dict())
        other.pack(layout)
        prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
        assert _decode_greedy(model, prompts, 4)[0] == _decode_greedy(other, prompts, 4)[0]

    def test_first_pack_decides(self):
        """pack() after pack('packed') keeps the packed layout and its tensors."""
        model = LlamaModel.from_seed(ModelConfig.tiny(), seed=1)
        model.pack("packed")
        qkv = model.model.layers[0].self_attn.qkv_t
        model.pack("auto")
        assert model.weight_layout == "packed" and model.model.layers[0].self_attn.qkv_t is qkv


class TestNormAndRope:
    @pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_norm_is_bitwise_the_reference(self, dtype, gemma):
        """F.rms_norm gives exactly transformers' op-by-op RMSNorm on CPU, float32 and bfloat16, Gemma's too;
        add_norm adds the residual in place first."""
        gen = torch.Generator().manual_seed(0)
        norm = RMSNorm(64, 1e-6, gemma=gemma).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=gen))
        x = torch.randn(7, 64, generator=gen).to(dtype)
        update = torch.randn(7, 64, generator=gen).to(dtype)
        assert torch.equal(norm(x), norm.reference(x))
        residual = x.clone()
        assert torch.equal(norm.add_norm(residual, update), norm.reference(x + update))
        assert torch.equal(residual, x + update)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_rope_in_place_is_bitwise_the_reference(self, dtype):
        """apply_rope_ on a strided view (q and k inside a fused qkv tensor) from table rows equals apply_rope
        with computed cos/sin bit for bit, and leaves the v part alone."""
        rotary = RotaryEmbedding(16, 10000.0, None, max_positions=512)
        positions = torch.tensor([0, 5, 100, 511, 37])
        qkv = torch.randn(5, 4 + 2 + 2, 16).to(dtype)
        cos, sin = rotary.cos_sin(positions, dtype)
        expected = apply_rope(qkv[:, :6], cos, sin)
        v = qkv[:, 6:].clone()
        apply_rope_(qkv[:, :6], rotary.lookup(positions, dtype))
        assert torch.equal(qkv[:, :6], expected) and torch.equal(qkv[:, 6:], v)

    def test_past_the_table_rows_are_computed(self, monkeypatch):
        """A model with more positions than MAX_TABLE_POSITIONS keeps no table; its rows are computed, equal."""
        rotary = RotaryEmbedding(16, 10000.0, None, max_positions=300)
        positions = torch.tensor([3, 299])
        table_rows = rotary.lookup(positions, torch.float32)
        monkeypatch.setattr(rope_module, "MAX_TABLE_POSITIONS", 256)
        untabled = RotaryEmbedding(16, 10000.0, None, max_positions=300)
        assert untabled.table(torch.device("cpu"), torch.float32) is None
        assert torch.equal(untabled.lookup(positions, torch.float32), table_rows)


@pytest.mark.anyio
async def test_engine_layouts_give_the_same_greedy_ids():
    """EngineConfig.weight_layout="packed" and the default give the same greedy ids for a mixed batch."""
    prompts = [[7, 8, 9, 10], list(range(30, 55)), [3]]
    outputs = []
    for layout in ("packed", "auto"):
        async with Engine(small_config(weight_layout=layout)) as engine:
            assert engine.parts.model.weight_layout == resolve_layout(layout, torch.device("cpu"), torch.float32)
            finals = [await engine.complete(p, SamplingParams(max_new_tokens=12)) for p in prompts]
            outputs.append([f.token_ids for f in finals])
    assert outputs[0] == outputs[1]
