"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws from a generator seeded by (seed, output position),
so its tokens do not depend on which batch it ran in or on retraction.

A row may be restricted to allowed tokens (structured output's grammar): the
`allowed` bitmask of `sample` masks the logits with plain torch ops on their
device before any row is picked; a row that allows nothing gives -1 (no
token), never an unconstrained one.

Greedy rows take `argmax_rows`, a blocked argmax equal to ``argmax(-1)``
(the first index of the maximum) at a fraction of its cost on CPU, where
``torch.argmax`` over a 32,000-wide row runs several times slower than the
max-reduction it needs.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.config import SamplingParams
from engine.outputs import TokenLogprob


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           allowed: torch.Tensor | None = None) -> list[int]:
    """One token per row of `logits` [B, V]; `positions` = output index being sampled.

    `allowed` (the mask seam): None, or an int32 bitmask ``[B, ceil(V / 32)]`` on the host
    (bit j of word w allows token 32 * w + j; all bits set: the row is free). Disallowed
    tokens are never picked, by any sampling mode (sampled rows draw from the masked logits);
    a row with no allowed token gives -1.

    NOTE: a greedy row whose best token the mask allows keeps it (the masked argmax is the
    same token), so only the rows the mask changes pay for masking."""
    out = argmax_rows(logits).tolist()
    masked: list[int] = []  # constrained rows sampled from masked logits: refused greedy picks, sampled rows
    if allowed is not None:
        words = allowed.numpy()
        for row in np.flatnonzero(~(words == -1).all(axis=1)).tolist():
            token = out[row]
            if not params[row].greedy or not (int(words[row, token >> 5]) >> (token & 31)) & 1:
                masked.append(row)
    if not all(p.greedy for p in params):
        skip = set(masked)
        for row, (p, pos) in enumerate(zip(params, positions)):
            if not p.greedy and row not in skip:
                out[row] = _sample_row(logits[row].float(), p, pos)
    if masked:
        assert allowed is not None  # only a mask makes rows masked
        index = torch.tensor(masked, device=logits.device)
        rows, empty = apply_allowed(logits.index_select(0, index), allowed[masked])
        best, nothing = argmax_rows(rows).tolist(), set(empty)
        for i, row in enumerate(masked):
            p = params[row]
            if i in nothing:  # NOTE: never a draw from an all -inf row (NaN), never an unconstrained token
                out[row] = -1
            else:
                out[row] = best[i] if p.greedy else _sample_row(rows[i].float(), p, positions[row])
    return out


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """`logits` with -inf added where `allowed` (a host bitmask, see `sample`) does not allow, and
    the rows that allow nothing. Only the constrained rows (not all bits set) are touched; bits past
    the logits' width (a tokenizer larger than the model's vocabulary) are ignored.

    NOTE: on the host the bits are unpacked by numpy and the mask added through a two-entry table
    (branch-free: `masked_fill` on a random-looking mask is several times slower); on a device the
    words are copied (1/32 of the mask) and unpacked there with torch ops."""
    batch, vocab = logits.shape
    need = -(-vocab // 32)
    words = allowed.numpy()
    if words.shape[1] < need:  # a mask narrower than the logits allows nothing past its end
        words = np.concatenate((words, np.zeros((batch, need - words.shape[1]), dtype=words.dtype)), axis=1)
    rows = np.flatnonzero(~(words[:, :need] == -1).all(axis=1))
    if not rows.size:
        return logits, []
    words = words[rows, :need]  # a copy: the tail bits may be cleared
    if vocab % 32:
        words[:, -1] &= (1 << (vocab % 32)) - 1
    empty = rows[~words.any(axis=1)].tolist()
    if logits.device.type == "cpu":
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        bias = torch.from_numpy(np.take(_BIAS, bits)).to(logits.dtype)
    else:
        on_device = torch.from_numpy(words).to(logits.device, non_blocking=True)
        shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
        keep = ((on_device.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
        bias = torch.zeros(keep.shape, dtype=logits.dtype, device=logits.device).masked_fill_(~keep, float("-inf"))
    if len(rows) == batch:
        return logits + bias, empty
    index = torch.from_numpy(rows).to(logits.device)
    return logits.index_add(0, index, bias), empty


#: the bias of a disallowed (0) and an allowed (1) token
_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """Per row, the sampled token's log probability and the `params.logprobs` best
    alternatives (None for rows that asked for none), from the same logits the sampler
    used: the model's own distribution, before temperature, top-k and top-p."""
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not wanted:
        return out
    rows = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[r]] for r in wanted], device=logits.device))[:, 0].tolist()
    most = max(params[r].logprobs or 0 for r in wanted)
    values, ids = (torch.topk(logprobs, most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = values.tolist(), ids.tolist()
    for i, row in enumerate(wanted):
        k = params[row].logprobs or 0
        out[row] = TokenLogprob(tokens[row], chosen[i], tuple(zip(top_ids[i][:k], top_values[i][:k])))
    return out


def argmax_rows(logits: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``logits.argmax(-1)`` of a ``[B, V]`` tensor: the index of each row's
    first maximum, found as the first block holding the row's maximum, then
    the first maximum inside that block."""
    batch, vocab = logits.shape
    blocks = vocab // block
    if blocks < 2:
        return logits.argmax(dim=-1)
    block_max = logits[:, : blocks * block].view(batch, blocks, block).amax(dim=-1)
    if vocab % block:
        block_max = torch.cat((block_max, logits[:, blocks * block :].amax(dim=-1, keepdim=True)), dim=1)
    start = block_max.argmax(dim=-1) * block  # the first block whose maximum is the row's
    columns = (start[:, None] + torch.arange(block, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, columns).argmax(dim=-1)


def _sample_row(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs > p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = None
    if p.seed is not None:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed((p.seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs, 1, generator=generator))
