"""Verifying drafts: how many of a row's draft tokens the model accepts, and the
token it emits after them; on the logits' device, nothing read back.

A verify row is the request's last token followed by its k drafts
``d_0 .. d_{k-1}``; the model's logits at the row's position j predict the
token after it: ``d_j``, or past the last draft the bonus token. The logits
of a step's verify rows are flattened in row order (k_r + 1 per row) and
described by one `SamplingBatch` whose positions are the output indices
being predicted, so each position has the key plain sampling would give it.

The standard rule (Leviathan et al. 2023, Chen et al. 2023), for j = 0, 1, ...::

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
    at the first rejection emit a draw from norm(max(0, p_j - q_j)) and stop
    every draft accepted: emit a draw from p_k (the bonus token)

p is the target's distribution after temperature, top-k and top-p
(`filtered_probs`), q the draft's. What it emits is distributed exactly as
plain sampling from p, token after token.

Point-mass drafts (prompt lookup; a draft model's greedy rows): q = δ(d), so
the rule reads "accept with probability p(d), else draw from p without d".
One Gumbel-max draw t ~ p with the plain sampler's key does both: t = d has
probability p(d), and t given t != d is the residual draw. Such a row
accepts while ``t_j == d_j`` and emits the first t that differs (or the
bonus t): a seeded request's tokens are then those plain sampling draws, and
a greedy row's are its argmaxes (`tests/test_speculative_sampling.py`).
"""

from __future__ import annotations

import torch

from engine.model.sampling import (GREEDY, KEY, SamplingBatch, filtered_probs, gumbel_noise, hash_uniform,
                                   salted_keys, sample_tokens)

#: the salt of the acceptance draws (independent of the sampling noise of the same key)
ACCEPT_SALT = 0xACCE97


def verify(logits: torch.Tensor, batch: SamplingBatch, fields: torch.Tensor | None, drafts: torch.Tensor,
           num_drafts: torch.Tensor, draft_probs: torch.Tensor | None = None, *,
           sampled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts per row [S], the token emitted after them [S]), int64 on the device.

    `logits` [N, V] with N = sum(num_drafts + 1); `drafts` [S, K] int64 padded
    past each row's `num_drafts` (any value); `draft_probs` [S, K, V] the
    draft's distributions q (None: point-mass drafts for every row); `sampled` [N] the
    plain sampler's tokens of `logits` when the caller has them already."""
    device = logits.device
    rows, width = drafts.shape
    if fields is None and batch.fields is not None:
        fields = torch.from_numpy(batch.fields).to(device)
    span = torch.arange(width + 1, device=device)
    starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    index = starts[:, None] + torch.minimum(span[None, :], num_drafts[:, None])  # [S, K + 1]
    if sampled is None:
        sampled = sample_tokens(logits, batch, fields)
    sampled = sampled[index]  # t at every position
    valid = span[None, :width] < num_drafts[:, None]
    accept = (sampled[:, :width] == drafts) & valid
    general = draft_probs is not None and not batch.greedy and width > 0
    probs = None
    if general:
        assert fields is not None and draft_probs is not None
        probs = filtered_probs(logits, batch, fields)
        probs = probs / probs.sum(-1, keepdim=True)  # NOTE: top-p zeroes its tail without renormalizing
        safe = drafts.clamp(min=0)[..., None]
        p_d = probs[index[:, :width]].gather(2, safe)[..., 0]
        q_d = draft_probs.gather(2, safe)[..., 0]
        u = hash_uniform(salted_keys(fields[KEY][index[:, :width]], ACCEPT_SALT))
        by_ratio = (u * q_d < p_d) & valid
        sampled_rows = ~fields[GREEDY][starts].bool()
        accept = torch.where(sampled_rows[:, None], by_ratio, accept)
    accepted = accept.long().cumprod(1).sum(1)
    final = sampled.gather(1, accepted[:, None])[:, 0]
    if general:
        assert probs is not None and fields is not None and draft_probs is not None
        at = index.gather(1, accepted[:, None])[:, 0]  # the first rejected (or bonus) position
        q = draft_probs[torch.arange(rows, device=device), accepted.clamp(max=width - 1)]
        residual = (probs[at] - q).clamp(min=0.0)
        drawn = (residual.log() + gumbel_noise(fields[KEY][at], residual.shape[1])).argmax(dim=-1)
        rejected = sampled_rows & (accepted < num_drafts) & (residual.sum(-1) > 0)
        final = torch.where(rejected, drawn, final)
    return accepted, final
