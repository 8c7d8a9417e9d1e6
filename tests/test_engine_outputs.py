"""The engine's outputs are the model's: oracles against a dense recompute,
prefix-cache reuse, chunked prefill, retraction under pressure, checkpoints."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams
from engine.model.checkpoint import save_checkpoint
from engine.model.dense_reference import dense_forward
from engine.model.model_config import ModelConfig
from engine.model.llama import LlamaModel
from helpers import run_all, small_config

PROMPTS = [[7, 3, 99, 12], list(range(40, 71)), [5] * 13, list(range(200, 209)) * 3]


def _dense_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recompute: no paging, no cache."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(dense_forward(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def expected():
    model = LlamaModel.from_seed(ModelConfig.tiny(), 0)
    return [_dense_greedy(model, p, 12) for p in PROMPTS]


class TestDenseOracle:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("overrides", [
        {},
        {"max_prefill_tokens": 5},
        {"prefix_cache": False},
        {"page_size": 1, "num_kv_pages": 1024},
        {"page_size": 16, "num_kv_pages": 64},
    ], ids=["default", "chunked-prefill", "no-prefix-cache", "page-1", "page-16"])
    async def test_greedy_matches_dense_recompute(self, expected, overrides):
        """Batched paged greedy decoding equals a dense full recompute, token for token."""
        async with Engine(small_config(**overrides)) as engine:
            got = await run_all(engine, PROMPTS, 12)
        assert got == expected

    @pytest.mark.asyncio
    async def test_same_output_alone_and_batched(self, expected):
        """A request's greedy output does not depend on what it was batched with."""
        async with Engine(small_config()) as engine:
            alone = [(await engine.complete(p, SamplingParams(max_new_tokens=12, ignore_eos=True))).token_ids
                     for p in PROMPTS]
        assert alone == expected


class TestPrefixCache:
    @pytest.mark.asyncio
    async def test_shared_prefix_is_reused_and_output_unchanged(self):
        """A second request sharing a prompt prefix reuses cached pages and produces the same output."""
        prompt = list(range(1, 30))
        async with Engine(small_config()) as engine:
            first = await engine.complete(prompt, SamplingParams(max_new_tokens=6))
            second = await engine.complete(prompt, SamplingParams(max_new_tokens=6))
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 28  # whole pages, leaving the last token to compute
        assert second.token_ids == first.token_ids

    @pytest.mark.asyncio
    async def test_seeded_sampling_is_reproducible(self):
        """The same seed gives the same sampled tokens, batched or not."""
        params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
        async with Engine(small_config()) as engine:
            a = await engine.complete([1, 2, 3], params)
            b = await engine.complete([1, 2, 3], params)
        assert a.token_ids == b.token_ids


class TestPressure:
    @pytest.mark.asyncio
    async def test_retraction_keeps_greedy_output(self, expected):
        """More requests than the pool holds: queueing and retraction, outputs unchanged, no leak."""
        config = small_config(num_kv_pages=30, max_context=96, max_running=8)
        prompts = PROMPTS * 2
        async with Engine(config) as engine:
            got = await run_all(engine, prompts, 12)
            retractions = engine.stats.retractions
        assert got == expected * 2
        assert retractions > 0


class TestCheckpoint:
    @pytest.mark.asyncio
    async def test_engine_serves_a_local_checkpoint(self, tmp_path, expected):
        """A checkpoint written to disk and loaded by path generates what the seeded model does."""
        config = ModelConfig.tiny()
        save_checkpoint(LlamaModel.from_seed(config, 0), config, tmp_path)
        async with Engine(small_config(model=str(tmp_path))) as engine:
            got = await run_all(engine, PROMPTS[:2], 12)
        assert got == expected[:2]


class TestBackends:
    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["trio"])
    async def test_trio_smoke(self, anyio_backend, expected):
        """The engine runs on trio too: streaming, abort and a clean leak check."""
        async with Engine(small_config()) as engine:
            got = await run_all(engine, PROMPTS[:2], 12)
            stream = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=50), request_id="x")
            await stream.__anext__()
            assert await engine.abort("x")
            outputs = [o async for o in stream]
            assert await engine.health_check()
            await engine.wait_idle(5)
        assert got == expected[:2]
        assert outputs[-1].finish_reason.name == "ABORT"


class TestLogprobs:
    @pytest.mark.asyncio
    async def test_logprobs_are_the_models_distribution(self):
        """logprobs=k: each token's log probability under the dense oracle's logits, and its k best, best first."""
        import torch

        from engine.model.dense_reference import dense_forward

        prompt = [5, 6, 7, 8]
        async with Engine(small_config()) as engine:
            outputs = [o async for o in engine.generate(prompt, SamplingParams(max_new_tokens=4, logprobs=3))]
            model = engine.parts.model
        entries = [e for o in outputs for e in (o.logprobs or ())]
        tokens = outputs[-1].token_ids
        assert [e.token_id for e in entries] == tokens
        logits = dense_forward(model, prompt + tokens)
        for i, entry in enumerate(entries):
            expected = torch.log_softmax(logits[len(prompt) - 1 + i].double(), -1)
            assert abs(entry.logprob - float(expected[entry.token_id])) < 1e-4
            assert [t for t, _ in entry.top] == torch.topk(expected, 3).indices.tolist()
            assert entry.top[0][0] == entry.token_id  # greedy: the sampled token is the best

    @pytest.mark.asyncio
    async def test_no_logprobs_unless_asked(self):
        """A request that asks for none gets None, and costs nothing."""
        async with Engine(small_config()) as engine:
            final = await engine.complete([5, 6, 7], SamplingParams(max_new_tokens=2))
        assert final.logprobs is None
