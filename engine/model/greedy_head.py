"""The verified greedy head: a greedy step's tokens from a bfloat16 copy of the
LM head, checked against a proven error bound and rescored in float32 where
the bound leaves doubt.

At batch 1 a decode step of a small model is mostly the LM head: 32,000 x 256
float32 weights (31 MiB) read once per token. A bfloat16 copy reads half the
bytes; on the development CPU (AVX-512 BF16) oneDNN multiplies it 2-3x faster
than the float32 blocked copy at every batch. Its logits are approximate, but
how approximate is known: with unit roundoff ``u = 2**-8`` for bfloat16 and
float32 accumulation over the hidden size ``n`` (``gamma = n * 2**-24 /
(1 - n * 2**-24)``), each approximate logit ``a_j`` of a row ``x`` is within::

    e_j = c * ||x|| * ||w_j|| + 2u / (1 - 2u) * |a_j|,    c = (2u + u^2)(1 + gamma) + 2 gamma

of the float32 head's logit (products of rounded inputs, the two sums'
rounding, the output's rounding to bfloat16, taken as twice a round to
nearest's so truncation is covered too; Cauchy-Schwarz bounds
``sum |x_i| |w_ji|`` by the norms, and ``||w_j||`` by the largest column norm,
so one bound serves a row). With ``m`` the row's largest approximate logit,
any token whose float32 logit could be the row's largest has ``a_j >= m - e_m
- e_*`` (``e_*`` the bound of a token that close, solved from ``m`` alone).
Those candidates, usually one to four a row, are rescored in float32 against
the float32 weights and the largest taken (the first on a tie, as
``argmax``). So the ids are the float32 head's argmax, up to float32
rounding itself: two logits within a few float32 ulps may order differently,
as they do between any two float32 kernels (the tests compare against the
float32 head on every step).

A step falls back to the float32 head (`argmax` returns None) when a row's
bound admits too many candidates or none (non-finite values). Only greedy
steps with no logprobs and no token mask take this head; the others need the
float32 logits anyway. Where it applies: `verified_head_applies` (CPU, a
float32 model, oneDNN with native bfloat16 matmuls); on CUDA a bfloat16
matmul may reduce in reduced precision, which the bound does not cover.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.model.native_kernels import NativeKernels
from engine.model.projection import Projection

#: accepted values of `EngineConfig.greedy_head`
GREEDY_HEADS = ("auto", "verified", "full")

#: columns per block of the candidate search (block maxima first, then the blocks that reach the bound)
BLOCK = 128

#: more candidate blocks than this per row on average: the float32 head for the step
MAX_BLOCKS_PER_ROW = 32

#: more candidate tokens than this per row on average: the float32 head for the step
MAX_TOKENS_PER_ROW = 64

#: "auto" takes the verified head for float32 heads of at least this many bytes: below it the
#: float32 head stays in cache and is faster (measured on the development CPU, hidden 256, one
#: thread, ms per step at batch 1 / 8 / 64, float32 vs verified: 2 MiB 0.12 / 0.14 / 0.59 vs
#: 0.27 / 0.35 / 0.85; 8 MiB 0.22 / 0.40 / 2.28 vs 0.32 / 0.39 / 2.47; 16 MiB 0.74 / 1.57 / 4.14
#: vs 0.63 / 1.32 / 3.89; 31 MiB 1.94 / 2.25 / 8.25 vs 1.15 / 2.14 / 5.93)
AUTO_MIN_BYTES = 16 << 20

#: the bound's slack over the analysis (its second-order terms, flushed subnormals)
SAFETY = 1.0625

_U = 2.0**-8  # bfloat16's unit roundoff (8 significant bits, round to nearest)


def verified_head_applies(head_t: Tensor, layout: str) -> bool:
    """Whether the verified head can serve a packed LM head `head_t` ``[hidden, vocab]`` in `layout`."""
    mkldnn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (head_t.device.type == "cpu" and head_t.dtype == torch.float32 and layout == "onednn"
            and mkldnn_bf16 is not None and bool(mkldnn_bf16()))


class VerifiedGreedyHead:
    """The greedy tokens of ``x @ head_t`` through a bfloat16 copy of `head_t`, verified (module docstring)."""

    __slots__ = ("head_t", "low", "columns", "served", "declined", "native", "_norm_coeff", "_value_coeff")

    low: Projection
    #: the float32 head vocabulary-major, ``[vocab, hidden]``: a candidate's weights are one contiguous row
    columns: Tensor
    _norm_coeff: float

    def __init__(self, head_t: Tensor) -> None:
        self.head_t = head_t
        #: steps whose tokens it gave, and steps it left to the float32 head
        self.served = self.declined = 0
        #: kvlife's native kernels (`engine.model.loading.install_native_kernels`): the search after
        #: the bfloat16 matmul in one call instead of about 25 torch ops (None: the torch form)
        self.native: NativeKernels | None = None
        self._value_coeff = SAFETY * 2 * _U / (1 - 2 * _U)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Recopy the bfloat16 weights and the bound after the float32 weights changed (a state-dict load)."""
        self.columns = self.head_t.t().contiguous()
        self.low = Projection.blocked_only(self.columns.t().to(torch.bfloat16))
        n = self.head_t.shape[0]
        gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
        largest_column = float(torch.linalg.vector_norm(self.columns, dim=1).max())
        self._norm_coeff = SAFETY * ((2 * _U + _U * _U) * (1 + gamma) + 2 * gamma) * largest_column

    def argmax(self, x: Tensor) -> Tensor | None:
        """Each row's argmax of ``x @ head_t`` (`x` ``[B, hidden]`` float32), int64 ``[B]``; None
        when a row's bound admits no candidate or too many (the caller then takes the float32 head)."""
        ids = self._argmax(x)
        if ids is None:
            self.declined += 1
        else:
            self.served += 1
        return ids

    def _argmax(self, x: Tensor) -> Tensor | None:
        rows_in, vocab = x.shape[0], self.head_t.shape[1]
        low = self.low(x.to(torch.bfloat16))
        native = self.native
        if native is not None and native.takes_verify(low, x):
            return native.verified_argmax(low, x, self.columns, BLOCK, self._norm_coeff, self._value_coeff,
                                          MAX_BLOCKS_PER_ROW, MAX_TOKENS_PER_ROW)
        approx = low.float()  # NOTE: float32 reductions run 2-3x faster than bfloat16's
        whole = vocab // BLOCK * BLOCK
        block_max = approx[:, :whole].view(rows_in, -1, BLOCK).amax(dim=-1)
        if whole < vocab:
            block_max = torch.cat((block_max, approx[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
        top = block_max.amax(dim=-1)
        shared = self._norm_coeff * torch.linalg.vector_norm(x, dim=-1)
        own = shared + self._value_coeff * top.abs()  # the bound of the row's approximate maximum
        other = (shared + self._value_coeff * (top.abs() + own)) / (1 - self._value_coeff)  # of a token that close
        floor = top - own - other
        block_rows, blocks = (block_max >= floor[:, None]).nonzero(as_tuple=True)
        if blocks.numel() > MAX_BLOCKS_PER_ROW * rows_in or blocks.numel() < rows_in:
            return None  # too loose, or a row with no candidate (NaN or infinity in it)
        columns = blocks[:, None] * BLOCK + torch.arange(BLOCK, device=x.device)
        inside = columns < vocab
        columns.clamp_(max=vocab - 1)
        values = approx.view(-1)[block_rows[:, None] * vocab + columns]
        pick, offset = ((values >= floor.index_select(0, block_rows)[:, None]) & inside).nonzero(as_tuple=True)
        rows, candidates = block_rows.index_select(0, pick), columns[pick, offset]
        if candidates.numel() > MAX_TOKENS_PER_ROW * rows_in:
            return None
        scores = (x.index_select(0, rows) * self.columns.index_select(0, candidates)).sum(dim=-1)
        best = torch.full((rows_in,), float("-inf"), device=x.device).scatter_reduce_(0, rows, scores, "amax")
        if not bool(torch.isfinite(best).all()):
            return None
        winners = torch.where(scores == best.index_select(0, rows), candidates, vocab)
        return torch.full((rows_in,), vocab, dtype=torch.int64, device=x.device).scatter_reduce_(
            0, rows, winners, "amin")
