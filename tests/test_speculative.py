"""Speculative decoding through the engine: greedy ids equal plain decoding's (the eager
reference) with prompt lookup and with a draft model, on the tiny model and on a
checkpoint; seeded prompt-lookup sampling equals plain seeded sampling token for token;
a draft model's sampled output follows the model's exact distribution; the counters
and the per-request stats add up.
"""

from __future__ import annotations

import math

import anyio
import numpy as np
import pytest
import torch

import parity_models as pm
from engine import Engine, EngineConfig, SamplingParams
from engine.speculative import SpeculativeConfig
from helpers import run_all, small_config

REPEATING = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]
PROMPTS = [REPEATING, [40, 41, 42], list(range(60, 81)), [3, 3, 3, 3, 3, 3]]
NGRAM = SpeculativeConfig(num_tokens=4)
TINY_DRAFT = SpeculativeConfig(method="draft_model", draft_model="tiny", num_tokens=3)


async def _ids(config: EngineConfig, prompts, max_new: int = 24) -> tuple[list[list[int]], Engine]:
    async with Engine(config) as engine:
        ids = await run_all(engine, prompts, max_new)
    return ids, engine


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 2-layer Llama checkpoint (the target) and two drafts with its tokenizer: `noisy` (its
    weights plus noise: agrees with it often, not always) and `sharp` (its LM head times 6:
    the same ranking, a sharper distribution, so sampled drafts are rejected often)."""
    target, noisy, sharp = (tmp_path_factory.mktemp(name) for name in ("target", "noisy", "sharp"))
    model = pm.write_checkpoint(target, "llama", seed=0)
    draft = pm.write_checkpoint(noisy, "llama", seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.08 * param.std() * torch.randn(param.shape, generator=generator))
    draft.save_pretrained(noisy)
    draft = pm.write_checkpoint(sharp, "llama", seed=0)
    with torch.no_grad():
        draft.lm_head.weight.mul_(6.0)
    draft.save_pretrained(sharp)
    return target, noisy, sharp, model


def _checkpoint_config(directory, **overrides) -> EngineConfig:
    return small_config(model=str(directory), max_context=128, **overrides)


class TestGreedyIdentity:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("spec", [NGRAM, TINY_DRAFT], ids=["ngram", "tiny-draft"])
    async def test_tiny_model(self, spec):
        """Every prompt of one batch decodes the same ids with speculation as without; drafts were verified."""
        plain, _ = await _ids(small_config(), PROMPTS)
        speculative, engine = await _ids(small_config(speculative=spec), PROMPTS)
        assert speculative == plain
        assert engine.stats.spec_draft_tokens > 0 and engine.stats.spec_accepted_tokens > 0
        assert engine.stats.steps < 24 + 4  # fewer steps than one per token
        if spec is TINY_DRAFT:  # its own draft, batched: every greedy draft is the model's own argmax
            assert engine.stats.spec_accepted_tokens == engine.stats.spec_draft_tokens

    @pytest.mark.asyncio
    @pytest.mark.parametrize("method", ["ngram", "draft_model"])
    async def test_checkpoint(self, llama, method):
        """A checkpoint the test writes, its draft another checkpoint with the same vocabulary."""
        target, draft, _, _ = llama
        spec = SpeculativeConfig(method=method, num_tokens=3, draft_model=str(draft) if method != "ngram" else None)
        prompts = [p[0:1] + p for p in pm.ID_PROMPTS]
        plain, _ = await _ids(_checkpoint_config(target), prompts, pm.MAX_NEW)
        speculative, engine = await _ids(_checkpoint_config(target, speculative=spec), prompts, pm.MAX_NEW)
        assert speculative == plain
        assert engine.stats.spec_draft_tokens > 0


class TestConstrained:
    @pytest.mark.asyncio
    async def test_grammar_rows_share_a_verify_step(self):
        """A constrained request decodes plainly (its mask applies) while others in its batch speculate."""
        from engine import Constraint

        constrained = SamplingParams(max_new_tokens=6, constraint=Constraint.regex("[0-9]{6}"))
        free = SamplingParams(max_new_tokens=24, ignore_eos=True)

        async def both(config: EngineConfig) -> tuple[list[list[int]], Engine]:
            async with Engine(config) as engine:
                outs: list = [None, None]

                async def one(i: int, prompt, params) -> None:
                    outs[i] = await engine.complete(prompt, params)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(one, 0, "digits: ", constrained)
                    tg.start_soon(one, 1, REPEATING, free)
            return [o.token_ids for o in outs], engine

        plain, _ = await both(small_config())
        speculative, engine = await both(small_config(speculative=TINY_DRAFT))
        assert speculative == plain and engine.stats.spec_accepted_tokens > 0
        assert bytes(speculative[0]).decode().isdigit()


class TestSampling:
    @pytest.mark.asyncio
    async def test_seeded_prompt_lookup_equals_plain_sampling(self):
        """Prompt-lookup drafts are verified with plain sampling's own draws: same seed, same tokens."""
        params = [SamplingParams(max_new_tokens=24, temperature=t, top_k=k, seed=s, ignore_eos=True)
                  for s, (t, k) in enumerate([(1.0, 0), (0.6, 0), (0.3, 5), (1.0, 3)])]

        async def sample(config: EngineConfig) -> tuple[list[list[int]], Engine]:
            async with Engine(config) as engine:
                outs = [await engine.complete(REPEATING, p) for p in params]
            return [o.token_ids for o in outs], engine

        plain, _ = await sample(small_config())
        speculative, engine = await sample(small_config(speculative=NGRAM))
        assert speculative == plain
        assert engine.stats.spec_accepted_tokens > 0

    @pytest.mark.asyncio
    async def test_draft_model_sampling_follows_the_models_distribution(self, llama):
        """N seeded 3-token samples (top-k 2, the sharp draft): every outcome's
        frequency is within EPS of its exact probability under the target. Hoeffding: a correct
        sampler fails with probability at most 2 * 8 * exp(-2 N EPS^2) < 1e-20 (the seeds are
        fixed: the run is deterministic)."""
        target, _, draft, model = llama
        n, eps, per = 2500, 0.1, 50
        assert 16 * math.exp(-2 * n * eps * eps) < 1e-20
        prompt = [pm.BOS_ID, 40, 41, 42, 43, 50]
        exact = _exact_top2(model, prompt, 3)
        spec = SpeculativeConfig(method="draft_model", draft_model=str(draft), num_tokens=2)
        config = _checkpoint_config(target, speculative=spec, max_running=64, num_kv_pages=512)
        counts: dict[tuple[int, ...], int] = {}
        async with Engine(config) as engine:
            async def some(first_seed: int) -> None:  # `per` sequences, seeds first_seed + i
                params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=2, seed=first_seed, n=per,
                                        ignore_eos=True)
                async for out in engine.generate(prompt, params):
                    if out.finished:
                        key = tuple(out.token_ids)
                        counts[key] = counts.get(key, 0) + 1

            with anyio.fail_after(240):
                async with anyio.create_task_group() as tg:
                    for first in range(0, n, per):
                        tg.start_soon(some, first)
        assert sum(counts.values()) == n
        stats = engine.stats
        assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
        assert set(counts) <= set(exact)
        worst = max(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
        assert worst < eps, (counts, exact)


def _exact_top2(model, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """Every `length`-token continuation's probability under top-k 2 sampling at temperature 1."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in out.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1].double()
            top = torch.topk(logits, 2)
            probs = torch.softmax(top.values, -1)
            for token, p in zip(top.indices.tolist(), probs.tolist()):
                grown[seq + (token,)] = prob * p
        out = grown
    return out


class TestStats:
    @pytest.mark.asyncio
    async def test_per_request_stats_and_counters_add_up(self):
        """The final output's acceptance and tokens per step agree with the engine's counters."""
        async with Engine(small_config(speculative=TINY_DRAFT)) as engine:
            out = await engine.complete(REPEATING, SamplingParams(max_new_tokens=20, ignore_eos=True))
            plain = await engine.complete(REPEATING, SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                                    speculative=False))
        spec = out.speculation
        assert spec is not None and spec.draft_tokens == engine.stats.spec_draft_tokens
        assert spec.accepted_tokens == engine.stats.spec_accepted_tokens
        assert spec.acceptance_rate == 1.0  # the tiny model is its own draft: greedy drafts all accepted
        assert spec.tokens_per_step > 2.5
        assert plain.token_ids == out.token_ids
        assert plain.speculation is not None and plain.speculation.draft_tokens == 0
        assert plain.speculation.tokens_per_step == 1.0
        assert np.isclose(spec.tokens_per_step, 20 / spec.steps)

    @pytest.mark.asyncio
    async def test_metrics_count_drafts(self):
        """/metrics shows the verify steps, draft tokens and accepted tokens the engine counted."""
        from prometheus_client.parser import text_string_to_metric_families

        from http_helpers import serving

        async with serving(speculative=TINY_DRAFT) as (engine, client):
            body = {"input_ids": REPEATING, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
            assert (await client.post("/generate", json=body)).status_code == 200
            text = (await client.get("/metrics")).text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        stats = engine.stats
        assert stats.spec_accepted_tokens > 0
        assert samples["kvlife:spec_decode_num_drafts_total"] == stats.spec_verify_steps
        assert samples["kvlife:spec_decode_num_draft_tokens_total"] == stats.spec_draft_tokens
        assert samples["kvlife:spec_decode_num_accepted_tokens_total"] == stats.spec_accepted_tokens

    @pytest.mark.asyncio
    async def test_a_verify_step_streams_one_chunk(self):
        """The tokens of one verify step arrive in one chunk; chunks add up to the final ids and text."""
        async with Engine(small_config(speculative=TINY_DRAFT)) as engine:
            chunks = [out async for out in engine.generate("abcabcabcabc", SamplingParams(max_new_tokens=20,
                                                                                           ignore_eos=True))]
        final = chunks[-1]
        assert [t for c in chunks for t in c.new_token_ids] == final.token_ids
        assert "".join(c.new_text for c in chunks) == final.text
        assert max(len(c.new_token_ids) for c in chunks) > 1 and len(chunks) < 20
