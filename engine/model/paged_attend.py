"""The math of paged attention: one call attends a batch of sequences (every
decode row of a step, or every prefill chunk of it) over their contexts in
the paged KV buffers.

A `ContextBatch` is planned once per step and reused by every layer: where
each sequence's context lives (whole pages, or token locations), its length,
where its queries sit, and the masks, built once per window. `attend` picks
one of four forms per call, or hands decode rows to kvlife's native CPU kernel
(`engine.model.native_kernels`, which reads K/V in place) when it has one::

    form        when                                    K/V gathered         mask
    sdpa        the gathered K/V fit `GATHER_BUDGET`    K and V, once        none when a causal or
                (every prefill batch; small decodes)                         full form says it
    bags        CPU decode of >= `BAG_MIN_TOKENS`       K only               additive, per row
                (K/V in the queries' dtype)
    blocks      the gathered K/V would not fit          a block at a time    per block

- **sdpa**: `scaled_dot_product_attention` over the gathered K/V, with no
  mask where the shape says it all, so CUDA can choose its flash kernel: a
  decode batch whose contexts are all the same length (and no window), a
  single prefill chunk that is its whole context (``is_causal``) or, on CUDA,
  one that extends a cached prefix (torch's lower-right causal bias). Whole
  prompts of one length are attended on their own new K/V (`attend_fresh`,
  ``is_causal``): nothing is read back from the buffers. Grouped
  query heads never copy K/V: decode queries fold each KV head's group into
  the query length; prefill uses ``enable_gqa``.
- **bags** (CPU): q.K a few rows at a time, each chunk's keys gathered into a
  buffer that stays in cache (about `BAG_CHUNK_BYTES`), softmax(q.K).V one
  `embedding_bag` over the value rows in place (a fused gather and weighted
  sum): the values are never gathered. On the development CPU it beats
  gathering both from 1,024 context tokens per step (batch 128 x 160 tokens:
  3.0 against 6.9 ms a layer, and against 4.4 ms gathering every row's keys at
  once).
- **blocks**: the context in blocks of pages with an online softmax (running
  maximum and sum, as flash attention does), so the temporary K/V of a call
  never exceeds `GATHER_BUDGET` whatever the batch and context (a batch of 64
  rows of 32k tokens would otherwise gather 4 GiB per layer on a real model).

Softmax runs in float32 in every form (transformers' eager attention does the
same), and probabilities are cast to the values' dtype before they weight
them. Sliding windows (a query at position p sees keys p - W < j <= p) are
masks in every form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from resources.paging import pages_for, round_up

if TYPE_CHECKING:
    from engine.model.native_kernels import NativeKernels

#: most bytes of K and V one attention call may gather at once (the blocks form past it)
GATHER_BUDGET = 128 << 20

#: devices where a chunk after a cached prefix takes torch's lower-right causal bias instead of a
#: mask (on CUDA it reaches the flash and memory-efficient kernels; on CPU it would only be
#: materialised, with a warning); never with grouped query heads, which that bias does not support
LOWER_RIGHT_DEVICES = frozenset({"cuda"})

#: the bags form gathers the keys of this many bytes of rows at a time (as float32), to stay in cache
BAG_CHUNK_BYTES = 2 << 20

#: from this many context tokens in a CPU decode batch on, the bags form (measured: batch
#: 1 x 192 tokens is faster through SDPA, batch 8 x 192 through the bags)
BAG_MIN_TOKENS = 1024


def token_locations(pages: Tensor, page_size: int) -> Tensor:
    """``[B, P * page_size]`` token locations of the page table `pages` ``[B, P]``."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, :, None] * page_size + offsets).reshape(pages.shape[0], -1)


class ContextBatch:
    """Sequences attended in one call: their contexts (`columns`, page ids when
    `unit` > 1, else token locations, ``[B, columns]``, padded with 0), lengths
    and query positions; masks are built on first use and reused by every layer.

    `query_pos` ``[B, Q]`` is each query's position (padding queries repeat their
    sequence's last one); `kv_lens` ``[B]`` the context lengths on the device;
    `equal_len` the common context length when every sequence has the same
    one (known on the host), else None.
    """

    __slots__ = ("columns", "unit", "width", "kv_lens", "query_pos", "equal_len", "q_len", "_masks", "_bags")

    def __init__(self, columns: Tensor, unit: int, kv_lens: Tensor, query_pos: Tensor,
                 equal_len: int | None = None, q_len: int | None = None) -> None:
        self.columns, self.unit = columns, unit
        self.width = columns.shape[1] * unit
        self.kv_lens, self.query_pos, self.equal_len = kv_lens, query_pos, equal_len
        #: the one query length every sequence has, when known on the host (then no query is padding)
        self.q_len = q_len
        self._masks: dict[tuple[int | None, torch.dtype | None], Tensor] = {}
        self._bags: Tensor | None = None

    @classmethod
    def of(cls, context: Tensor, context_unit: int, page_size: int, kv_lens: Sequence[int],
           query_pos: Tensor, q_lens: Sequence[int]) -> ContextBatch:
        """The batch of sequences whose contexts are the rows of `context`
        (page ids when `context_unit` > 1, else token locations): whole pages of
        `page_size` when the context is given by such pages, or its token
        locations turn out page-aligned, else token by token."""
        device = context.device
        longest = max(kv_lens)
        lens = torch.tensor(list(kv_lens), device=device)
        equal = longest if min(kv_lens) == longest else None
        q_len = q_lens[0] if min(q_lens) == max(q_lens) else None
        if context_unit == page_size:
            return cls(context[:, : pages_for(longest, page_size)], page_size, lens, query_pos, equal, q_len)
        locs = context if context_unit == 1 else token_locations(context, context_unit)
        locs = locs[:, :longest]
        if page_size > 1:  # page-aligned after all? (one check per step, not per layer)
            padded = F.pad(locs, (0, round_up(longest, page_size) - longest))
            pages = padded[:, ::page_size] // page_size
            if bool((token_locations(pages, page_size)[:, :longest] == locs).all()):
                return cls(pages, page_size, lens, query_pos, equal, q_len)
        return cls(locs, 1, lens, query_pos, equal, q_len)

    @property
    def batch(self) -> int:
        return self.columns.shape[0]

    def fetch(self, buf: Tensor, start: int = 0, stop: int | None = None, rows: slice | None = None) -> Tensor:
        """``[B, (stop - start) * unit, kv_heads, head_dim]``: the K or V rows of
        `buf` of context columns [start, stop) (of the sequences `rows` only)."""
        columns = self.columns if start == 0 and stop is None else self.columns[:, start:stop]
        if rows is not None:
            columns = columns[rows]
        units = buf.view(-1, self.unit, *buf.shape[1:]) if self.unit > 1 else buf
        gathered = units.index_select(0, columns.reshape(-1))
        return gathered.view(columns.shape[0], columns.shape[1] * self.unit, *buf.shape[1:])

    def visible(self, window: int | None, start: int = 0, stop: int | None = None) -> Tensor:
        """Boolean ``[B, 1, Q, keys]``: which keys of context positions [start, stop)
        each query sees (positions <= its own, and inside `window`)."""
        keys = torch.arange(start, self.width if stop is None else stop, device=self.columns.device)
        pos = self.query_pos[:, :, None]
        seen = keys <= pos
        if window is not None:
            seen = seen & (keys > pos - window)
        return seen[:, None]

    def mask(self, window: int | None, dtype: torch.dtype | None = None) -> Tensor:
        """`visible` over the whole width, built once per step: boolean, or additive
        in `dtype` (0 where seen, -inf where not)."""
        key = (window, dtype)
        mask = self._masks.get(key)
        if mask is None:
            mask = self.visible(window)
            if dtype is not None:
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._masks[key] = mask
        return mask

    def value_bags(self, num_heads: int, num_kv_heads: int) -> Tensor:
        """Value-row bags ``[B * num_heads, width]``, built on the first layer's
        call and reused by the others.

        Bag ``b * num_heads + h`` lists, for each context column, the row of
        ``v_buf.view(-1, head_dim)`` that query head h of sequence b reads:
        ``location * num_kv_heads + h // group``.
        """
        if self._bags is None:
            device = self.columns.device
            tokens = self.columns if self.unit == 1 else token_locations(self.columns, self.unit)
            kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
            self._bags = (tokens[:, None, :] * num_kv_heads + kv_head[None, :, None]).view(-1, self.width)
        return self._bags


def attend(q: Tensor, k_buf: Tensor, v_buf: Tensor, batch: ContextBatch, window: int | None,
           kernel: NativeKernels | None = None) -> Tensor:
    """`q` ``[B, Q, H, D]`` (query i of sequence b at ``batch.query_pos[b, i]``)
    over the batch's contexts in `k_buf` and `v_buf`; returns ``[B, Q, H, D]``.
    Decode rows (Q == 1, query at ``kv_lens - 1``) go to `kernel` where it takes them."""
    rows, q_len, heads, head_dim = q.shape
    if kernel is not None and q_len == 1 and kernel.takes_attention(q, k_buf):
        return kernel.decode_attention(q[:, 0], k_buf, v_buf, batch.columns, batch.unit, batch.kv_lens, window)[:, None]
    kv_heads = k_buf.shape[1]
    per_column = rows * kv_heads * head_dim * k_buf.element_size() * 2
    if batch.width * per_column > GATHER_BUDGET:
        return _blocks(q, k_buf, v_buf, batch, window, max(1, GATHER_BUDGET // (per_column * batch.unit)))
    if q_len == 1:
        # NOTE: the bags weigh the values in their own dtype: not over a cache narrower than the queries
        if q.device.type == "cpu" and rows * batch.width >= BAG_MIN_TOKENS and v_buf.dtype == q.dtype:
            return _bags(q[:, 0], k_buf, v_buf, batch, window)[:, None]
        return _sdpa_decode(q[:, 0], k_buf, v_buf, batch, window)[:, None]
    return _sdpa_prefill(q, k_buf, v_buf, batch, window)


def attend_fresh(q: Tensor, k: Tensor, v: Tensor, window: int | None, masks: dict[int | None, Tensor]) -> Tensor:
    """Prefill chunks that are each their sequence's whole context, all of one
    length: `q` ``[C, Q, H, D]`` over their own new `k` and `v` ``[C, Q, KVH, D]``,
    nothing read back from the KV buffers: causal with no mask, unless a window
    shorter than Q needs one (``[Q, Q]``, kept in `masks` for the step's other layers)."""
    gqa = q.shape[2] != k.shape[2]
    queries, keys, values = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    width = q.shape[1]
    if window is not None and window >= width:
        window = None
    if window is None:
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=gqa).transpose(1, 2)
    mask = masks.get(window)
    if mask is None:
        distance = torch.arange(width, device=q.device)[:, None] - torch.arange(width, device=q.device)
        mask = masks[window] = (distance >= 0) & (distance < window)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)


def _same_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _sdpa_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, batch: ContextBatch, window: int | None) -> Tensor:
    """One query per sequence, `q` ``[B, H, D]``; the group of query heads of
    each KV head folded into the query length (a view, no K/V copy)."""
    rows, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    keys = _same_dtype(batch.fetch(k_buf), q.dtype).transpose(1, 2)  # [B, KVH, width, D]
    values = _same_dtype(batch.fetch(v_buf), q.dtype).transpose(1, 2)
    folded = q.view(rows, kv_heads, heads // kv_heads, head_dim)
    if batch.equal_len is not None and window is None:  # every context whole: no mask at all
        n = batch.equal_len
        out = F.scaled_dot_product_attention(folded, keys[:, :, :n], values[:, :, :n])
    else:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=batch.mask(window))
    return out.reshape(rows, heads, head_dim)


def _sdpa_prefill(q: Tensor, k_buf: Tensor, v_buf: Tensor, batch: ContextBatch, window: int | None) -> Tensor:
    """Prefill chunks `q` ``[B, Q, H, D]`` in one call, ``enable_gqa`` for grouped heads."""
    keys = _same_dtype(batch.fetch(k_buf), q.dtype).transpose(1, 2)  # [B, KVH, width, D]
    values = _same_dtype(batch.fetch(v_buf), q.dtype).transpose(1, 2)
    queries = q.transpose(1, 2)  # [B, H, Q, D]
    gqa = q.shape[2] != k_buf.shape[1]
    n, q_len = batch.equal_len, batch.q_len
    if batch.batch == 1 and window is None and n is not None and q_len is not None:
        keys, values = keys[:, :, :n], values[:, :, :n]
        if q_len == n:  # the chunk is its sequence's whole context
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=gqa).transpose(1, 2)
        if not gqa and q.device.type in LOWER_RIGHT_DEVICES:  # after a cached prefix: causal, to the last key
            return F.scaled_dot_product_attention(queries, keys, values,
                                                  attn_mask=causal_lower_right(q_len, n)).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask(window)[..., :n],
                                             enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask(window), enable_gqa=gqa)
    return out.transpose(1, 2)


def _bags(q: Tensor, k_buf: Tensor, v_buf: Tensor, batch: ContextBatch, window: int | None) -> Tensor:
    """One query per sequence, `q` ``[B, H, D]``: q.K a few rows at a time (each
    chunk's keys gathered into one reused buffer that stays in cache, multiplied
    by the queries in place and summed over D, in float32), then softmax(q.K).V
    as one `embedding_bag` over the value rows, which are never gathered."""
    rows, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    group, width = heads // kv_heads, batch.width
    bags = batch.value_bags(heads, kv_heads)
    # NOTE: scores laid out [B, width, KVH, group]: query head h = kv_head * group + g
    scores = torch.empty((rows, width, kv_heads, group), dtype=torch.float32, device=q.device)
    queries = (q.float() * head_dim**-0.5).view(rows, 1, kv_heads, group, head_dim)
    chunk = max(1, BAG_CHUNK_BYTES // (width * kv_heads * head_dim * 4))
    columns = batch.columns.shape[1]
    flat = batch.columns.reshape(-1)
    units = k_buf.view(-1, batch.unit, kv_heads, head_dim)
    buffer = torch.empty((min(chunk, rows) * columns, batch.unit, kv_heads, head_dim), dtype=k_buf.dtype,
                         device=q.device)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        keys = torch.index_select(units, 0, flat[start * columns : stop * columns],
                                  out=buffer[: (stop - start) * columns])
        keys = (keys if keys.dtype == torch.float32 else keys.float()).view(stop - start, width, kv_heads, 1, head_dim)
        products = keys.mul_(queries[start:stop]) if group == 1 else keys * queries[start:stop]
        torch.sum(products, dim=-1, out=scores[start:stop])
    weights = torch.softmax(scores.view(rows, width, heads).transpose(1, 2).add_(batch.mask(window, torch.float32)[:, 0]),
                            dim=-1)
    out = F.embedding_bag(bags, v_buf.view(-1, head_dim), per_sample_weights=_same_dtype(weights, v_buf.dtype)
                          .view(-1, width), mode="sum")
    return _same_dtype(out.view(rows, heads, head_dim), q.dtype)


def _blocks(q: Tensor, k_buf: Tensor, v_buf: Tensor, batch: ContextBatch, window: int | None,
            block_columns: int) -> Tensor:
    """`attend` a block of `block_columns` context columns at a time, merging the
    blocks with an online softmax (float32 running maximum, sum and output)."""
    rows, q_len, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    # queries folded per KV head: row g * Q + i is group member g, query i
    folded = q.view(rows, q_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(rows, kv_heads, group * q_len, head_dim)
    shape = (rows, kv_heads, group * q_len, 1)
    running_max = torch.full(shape, float("-inf"), device=q.device)
    total = torch.zeros(shape, device=q.device)
    acc = torch.zeros((rows, kv_heads, group * q_len, head_dim), device=q.device)
    columns = batch.columns.shape[1]
    for start in range(0, columns, block_columns):
        stop = min(start + block_columns, columns)
        keys = _same_dtype(batch.fetch(k_buf, start, stop), q.dtype).transpose(1, 2)  # [B, KVH, w, D]
        values = _same_dtype(batch.fetch(v_buf, start, stop), q.dtype).transpose(1, 2)
        scores = torch.matmul(folded, keys.transpose(2, 3)).float() * head_dim**-0.5
        seen = batch.visible(window, start * batch.unit, stop * batch.unit)  # [B, 1, Q, w]
        if group > 1:
            seen = seen.repeat(1, 1, group, 1)
        scores.masked_fill_(~seen, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        base = new_max.masked_fill(new_max == float("-inf"), 0.0)  # NOTE: nothing seen yet: exp(-inf) = 0, not nan
        probs = torch.exp(scores - base)
        correction = torch.exp(running_max - base)
        total = total * correction + probs.sum(-1, keepdim=True)
        acc = acc * correction + torch.matmul(_same_dtype(probs, values.dtype), values).float()
        running_max = new_max
    out = (acc / total.clamp_min(torch.finfo(torch.float32).tiny)).to(q.dtype)
    return out.view(rows, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4).reshape(rows, q_len, heads, head_dim)
