"""Batched device sampling: one pass for every row equals sampling each row on its own,
seeded rows are reproducible and batch-invariant without a generator, the draw follows
the filtered distribution, the allowed-token mask applies to every row, and logprobs
come from the same logits; the step reads its tokens back once."""

from __future__ import annotations

import pytest
import torch

import engine.model.runner as runner_module
from engine import Engine, SamplingParams
from engine.model.sampling import (SamplingBatch, argmax_rows, gumbel_noise, logprob_tensors, sample, sample_tokens,
                                   seeded_key, token_logprobs)
from helpers import small_config

P = SamplingParams
MIXED = [P(temperature=0.7, seed=5), P(), P(temperature=1.0, top_k=5), P(temperature=1.2, top_p=0.8, seed=1),
         P(temperature=0.9, top_k=10, top_p=0.5, seed=2), P(logprobs=3), P(temperature=0.5, logprobs=2, seed=9)]


def _logits(rows: int, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


class TestBatchEqualsRows:
    def test_a_batch_samples_what_each_row_samples_alone(self):
        """Greedy, seeded, top-k, top-p and logprob rows together: each row's token is its token alone."""
        logits = _logits(len(MIXED))
        positions = list(range(3, 3 + len(MIXED)))
        torch.manual_seed(1)  # the unseeded rows' step key: the same draw for the batch and the rows
        together = sample(logits, MIXED, positions)
        seeded = [i for i, p in enumerate(MIXED) if p.seed is not None or p.greedy]
        for row in seeded:
            assert sample(logits[row : row + 1], [MIXED[row]], [positions[row]]) == [together[row]]
        assert together[1] == int(logits[1].argmax())

    def test_seeded_rows_do_not_depend_on_their_batch(self):
        """A seeded row draws the same token in any batch, at any row index, with any neighbours."""
        logits = _logits(5, seed=3)
        params = [P(temperature=1.0, seed=11)] * 5
        alone = [sample(logits[i : i + 1], [params[i]], [7])[0] for i in range(5)]
        assert sample(logits, params, [7] * 5) == alone
        shuffled = [4, 2, 0, 3, 1]
        assert sample(logits[shuffled], [params[i] for i in shuffled], [7] * 5) == [alone[i] for i in shuffled]

    def test_no_generator_is_built(self, monkeypatch):
        """Sampling seeded rows builds no torch.Generator (the noise is a hash of seed and position)."""
        built = []
        logits = _logits(4)

        class Counting(torch.Generator):
            def __init__(self, *args, **kwargs):
                built.append(1)
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(torch, "Generator", Counting)
        sample(logits, [P(temperature=1.0, seed=i) for i in range(4)], [0, 1, 2, 3])
        assert not built

    def test_the_seed_and_position_pick_the_noise(self):
        """Different positions or seeds give different keys; the same ones the same noise on every call."""
        keys = {seeded_key(s, p) for s in range(4) for p in range(50)}
        assert len(keys) == 200
        a = gumbel_noise(torch.tensor([seeded_key(3, 9)]), 1000)
        assert torch.equal(a, gumbel_noise(torch.tensor([seeded_key(3, 9)]), 1000))
        assert torch.isfinite(a).all()


class TestDistribution:
    def test_draws_follow_the_filtered_distribution(self):
        """4,000 seeded draws of a 4-token distribution land within 3 sigma of softmax(logits / T)."""
        logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
        probs = torch.softmax(logits / 0.8, -1)[0]
        n = 4000
        counts = torch.zeros(4)
        params = [P(temperature=0.8, seed=i) for i in range(n)]
        for token in sample(logits.expand(n, 4), params, [0] * n):
            counts[token] += 1
        sigma = (probs * (1 - probs) / n).sqrt()
        assert ((counts / n - probs).abs() < 3 * sigma + 1e-3).all()

    def test_top_k_and_top_p_keep_only_their_tokens(self):
        """top_k=2 draws only the two best tokens; top_p=0.4 only the best one (p = 0.50)."""
        logits = torch.tensor([[4.0, 3.0, 2.9, 2.8, -1.0]])
        n = 300
        top_k = sample(logits.expand(n, 5), [P(temperature=2.0, top_k=2, seed=i) for i in range(n)], [0] * n)
        assert set(top_k) == {0, 1}
        top_p = sample(logits.expand(n, 5), [P(temperature=1.0, top_p=0.4, seed=i) for i in range(n)], [0] * n)
        assert set(top_p) == {0}


class TestMaskSeam:
    def test_allowed_mask_applies_to_greedy_and_sampled_rows(self):
        """A row's allowed-token mask bans tokens for greedy and sampled rows alike."""
        logits = _logits(3)
        allowed = torch.zeros(3, 300, dtype=torch.bool)
        allowed[:, 100:110] = True
        params = [P(), P(temperature=1.0, seed=1), P(temperature=1.0, top_k=3, seed=2)]
        tokens = sample(logits, params, [0, 0, 0], allowed=allowed)
        assert all(100 <= t < 110 for t in tokens)
        assert tokens[0] == 100 + int(logits[0, 100:110].argmax())


class TestLogprobs:
    def test_logprobs_of_a_subset_of_rows(self):
        """Rows that asked get their token's log-softmax and top-k; the others None."""
        logits = _logits(len(MIXED), seed=4)
        tokens = sample(logits, MIXED, [0] * len(MIXED))
        entries = token_logprobs(logits, tokens, MIXED)
        reference = torch.log_softmax(logits, -1)
        for row, (p, entry) in enumerate(zip(MIXED, entries)):
            if p.logprobs is None:
                assert entry is None
                continue
            assert entry.token_id == tokens[row]
            assert entry.logprob == pytest.approx(float(reference[row, tokens[row]]), abs=1e-5)
            assert [i for i, _ in entry.top] == reference[row].topk(p.logprobs).indices.tolist()

    def test_device_tensors_need_no_host_tokens(self):
        """logprob_tensors works from the device's own tokens (no host list)."""
        logits = _logits(2)
        batch = SamplingBatch([P(logprobs=2), P(logprobs=2)], [0, 0])
        tokens = argmax_rows(logits)
        chosen, values, ids = logprob_tensors(logits, tokens, batch)
        assert chosen.shape == (2,) and values.shape == ids.shape == (2, 2)
        torch.testing.assert_close(chosen, values[:, 0])


class TestOneReadBack:
    @pytest.mark.asyncio
    async def test_each_step_reads_back_once(self, monkeypatch):
        """Every model step reads its tokens (and logprobs) back in one call, whatever the sampling."""
        calls = []
        original = runner_module.read_back

        def counting(parts):
            calls.append(len(parts))
            return original(parts)

        monkeypatch.setattr(runner_module, "read_back", counting)
        steps = []
        async with Engine(small_config()) as engine:
            engine.loop.step_observers.append(lambda batch, out: steps.append(len(out.tokens)))
            params = [P(max_new_tokens=4, ignore_eos=True), P(max_new_tokens=4, ignore_eos=True, temperature=0.9,
                                                               seed=3, logprobs=1)]
            for p in params:
                await engine.complete([1, 2, 3, 4, 5], p)
        sampling_steps = [n for n in steps if n]
        assert len(calls) == len(sampling_steps)
        assert 4 in calls  # a logprob step: tokens, chosen, values, ids in the same read


def test_sample_tokens_stays_on_the_device():
    """sample_tokens returns a device tensor (the runner reads it back with the rest of the step)."""
    logits = _logits(3)
    batch = SamplingBatch([P(temperature=1.0, seed=1), P(), P(temperature=0.5)], [0, 0, 0])
    tokens = sample_tokens(logits, batch)
    assert isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int64 and tokens.shape == (3,)
