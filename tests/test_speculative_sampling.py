"""The rejection sampler (`engine.speculative.rejection.verify`): greedy rows accept
exactly their argmaxes; sampled rows emit tokens distributed as plain sampling.

The distribution tests draw N independent rows (each its own noise key) from fixed
per-position distributions and compare each emitted token's empirical
frequencies with the exact probabilities. Hoeffding's inequality bounds a
false failure: P(|freq - p| >= eps) <= 2 exp(-2 N eps^2) per category; with
the sample sizes and eps below that is under 1e-20 for every test, even after
a union bound over every category checked (and the conditional sample size is
itself bounded below with the same inequality). The noise keys are fixed, so
the test is deterministic; the bound says that they were not chosen to pass.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.model.sampling import KEY, SamplingBatch, filtered_probs, gumbel_noise, salted_keys
from engine.speculative.rejection import verify

V = 6
LOGITS = torch.tensor([[1.0, 0.2, 1.5, -0.5, 0.7, 0.0],
                       [0.3, 1.1, -0.2, 1.4, 0.0, 0.6],
                       [0.0, 0.5, 0.9, 0.1, 1.2, -1.0]])
N = 40_000
EPS = 0.025


@functools.lru_cache(maxsize=4)
def _batch(rows: int, width: int, params: tuple = ()) -> tuple[SamplingBatch, torch.Tensor | None]:
    """`rows` rows of `width + 1` positions, each row with its own noise (as if each had its
    own seed: the keys are distinct hashes, set in one vectorized pass)."""
    one = SamplingParams(**dict(params))
    batch = SamplingBatch([one] * (rows * (width + 1)), [j for _ in range(rows) for j in range(width + 1)])
    if batch.fields is None:
        return batch, None
    fields = torch.from_numpy(batch.fields.copy())
    fields[KEY] = salted_keys(torch.arange(rows * (width + 1), dtype=torch.int64), 1234)
    return batch, fields


def _bound(n: int, eps: float, categories: int) -> float:
    return categories * 2 * math.exp(-2 * n * eps * eps)


def _target(params: dict) -> torch.Tensor:
    batch, fields = _batch(1, 2, tuple(sorted(params.items())))
    probs = filtered_probs(LOGITS, batch, fields)
    return probs / probs.sum(-1, keepdim=True)


def _check(tokens: np.ndarray, p: torch.Tensor, eps: float) -> None:
    freq = np.bincount(tokens, minlength=V) / len(tokens)
    assert np.abs(freq - p.numpy()).max() < eps, (freq, p)


def _emitted(accepted: torch.Tensor, final: torch.Tensor, drafts: torch.Tensor) -> list[np.ndarray]:
    """First and second emitted token per row (second: -1 when only one was emitted)."""
    a = accepted.numpy()
    d = drafts.numpy()
    f = final.numpy()
    first = np.where(a >= 1, d[:, 0], f)
    second = np.where(a >= 2, d[:, 1], np.where(a == 1, f, -1))
    return [first, second]


class TestGreedy:
    def test_greedy_rows_accept_their_argmaxes(self):
        """A greedy row accepts drafts while they equal the argmax and then emits the argmax."""
        argmax = LOGITS.argmax(-1)
        batch, fields = _batch(3, 2)
        logits = LOGITS.repeat(3, 1)
        drafts = torch.stack([argmax[:2], torch.tensor([int(argmax[0]), (int(argmax[1]) + 1) % V]),
                              torch.tensor([(int(argmax[0]) + 1) % V, int(argmax[1])])])
        accepted, final = verify(logits, batch, fields, drafts, torch.tensor([2, 2, 2]))
        assert accepted.tolist() == [2, 1, 0]
        assert final.tolist() == [int(argmax[2]), int(argmax[1]), int(argmax[0])]

    def test_rows_of_different_lengths(self):
        """Rows with fewer drafts (padding past them) are verified on their own positions only."""
        params = [SamplingParams()] * 4
        batch = SamplingBatch(params, [0, 1, 0, 0])
        argmax = LOGITS.argmax(-1)
        logits = torch.stack([LOGITS[0], LOGITS[1], LOGITS[2], LOGITS[0]])
        drafts = torch.tensor([[int(argmax[0])], [-1], [-1]])
        accepted, final = verify(logits, batch, None, drafts, torch.tensor([1, 0, 0]))
        assert accepted.tolist() == [1, 0, 0]
        assert final.tolist() == [int(argmax[1]), int(argmax[2]), int(argmax[0])]


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8)])
class TestDistribution:
    def test_point_mass_drafts(self, params):
        """Prompt-lookup drafts: each emitted token is distributed as plain sampling's."""
        p = _target(params)
        batch, fields = _batch(N, 2, tuple(sorted(params.items())))
        drafts = torch.tensor([[2, 3]]).repeat(N, 1)
        accepted, final = verify(LOGITS.repeat(N, 1), batch, fields, drafts, torch.full((N,), 2))
        first, second = _emitted(accepted, final, drafts)
        _check(first, p[0], EPS)
        given = second[first == 2]
        floor = int(0.8 * N * float(p[0, 2]))  # fewer: probability < 1e-100 when correct
        assert len(given) >= floor
        assert _bound(floor, 2 * EPS, V) + _bound(N, EPS, V) < 1e-20
        _check(given, p[1], 2 * EPS)

    def test_draft_model_drafts(self, params):
        """Drafts sampled from another distribution q: the ratio rule and the residual draw
        emit tokens distributed as plain sampling's."""
        p = _target(params)
        q = torch.softmax(torch.tensor([[0.0, 0.0, 2.0, 0.5, 0.0, 0.3], [0.4, 0.0, 0.0, 1.8, 0.0, 0.0]]), -1)
        keys = salted_keys(torch.arange(N, dtype=torch.int64)[:, None] * 2 + torch.arange(2), 7)
        drafts = (q.log()[None] + gumbel_noise(keys.reshape(-1), V).view(N, 2, V)).argmax(-1)
        batch, fields = _batch(N, 2, tuple(sorted(params.items())))
        accepted, final = verify(LOGITS.repeat(N, 1), batch, fields, drafts, torch.full((N,), 2),
                                 draft_probs=q[None].expand(N, 2, V).contiguous())
        first, second = _emitted(accepted, final, drafts)
        _check(first, p[0], EPS)
        # the second token follows an accepted d_0 = 2 (probability min(p_0(2), q_0(2))): it is p_1
        floor = int(0.8 * N * min(float(p[0, 2]), float(q[0, 2])))
        given = second[(first == 2) & (second >= 0)]
        assert len(given) >= floor
        _check(given, p[1], 2 * EPS)
        assert _bound(N, EPS, V) + _bound(floor, 2 * EPS, V) < 1e-20
