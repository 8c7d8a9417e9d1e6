"""Sliding windows in paged attention: any mix of decode rows and prefill
chunks, over page-aligned or scattered locations, attends each query to
exactly the last W positions (itself included), per layer; and the paged
model forward with windows equals the dense windowed oracle, which the
family parity tests tie to transformers."""

from __future__ import annotations

import json
import random

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import InvalidConfig
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.checkpoint import save_checkpoint
from engine.model.dense_reference import dense_forward
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from hisparse import HiSparseConfig
from naive_attention import naive_attention as _naive
from resources.kv_buffers import KVBuffers

PAGE = 4


def _kv(num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int) -> KVBuffers:
    return KVBuffers(num_layers=num_layers, num_pages=num_pages, page_size=PAGE, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype=torch.float32, device="cpu")


class TestPagedWindow:
    @settings(max_examples=30, deadline=None)
    @given(
        shapes=st.lists(st.tuples(st.integers(1, 7), st.integers(0, 14)), min_size=1, max_size=4),
        window=st.integers(1, 10),
        aligned=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_each_query_sees_exactly_its_window(self, shapes, window, aligned, seed):
        """Layer 0 (windowed) equals a naive windowed softmax; layer 1 (full) a naive causal one."""
        gen = torch.Generator().manual_seed(seed)
        kv = _kv(num_layers=2, num_pages=64, num_kv_heads=2, head_dim=8)
        for buf in (*kv.k, *kv.v):
            buf.normal_(generator=gen)
        pages = (torch.randperm(63, generator=gen) + 1).tolist()
        context_locs = []
        scattered = (torch.randperm(kv.num_tokens - PAGE, generator=gen) + PAGE).tolist()
        for q_len, old in shapes:
            length = old + q_len
            if aligned:  # whole pages, as the engine's allocator gives them
                own = [pages.pop() for _ in range(-(-length // PAGE))]
                context_locs.append(torch.tensor([own[p // PAGE] * PAGE + p % PAGE for p in range(length)]))
            else:
                context_locs.append(torch.tensor(scattered[:length]))
                scattered = scattered[length:]
        meta = AttentionMetadata.from_locations(context_locs, [q_len for q_len, _ in shapes])
        q = torch.randn(meta.num_tokens, 4, 8, generator=gen)
        k = torch.randn(meta.num_tokens, 2, 8, generator=gen)
        v = torch.randn(meta.num_tokens, 2, 8, generator=gen)
        attention = PagedAttention(kv, meta, layer_windows=(window, None))
        for layer, layer_window in ((0, window), (1, None)):
            out = attention.attend(layer, q, k, v)
            expected = _naive(q, kv.k[layer], kv.v[layer], meta, layer_window)
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# (sequence index, new tokens) per step: chunked prefills, batched decode, mixes of both.
_STEPS = [[(0, 7), (1, 5)], [(1, 8), (0, 1), (2, 1)], [(0, 1), (1, 1), (2, 6)], [(2, 9), (0, 1)],
          [(0, 1), (1, 1), (2, 1)], [(1, 3), (0, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]


def test_paged_model_forward_matches_dense_windowed_forward():
    """Chunked prefill and decode over scattered pages, past a 5-token window in layers 1 and 3, give the dense logits."""
    config = ModelConfig.tiny(sliding_window=5, sliding_window_layers=(1, 3), vision=None, image_token_id=None)
    model = LlamaModel.from_seed(config, seed=2)
    rng = random.Random(3)
    tokens = [[rng.randrange(256) for _ in range(32)] for _ in range(3)]
    cached = [0, 0, 0]
    page_of: list[list[int]] = [[], [], []]
    free = list(range(1, 64))
    rng.shuffle(free)
    kv = _kv(config.num_layers, 64, config.num_kv_heads, config.head_dim)
    for step in _STEPS:
        ids, positions, context, q_lens = [], [], [], []
        for seq, count in step:
            end = cached[seq] + count
            while len(page_of[seq]) * PAGE < end:
                page_of[seq].append(free.pop())
            ids += tokens[seq][cached[seq] : end]
            positions += range(cached[seq], end)
            context.append(torch.tensor([page_of[seq][p // PAGE] * PAGE + p % PAGE for p in range(end)]))
            q_lens.append(count)
        meta = AttentionMetadata.from_locations(context, q_lens)
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.tensor(positions), PagedAttention(kv, meta, config.layer_windows))
        row = 0
        for seq, count in step:
            end = cached[seq] + count
            dense = dense_forward(model, tokens[seq][:end])[cached[seq] : end]
            torch.testing.assert_close(logits[row : row + count], dense, atol=1e-4, rtol=1e-4)
            row += count
            cached[seq] = end
    assert max(cached) > 3 * config.sliding_window


class TestEngineWindow:
    @pytest.fixture
    def windowed_checkpoint(self, tmp_path):
        config = ModelConfig.tiny(sliding_window=6, vision=None, image_token_id=None)
        model = LlamaModel.from_seed(config, seed=0)
        # NOTE: to_hf_config writes no windows; save a window-free config, then make it Mistral's.
        directory = save_checkpoint(model, ModelConfig.tiny(vision=None, image_token_id=None), tmp_path)
        hf = json.loads((directory / "config.json").read_text())
        hf.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=6)
        (directory / "config.json").write_text(json.dumps(hf))
        return directory, model

    @pytest.mark.anyio
    async def test_engine_output_equals_the_windowed_oracle_past_the_window(self, windowed_checkpoint):
        """An engine on a windowed checkpoint decodes exactly the dense windowed oracle's greedy ids, 5x past the window."""
        directory, model = windowed_checkpoint
        prompt = list(b"sliding windows forget")
        async with Engine(EngineConfig(model=str(directory), page_size=4, num_kv_pages=64, max_context=96,
                                       max_prefill_tokens=8, use_entry_points=False)) as engine:
            final = await engine.complete(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(dense_forward(model, ids)[-1].argmax()))
        assert final.token_ids == ids[len(prompt):]

    @pytest.mark.anyio
    async def test_pages_outside_the_window_are_freed_while_decoding(self, windowed_checkpoint):
        """Decoding far past the window holds a bounded number of pages, and the ids still equal the oracle."""
        directory, model = windowed_checkpoint
        prompt = list(b"windows")
        held: list[int] = []
        async with Engine(EngineConfig(model=str(directory), page_size=4, num_kv_pages=64, max_context=96,
                                       use_entry_points=False)) as engine:
            engine.loop.step_observers.append(lambda batch, out: held.append(engine.memory_report().pools["kv_pages"].held))
            final = await engine.complete(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
            report = engine.check_memory()
        ids = list(prompt)
        for _ in range(48):
            ids.append(int(dense_forward(model, ids)[-1].argmax()))
        assert final.token_ids == ids[len(prompt):]
        # the prompt's whole page is kept (it can be cached) + the window spans at most 3 pages of 4 + the new one
        assert max(held) <= 1 + 3 + 1 and len(held) >= 48
        assert report.pools["kv_pages"].evictable == 1  # the prompt's page is cached, the freed ones could not be

    def test_hisparse_is_refused_for_a_windowed_model(self, windowed_checkpoint):
        """HiSparse's top-k attention ignores windows, so Engine() refuses the combination naming hisparse."""
        directory, _ = windowed_checkpoint
        config = EngineConfig(model=str(directory), page_size=4, num_kv_pages=64, max_context=96,
                              hisparse=HiSparseConfig(top_k=8, device_buffer_size=16), use_entry_points=False)
        with pytest.raises(InvalidConfig, match="EngineConfig.hisparse"):
            anyio.run(_enter, config)


async def _enter(config: EngineConfig) -> None:
    async with Engine(config):
        pass
