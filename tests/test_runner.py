"""Tests for the runner's fast paths: packed weights, the blocked greedy argmax,
static decode steps (the CUDA-graph path, run eagerly), and greedy parity with
transformers on one checkpoint."""

from __future__ import annotations

import copy

import anyio
import pytest
import torch

from engine import Engine, SamplingParams
from engine.model.decode_graphs import DecodeGraphs, batch_buckets
from engine.model.dense_reference import dense_forward
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.sampling import argmax_rows
from tests.helpers import small_config

CONFIGS = [
    ModelConfig.tiny(),
    ModelConfig.tiny_moe(),
    ModelConfig.tiny(num_kv_heads=4, attention_bias=True, tie_word_embeddings=True),
]
IDS = ["tiny-gqa", "tiny-moe", "mha-bias-tied"]


def _packed_pair(config: ModelConfig) -> tuple[LlamaModel, LlamaModel]:
    plain = LlamaModel.from_seed(config, seed=2)
    packed = copy.deepcopy(plain)
    packed.pack()
    return plain, packed


class TestPack:
    @pytest.mark.parametrize("config", CONFIGS, ids=IDS)
    def test_packed_forward_equals_unpacked(self, config):
        """Packing changes layouts, not results: logits agree (1e-4, as the paged tests) and greedy ids are equal."""
        plain, packed = _packed_pair(config)
        tokens = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(0)).tolist()
        expected, got = dense_forward(plain, tokens), dense_forward(packed, tokens)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))

    @pytest.mark.parametrize("config", CONFIGS, ids=IDS)
    def test_state_dict_keeps_names_shapes_and_values(self, config):
        """The state dict after packing has the Hugging Face names, shapes and values of before."""
        plain, packed = _packed_pair(config)
        before, after = plain.state_dict(), packed.state_dict()
        assert list(after) == list(before)
        for name, tensor in before.items():
            assert torch.equal(after[name], tensor), name

    def test_weights_are_views_of_the_packed_tensors(self):
        """No weight is held twice: q/k/v, gate/up and the LM head share the packed storage."""
        _, packed = _packed_pair(ModelConfig.tiny())
        layer = packed.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        for module, packed_t in ((attn.q_proj, attn.qkv_t), (attn.v_proj, attn.qkv_t), (mlp.up_proj, layer.gate_up_t),
                                 (packed.lm_head, packed.head_t)):
            assert module.weight.untyped_storage().data_ptr() == packed_t.untyped_storage().data_ptr()

    def test_loading_into_a_packed_model_updates_the_packed_tensors(self):
        """load_state_dict after pack changes what the packed forward computes."""
        _, packed = _packed_pair(ModelConfig.tiny())
        other = LlamaModel.from_seed(ModelConfig.tiny(), seed=9)
        packed.load_state_dict(other.state_dict())
        tokens = list(range(1, 20))
        torch.testing.assert_close(dense_forward(packed, tokens), dense_forward(other, tokens), atol=1e-5, rtol=1e-5)

    def test_pack_is_idempotent(self):
        """A second pack keeps the same packed tensors."""
        _, packed = _packed_pair(ModelConfig.tiny())
        qkv = packed.model.layers[1].self_attn.qkv_t
        packed.pack()
        assert packed.model.layers[1].self_attn.qkv_t is qkv


class TestArgmaxRows:
    @pytest.mark.parametrize("vocab", [3, 127, 128, 300, 32000, 32003])
    def test_equals_torch_argmax(self, vocab):
        """Random rows, any width: the same index as torch.argmax."""
        logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))

    def test_ties_take_the_first_index(self):
        """Equal maxima in different blocks and within a block: the first one wins, as in torch.argmax."""
        logits = torch.zeros(4, 1000)
        logits[0, [5, 700]] = 3.0
        logits[1, [130, 131]] = 2.0
        logits[2, [999, 998]] = 1.0
        logits[3] = float("-inf")
        assert argmax_rows(logits).tolist() == logits.argmax(-1).tolist() == [5, 130, 998, 0]


class TestBuckets:
    def test_batch_buckets_cover_every_size(self):
        """vLLM-style sizes: 1, 2, 4, 8, multiples of 16, and the maximum itself."""
        assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
        assert batch_buckets(1) == [1]

    def test_graphs_are_keyed_by_batch_bucket_alone(self, monkeypatch):
        """capture_all captures one graph per batch bucket (no context buckets), and a step of any
        length replays its rows' bucket: short and max_context-long rows take the same graph."""
        engine_parts = _parts(max_running=20, max_context=256)
        captured: list[int] = []

        class Replay:
            def __init__(self, bucket):
                self.bucket, self.replays = bucket, 0

            def replay(self):
                self.replays += 1

        def fake_capture(self, bucket):
            captured.append(bucket)
            logits = torch.zeros(bucket, 8)
            return _Captured(Replay(bucket), logits, logits.argmax(-1), None)

        from engine.model.decode_graphs import _Captured

        monkeypatch.setattr(DecodeGraphs, "_capture", fake_capture)
        runner = engine_parts.runner
        graphs = DecodeGraphs(runner.model, runner.kv, runner.slots, runner.device, max_batch=20)
        graphs.capture_all()
        assert captured == [1, 2, 4, 8, 16, 20] and sorted(graphs._graphs) == captured
        for rows, bucket in ((1, 1), (3, 4), (9, 16), (17, 20)):
            logits, tokens, routing = graphs.run(rows)
            assert logits.shape[0] == rows and routing is None
            assert graphs._graphs[bucket].graph.replays >= 1
        assert graphs.run(21) is None


def _parts(**overrides):
    from engine.runtime.assembly import build_parts

    return build_parts(small_config(**overrides))


async def _decode_batches(engine, prompts, params):
    """Run `prompts` to completion; for every decode-only batch, run the static
    (CUDA-graph) step first, then the eager one, and record what each did."""
    runner = engine.parts.runner
    table = engine.parts.kv_pool.slots.req_to_token
    original = runner.step
    graphs = DecodeGraphs(runner.model, runner.kv, runner.slots, runner.device, max_batch=runner.slots.capacity,
                          layer_windows=runner.attention_factory.layer_windows, capture=False)
    seen = []

    def step(seqs):
        if not all(s.num_tokens == 1 for s in seqs):
            return original(seqs)
        new_locs = {int(table[runner.slot_of(s.request), s.start]) for s in seqs}
        before = runner.kv.k[0].clone()
        runner.graphs = graphs
        static = original(seqs)
        runner.graphs = None
        written = (runner.kv.k[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
        out = original(seqs)
        seen.append({"static": static.tokens, "eager": out.tokens, "written": set(written), "new_locs": new_locs,
                     "rows": len(seqs), "static_logprobs": static.logprobs, "eager_logprobs": out.logprobs})
        return out

    runner.step = step
    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(engine.complete, prompt, params)
    return seen


class TestStaticDecode:
    @pytest.mark.asyncio
    async def test_static_step_gives_the_eager_tokens(self):
        """The CUDA-graph step's code, run eagerly: same tokens as the eager runner, padding to a bucket included."""
        async with Engine(small_config(max_running=8)) as engine:
            prompts = [[7 + i, 3, 9, 200 - i, 5] * (1 + i) for i in range(3)]  # three rows: bucket 4
            seen = await _decode_batches(engine, prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert seen and all(record["static"] == record["eager"] for record in seen)
        assert any(record["rows"] == 3 for record in seen)

    @pytest.mark.asyncio
    async def test_static_step_samples_and_reports_logprobs_like_the_eager_step(self):
        """Seeded sampling and logprobs run on the graph's logits: the same tokens and logprobs as eager."""
        params = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.8, top_k=20, seed=3, logprobs=2)
        async with Engine(small_config(max_running=8)) as engine:
            seen = await _decode_batches(engine, [[4, 5, 6], [7, 8, 9, 10]], params)
        assert seen
        for record in seen:
            assert record["static"] == record["eager"]
            for a, b in zip(record["static_logprobs"], record["eager_logprobs"], strict=True):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)

    @pytest.mark.asyncio
    async def test_padding_rows_write_only_the_padding_page(self):
        """A padded static step writes K/V at its real rows' new locations and in page 0, nowhere else."""
        async with Engine(small_config(max_running=8)) as engine:
            page = engine.parts.kv_buffers.page_size
            prompts = [[11, 12, 13, 14, 15, 16, 17][: 3 + i] for i in range(3)]
            seen = await _decode_batches(engine, prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert any(record["rows"] == 3 for record in seen)
        for record in seen:
            assert record["written"] <= record["new_locs"] | set(range(page))
            assert record["new_locs"] <= record["written"]

    @pytest.mark.asyncio
    async def test_a_failed_capture_falls_back_to_eager_steps(self):
        """A graph capture that raises (here: no CUDA) disables the graphs; every step runs eagerly."""
        async with Engine(small_config(max_running=4)) as engine:
            runner = engine.parts.runner
            graphs = DecodeGraphs(runner.model, runner.kv, runner.slots, runner.device, max_batch=4, capture=True)
            graphs.capture_all()
            runner.graphs = graphs
            out = await engine.complete([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=5, ignore_eos=True))
            runner.graphs = None
            expected = await engine.complete([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=5, ignore_eos=True))
        assert graphs.disabled and not graphs._graphs and out.token_ids == expected.token_ids


class TestTransformersParity:
    @pytest.mark.asyncio
    async def test_greedy_ids_equal_generate_on_one_checkpoint(self, tmp_path):
        """A checkpoint written by save_pretrained: the engine's greedy ids equal transformers' generate()."""
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                          bos_token_id=256, eos_token_id=257, pad_token_id=258)
        hf = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():  # larger weights than the default init, so greedy decoding depends on context
            for param in hf.parameters():
                if param.dim() == 2:
                    param.normal_(0.0, param.shape[1] ** -0.5)
        hf.save_pretrained(tmp_path)
        prompts = [[(13 * i + 7 * j) % 250 + 1 for j in range(9 + 5 * i)] for i in range(3)]
        generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                                   eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    generation_config=generation)[0, len(p):].tolist() for p in prompts]
        async with Engine(small_config(model=str(tmp_path), max_running=4)) as engine:
            outputs = []
            async with anyio.create_task_group() as tg:
                for p in prompts:
                    tg.start_soon(lambda p=p: _append(outputs, engine, p))
        by_prompt = {tuple(p): ids for p, ids in outputs}
        assert [by_prompt[tuple(p)] for p in prompts] == expected
        assert len({tuple(ids) for ids in expected}) == len(expected)


async def _append(outputs, engine, prompt):
    out = await engine.complete(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    outputs.append((prompt, out.token_ids))
