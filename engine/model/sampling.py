"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p,
per-request seeds, and the sampled tokens' logprobs; nothing read back.

A step describes its sampled rows once, on the host (`SamplingBatch`: the
params, the output positions, and ``fields`` [6, S] int64 for the device:
temperature and top-p as float64 bits, top-k, a 64-bit noise key, a greedy
flag, and the rows that want logprobs). The
runner uploads ``fields`` in its one host-to-device copy; `sample_tokens`
then picks every row's token in one batched pass::

    logits [S, V] float32
      -> allowed-token mask (optional; `allowed` [S, V] bool, False = banned)
      -> greedy rows: argmax (`argmax_rows`)
      -> the others: / temperature -> top-k -> softmax -> top-p
                     -> argmax(log p + Gumbel noise(key, token id))

The Gumbel-max draw is an exact sample of the filtered distribution. Its
noise is a counter-based hash of (row key, token id) computed on the device:
no generator is built, seeded or stepped, and the same key gives the same
noise on every device and in every batch. A seeded request's key depends only
on (seed, output position), so its tokens do not depend on which batch it ran
in or on retraction; an unseeded row's key comes from torch's default CPU
generator (`torch.manual_seed` makes it reproducible).

The token-mask seam (structured outputs): `sample_tokens(..., allowed=mask)`
applies a per-row allowed-token mask ``[S, V]`` (bool, on the logits' device)
before anything else, greedy rows included; a row whose mask allows nothing
is a caller's bug. Logprobs are always the model's own distribution (before
the mask, temperature, top-k and top-p).

Every operation is row-wise, so sampling a batch equals sampling each row on
its own (tests/test_sampling_batch.py holds it).

Greedy rows take `argmax_rows`, a blocked argmax equal to ``argmax(-1)``
(the first index of the maximum) at a fraction of its cost on CPU, where
``torch.argmax`` over a 32,000-wide row runs several times slower than the
max-reduction it needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.config import SamplingParams
from engine.outputs import TokenLogprob
from resources.device_io import read_back

#: rows of `SamplingBatch.fields`, and how many there are
TEMPERATURE, TOP_P, TOP_K, KEY, GREEDY, LOGPROB_ROW = range(6)
FIELD_ROWS = 6
_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _mix_host(x: int) -> int:
    """splitmix64's finalizer on Python ints (the same function as `_mix` on tensors)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_key(seed: int, position: int) -> int:
    """The noise key of a seeded request's `position`-th output token (int64)."""
    return _signed(_mix_host(_mix_host(seed) + position * 0x9E3779B97F4A7C15))


class SamplingBatch:
    """The sampled rows of one step, described on the host (no device work)."""

    __slots__ = ("params", "positions", "greedy", "any_top_k", "any_top_p", "fields", "logprob_rows", "most_logprobs")

    def __init__(self, params: Sequence[SamplingParams], positions: Sequence[int]) -> None:
        if len(params) != len(positions):
            raise ValueError(f"{len(params)} sampling params for {len(positions)} positions")
        self.params = tuple(params)
        self.positions = tuple(positions)
        # NOTE: once per step and row: plain attribute reads (the greedy common case stops here)
        self.greedy = not any(p.temperature for p in params)
        self.any_top_k = not self.greedy and any(p.temperature and p.top_k > 0 for p in params)
        self.any_top_p = not self.greedy and any(p.temperature and p.top_p < 1.0 for p in params)
        #: rows that asked for logprobs, and the most alternatives any of them asked for
        self.logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        self.most_logprobs = max((params[r].logprobs or 0 for r in self.logprob_rows), default=0)
        #: the device's share ([6, S] int64), or None when the device needs none (every row greedy,
        #: and logprobs for every row or none)
        partial = 0 < len(self.logprob_rows) < len(self.params)
        self.fields = self._fields() if not self.greedy or partial else None

    def __len__(self) -> int:
        return len(self.params)

    def _fields(self) -> np.ndarray:
        n = len(self.params)
        fields = np.zeros((FIELD_ROWS, n), dtype=np.int64)
        floats = fields[:2].view(np.float64)
        step_key = int(torch.randint(0, 2**62, ())) if not self.greedy else 0  # unseeded rows: one draw per step
        for row, (p, pos) in enumerate(zip(self.params, self.positions)):
            floats[TEMPERATURE, row] = p.temperature if not p.greedy else 1.0
            floats[TOP_P, row] = p.top_p
            fields[TOP_K, row] = p.top_k
            fields[KEY, row] = seeded_key(p.seed, pos) if p.seed is not None else _signed(_mix_host(step_key + row))
            fields[GREEDY, row] = p.greedy
        fields[LOGPROB_ROW, : len(self.logprob_rows)] = self.logprob_rows
        return fields

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprob_rows)


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch, fields: torch.Tensor | None = None, *,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The sampled token of each row of `logits` [S, V], on its device, int64 [S].

    `fields` is `batch.fields` on the logits' device (uploaded with the step's
    inputs; None: uploaded here); `allowed` the optional allowed-token mask.
    """
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy = argmax_rows(logits)
    if batch.greedy:
        return greedy
    if fields is None:
        fields = upload_fields(batch, logits.device)
    probs = filtered_probs(logits, batch, fields)
    sampled = (probs.log() + gumbel_noise(fields[KEY], probs.shape[1])).argmax(dim=-1)
    if all(not p.greedy for p in batch.params):
        return sampled
    return torch.where(fields[GREEDY].bool(), greedy, sampled)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch, fields: torch.Tensor) -> torch.Tensor:
    """The distribution each sampled row draws from [S, V] float32: softmax of the logits
    over the temperature, after top-k, with top-p's tail zeroed (greedy rows: temperature 1)."""
    floats = fields[:2].view(torch.float64).float()
    scaled = logits.float() / floats[TEMPERATURE][:, None]
    if batch.any_top_k:
        top_k = fields[TOP_K]
        vocab = scaled.shape[1]
        ordered = torch.sort(scaled, dim=-1, descending=True).values
        kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
        active = (top_k > 0) & (top_k < vocab)
        scaled = scaled.masked_fill(active[:, None] & (scaled < kth), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if batch.any_top_p:
        top_p = floats[TOP_P][:, None]
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs > top_p) & (top_p < 1.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def upload_fields(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """`batch.fields` on `device` (outside a step; a step uploads them with its inputs)."""
    assert batch.fields is not None  # only batches that have them ask
    return torch.from_numpy(batch.fields).to(device)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [S, vocab], float32, a pure function of (keys[s], token id)."""
    counter = torch.arange(vocab, dtype=torch.int64, device=keys.device) * _GOLDEN
    bits = _mix(_mix(keys)[:, None] + counter)
    # NOTE: 23 bits, so the largest value, 1 - 2**-24, is below 1 in float32 (24 would round to 1: inf noise)
    uniform = (_shr(bits, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(uniform))


def salted_keys(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """Keys of an independent stream of draws: a pure function of (key, salt), int64."""
    return _mix(keys ^ _signed(_mix_host(salt)))


def hash_uniform(keys: torch.Tensor) -> torch.Tensor:
    """One Uniform(0, 1) draw per key, float32, strictly inside (0, 1)."""
    return (_shr(_mix(keys), 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps, as on every device)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch,
                    fields: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the rows that asked for logprobs (`batch.logprob_rows`), on the device:
    the sampled token's log probability [R], and the `batch.most_logprobs` best
    alternatives' values and ids [R, K], from the model's own distribution."""
    if len(batch.logprob_rows) < len(batch):
        if fields is None:
            fields = upload_fields(batch, logits.device)
        rows = fields[LOGPROB_ROW, : len(batch.logprob_rows)]
        logits, tokens = logits.index_select(0, rows), tokens.index_select(0, rows)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    values, ids = torch.topk(logprobs, batch.most_logprobs, dim=-1)
    return chosen, values, ids


def format_logprobs(batch: SamplingBatch, tokens: Sequence[int], chosen: torch.Tensor, values: torch.Tensor,
                    ids: torch.Tensor) -> list[TokenLogprob | None]:
    """`logprob_tensors`' results (read back) as one entry per row (None where not asked)."""
    out: list[TokenLogprob | None] = [None] * len(batch)
    chosen_l, values_l, ids_l = chosen.tolist(), values.tolist(), ids.tolist()
    for i, row in enumerate(batch.logprob_rows):
        k = batch.params[row].logprobs or 0
        out[row] = TokenLogprob(tokens[row], chosen_l[i], tuple(zip(ids_l[i][:k], values_l[i][:k])))
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int], *,
           allowed: torch.Tensor | None = None) -> list[int]:
    """One token per row of `logits` [B, V] (`positions`: the output index being
    sampled), read back: `sample_tokens` for callers outside a step."""
    (tokens,) = read_back([sample_tokens(logits, SamplingBatch(params, positions), allowed=allowed)])
    return tokens.tolist()


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """Per row, the sampled token's log probability and the `params.logprobs` best
    alternatives (None for rows that asked for none), read back."""
    batch = SamplingBatch(params, [0] * len(params))
    if not batch.wants_logprobs:
        return [None] * len(params)
    device_tokens = torch.tensor(tokens, dtype=torch.int64).to(logits.device)
    chosen, values, ids = read_back(list(logprob_tensors(logits, device_tokens, batch)))
    return format_logprobs(batch, tokens, chosen, values, ids)


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
