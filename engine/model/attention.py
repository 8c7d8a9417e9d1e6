"""The attention interface the model calls once per layer, and the dense
paged implementation over `resources.kv_buffers.KVBuffers`.

A step's tokens are flattened over the batch: sequence 0's new tokens, then
sequence 1's, and so on. For each sequence the model hands over the query,
key and value of its new tokens only; the backend stores the new K/V and
attends each new query causally over the sequence's whole context::

    flattened step tokens (T = sum(q_lens)):
        | seq 0: q_lens[0] | seq 1: q_lens[1] | ... |
    context of sequence b (kv_lens[b] tokens, the last q_lens[b] are new),
    given either token by token or page by page:
        kv_locs[b, 0 : kv_lens[b]]          token locations in the KV buffers
        kv_pages[b, 0 : ceil(kv_lens[b] / page_size)]
                                            page ids: token i is at
                                            kv_pages[b, i // page_size] * page_size + i % page_size
        past the context: 0 (the padding page), masked out

New query i of sequence b sits at position kv_lens[b] - q_lens[b] + i and
sees context tokens 0 ..= that position; in a layer with a sliding window W
(`layer_windows`), only the last W of them (positions > that position - W),
as transformers masks it.

Decode rows (q_len == 1) are attended in one padded batched call; each
prefill chunk (q_len > 1) gets its own call. K/V are gathered a page at a
time when the context is given by pages (the engine's runner always does:
its allocator hands out whole pages), else token by token. Grouped-query
attention never copies K/V: the query heads that share a KV head are folded
into the query length of that KV head, so `scaled_dot_product_attention`
sees ``[batch, kv_heads, group * q_len, head_dim]`` against
``[batch, kv_heads, context, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor
from resources.paging import pages_for, round_up

if TYPE_CHECKING:
    from resources.kv_buffers import KVBuffers


class AttentionBackend(Protocol):
    """Attention for one model step, called once per layer in layer order.

    `q` is ``[T, num_heads, head_dim]``, `k` and `v` are
    ``[T, num_kv_heads, head_dim]``, all for the T new tokens of this step
    with RoPE already applied; query head h uses KV head
    ``h // (num_heads // num_kv_heads)``. Returns ``[T, num_heads, head_dim]``
    in `q`'s dtype, scaled by ``head_dim ** -0.5``. A backend may keep the
    new K/V (a paged backend must, before attending).
    """

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Where a step's tokens live in the KV buffers.

    - `out_locs`: LongTensor ``[T]``, the location each new token's K/V is
      written to, in flattened step order.
    - `q_lens`: new tokens per sequence (each >= 1, sum == T).
    - `kv_lens`: context length per sequence including its new tokens
      (each >= its q_len).
    - the context, one of: `kv_locs`, LongTensor ``[B, >= max_kv_len]``, row b
      the locations of sequence b's context in position order, padded with 0;
      or `kv_pages`, LongTensor ``[B, >= ceil(max_kv_len / page_size)]``, row b
      the ids of the pages holding it, padded with 0. The last ``q_lens[b]``
      context locations equal that sequence's slice of `out_locs`.

    Build it with `from_locations` unless the locations are already padded.
    """

    out_locs: Tensor
    q_lens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    kv_lens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    kv_locs: Tensor | None = None
    kv_pages: Tensor | None = None
    page_size: int = 1

    def __attrs_post_init__(self) -> None:
        batch = len(self.q_lens)
        context = self.kv_locs if self.kv_pages is None else self.kv_pages
        if context is None or (self.kv_locs is not None and self.kv_pages is not None):
            raise ValueError("give the context as exactly one of kv_locs and kv_pages")
        if len(self.kv_lens) != batch or context.shape[0] != batch:
            raise ValueError(
                f"q_lens ({batch}), kv_lens ({len(self.kv_lens)}) and context rows "
                f"({context.shape[0]}) must all count the same sequences"
            )
        for b, (q_len, kv_len) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            if not 1 <= q_len <= kv_len:
                raise ValueError(f"sequence {b}: need 1 <= q_len ({q_len}) <= kv_len ({kv_len})")
        if sum(self.q_lens) != self.out_locs.shape[0]:
            raise ValueError(f"out_locs has {self.out_locs.shape[0]} entries, q_lens sum to {sum(self.q_lens)}")
        unit = 1 if self.kv_pages is None else self.page_size
        if batch and context.shape[1] * unit < max(self.kv_lens):
            raise ValueError(f"the context has {context.shape[1]} columns of {unit} token(s), "
                             f"the longest is {max(self.kv_lens)} tokens")

    @property
    def num_tokens(self) -> int:
        return self.out_locs.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return len(self.q_lens) == self.num_tokens

    def select(self, seqs: Sequence[int]) -> AttentionMetadata:
        """The metadata of sequences `seqs` only (in that order)."""
        starts = [0]
        for q_len in self.q_lens:
            starts.append(starts[-1] + q_len)
        device = self.out_locs.device
        tokens = torch.tensor([t for b in seqs for t in range(starts[b], starts[b + 1])], device=device)
        rows = torch.tensor(list(seqs), device=device)
        pick = (lambda t: None if t is None else t.index_select(0, rows))  # noqa: E731
        return AttentionMetadata(out_locs=self.out_locs.index_select(0, tokens),
                                 q_lens=[self.q_lens[b] for b in seqs], kv_lens=[self.kv_lens[b] for b in seqs],
                                 kv_locs=pick(self.kv_locs), kv_pages=pick(self.kv_pages), page_size=self.page_size)

    @classmethod
    def from_locations(cls, context_locs: Sequence[Tensor], q_lens: Sequence[int]) -> AttentionMetadata:
        """Metadata for sequences whose whole context (old tokens, then the
        new ones) sits at ``context_locs[b]``, a LongTensor ``[kv_len_b]``
        each, the last ``q_lens[b]`` of which are this step's tokens."""
        if len(context_locs) != len(q_lens):
            raise ValueError(f"{len(context_locs)} location tensors for {len(q_lens)} q_lens")
        if not context_locs:
            raise ValueError("a step needs at least one sequence")
        kv_lens = [locs.shape[0] for locs in context_locs]
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if not 1 <= q_len <= kv_len:
                raise ValueError(f"sequence {b}: need 1 <= q_len ({q_len}) <= kv_len ({kv_len})")
        out_locs = torch.cat(
            [locs[kv_len - q_len :] for locs, q_len, kv_len in zip(context_locs, q_lens, kv_lens, strict=True)]
        )
        kv_locs = torch.nn.utils.rnn.pad_sequence(list(context_locs), batch_first=True, padding_value=0)
        return cls(out_locs=out_locs.long(), q_lens=q_lens, kv_lens=kv_lens, kv_locs=kv_locs.long())


class PagedAttention:
    """`AttentionBackend` over paged KV buffers, for one step.

    Construct one per step; the per-step plan (which rows decode together,
    the gather indices, the padding masks) is built once here and reused by
    every layer, with no host synchronisation. `layer_windows[layer_id]` is
    that layer's sliding window (None or absent: full causal attention); one
    set of masks is built per distinct window.
    """

    def __init__(self, kv: KVBuffers, meta: AttentionMetadata, layer_windows: Sequence[int | None] = ()) -> None:
        self._kv = kv
        self._out_locs = meta.out_locs
        longest = max(meta.kv_lens)
        # NOTE: a window at least as long as every context is no window
        self._windows = tuple(None if w is not None and w >= longest else w for w in layer_windows)
        device = meta.out_locs.device
        q_lens, kv_lens = meta.q_lens, meta.kv_lens
        self._decode_rows: Tensor | slice | None = None
        self._decode: _Gather | None = None
        # (row slice in T, context gather, window -> causal mask [1, 1, q_len, width]) per prefill chunk
        self._prefills: list[tuple[slice, _Gather, dict[int | None, Tensor]]] = []
        if meta.is_decode_only:
            self._decode_rows = slice(None)
            self._decode = _Gather.of(kv, meta, range(len(q_lens)), device)
            return
        starts = [0]
        for q_len in q_lens:
            starts.append(starts[-1] + q_len)
        decode_seqs = [b for b, q_len in enumerate(q_lens) if q_len == 1]
        if decode_seqs:
            self._decode_rows = torch.tensor([starts[b] for b in decode_seqs], device=device)
            self._decode = _Gather.of(kv, meta, decode_seqs, device)
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if q_len == 1:
                continue
            gather = _Gather.of(kv, meta, [b], device)
            query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
            keys = torch.arange(gather.width, device=device)[None, :]
            masks: dict[int | None, Tensor] = {None: (keys <= query_pos[:, None])[None, None]}
            for window in {w for w in self._windows if w is not None}:
                masks[window] = masks[None] & (keys > query_pos[:, None] - window)[None, None]
            self._prefills.append((slice(starts[b], starts[b + 1]), gather, masks))

    @classmethod
    def decode(cls, kv: KVBuffers, out_locs: Tensor, pages: Tensor, kv_lens: Tensor,
               layer_windows: Sequence[int | None] = ()) -> PagedAttention:
        """A decode-only step given by device tensors alone (no host lengths,
        so the plan can be captured in a CUDA graph): one new token per
        sequence written at `out_locs` ``[B]``, contexts of `kv_lens` ``[B]``
        tokens in the pages `pages` ``[B, P]`` (page size `kv.page_size`)."""
        self = cls.__new__(cls)
        self._kv, self._out_locs, self._windows = kv, out_locs, tuple(layer_windows)
        self._decode_rows, self._prefills = slice(None), []
        self._decode = _Gather(pages, kv.page_size, kv_lens)
        return self

    @classmethod
    def factory(cls, kv: KVBuffers, layer_windows: Sequence[int | None] = ()) -> PagedFactory:
        """The runner's attention factory: one `PagedAttention` per step over
        `kv`, with each layer's sliding window (`ModelConfig.layer_windows`)."""
        return PagedFactory(kv, tuple(layer_windows))

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_buf, v_buf = self._kv.k[layer_id], self._kv.v[layer_id]
        # NOTE: padded rows may all write location 0 in one step; which one
        # wins is unspecified, and harmless, since location 0 is never context.
        k_buf.index_copy_(0, self._out_locs, k.to(k_buf.dtype))
        v_buf.index_copy_(0, self._out_locs, v.to(v_buf.dtype))
        window = self._windows[layer_id] if layer_id < len(self._windows) else None
        decode = self._decode
        if decode is not None and not self._prefills:
            return _decode_attend(q, k_buf, v_buf, decode, window)  # NOTE: the common case: no scatter into `out`
        out = torch.empty_like(q)
        if decode is not None:
            rows = self._decode_rows
            out[rows] = _decode_attend(q[rows], k_buf, v_buf, decode, window)
        for rows, gather, masks in self._prefills:
            out[rows] = _attend(q[rows][None], k_buf, v_buf, gather, masks[window])[0]
        return out


@attrs.frozen
class PagedFactory:
    """`(seqs, metadata) -> PagedAttention` over `kv` with `layer_windows`
    (what `PagedAttention.factory` returns; the runner recognises it to run
    decode steps from static buffers)."""

    kv: KVBuffers
    layer_windows: tuple[int | None, ...] = ()

    def __call__(self, seqs: Sequence[object], meta: AttentionMetadata) -> PagedAttention:
        return PagedAttention(self.kv, meta, self.layer_windows)


class _Gather:
    """Which K/V rows some sequences attend over, and how to fetch them: whole
    pages when the context is given by pages (or its locations turn out
    page-aligned), else token by token.

    NOTE: gathering 16-token pages instead of single tokens moves the same
    bytes in 16x fewer, 16x larger rows; on CPU that is most of a decode step.
    """

    __slots__ = ("index", "unit", "width", "mask", "_columns", "_kv_lens", "_decode_plan", "_additive")

    def __init__(self, index: Tensor, unit: int, kv_lens: Tensor) -> None:
        self._columns = index  # [B, columns] page ids (unit > 1) or token locations
        self._kv_lens = kv_lens
        self.index = index.reshape(-1)  # [B * columns], rows of `unit` tokens
        self.unit = unit
        self.width = index.shape[1] * unit
        # [B, 1 (kv heads), 1 (query rows), width]: a decode query sees its whole context
        self.mask = (torch.arange(self.width, device=index.device) < kv_lens[:, None])[:, None, None, :]
        self._decode_plan: tuple[Tensor, Tensor] | None = None
        self._additive: dict[int | None, Tensor] = {}

    def additive_mask(self, window: int | None, dtype: torch.dtype) -> Tensor:
        """``[B, 1, width]``: 0 where a decode query sees the key, -inf where not
        (past its context, or before `window`); built once per step and window."""
        additive = self._additive.get(window)
        if additive is None:
            visible = self.mask[:, 0]
            if window is not None:  # the new token sits at kv_len - 1 and sees the keys after kv_len - 1 - window
                first = (self._kv_lens - window)[:, None, None]
                visible = visible & (torch.arange(self.width, device=visible.device) >= first)
            zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            additive = self._additive[window] = zeros.masked_fill_(~visible, float("-inf"))
        return additive

    def value_bags(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(value-row bags ``[B * num_heads, width]``, scaled KV-head identity
        ``[KVH, KVH]``), built on the first layer's call and reused by the others.

        Bag ``b * num_heads + h`` lists, for each context column, the row of
        ``v_buf.view(-1, head_dim)`` that query head h of sequence b reads:
        ``location * num_kv_heads + h // group``.
        """
        if self._decode_plan is None:
            columns = self._columns
            device = columns.device
            tokens = columns if self.unit == 1 else _token_locations(columns, self.unit)
            kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
            bags = (tokens[:, None, :] * num_kv_heads + kv_head[None, :, None]).view(-1, self.width)
            eye = torch.eye(num_kv_heads, dtype=dtype, device=device) * head_dim**-0.5
            self._decode_plan = (bags, eye)
        return self._decode_plan

    @classmethod
    def of(cls, kv: KVBuffers, meta: AttentionMetadata, seqs: Sequence[int], device: torch.device) -> _Gather:
        lens = [meta.kv_lens[b] for b in seqs]
        everyone = len(seqs) == len(meta.kv_lens)
        rows = None if everyone else torch.tensor(list(seqs), device=device)
        kv_lens = torch.tensor(lens, device=device)
        ps = kv.page_size
        if meta.kv_pages is not None and meta.page_size == ps:
            pages = meta.kv_pages[:, : pages_for(max(lens), ps)]
            return cls(pages if rows is None else pages.index_select(0, rows), ps, kv_lens)
        locs = meta.kv_locs if meta.kv_pages is None else _token_locations(meta.kv_pages, meta.page_size)
        assert locs is not None  # exactly one of kv_locs and kv_pages (checked at construction)
        locs = locs[:, : max(lens)]
        if rows is not None:
            locs = locs.index_select(0, rows)
        if ps > 1:  # page-aligned after all? (one check per step, not per layer)
            width = round_up(locs.shape[1], ps)
            padded = F.pad(locs, (0, width - locs.shape[1]))
            pages = padded[:, ::ps] // ps
            if bool((_token_locations(pages, ps)[:, : locs.shape[1]] == locs).all()):
                return cls(pages, ps, kv_lens)
        return cls(locs, 1, kv_lens)

    def fetch(self, buf: Tensor) -> Tensor:
        """``[B, width, kv_heads, head_dim]`` rows of `buf` at the planned locations."""
        batch = self.mask.shape[0]
        rows = buf.view(-1, self.unit, *buf.shape[1:]) if self.unit > 1 else buf
        return rows.index_select(0, self.index).view(batch, self.width, *buf.shape[1:])


def _token_locations(pages: Tensor, page_size: int) -> Tensor:
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, :, None] * page_size + offsets).reshape(pages.shape[0], -1)


#: below this many context tokens in a decode batch (measured: batch 1 x 192 tokens
#: is faster through SDPA, batch 8 x 192 through the bags), gathering K and V for
#: `scaled_dot_product_attention` costs less than the bag path's extra ops
_BAG_MIN_TOKENS = 1024


def _decode_attend(q: Tensor, k_buf: Tensor, v_buf: Tensor, gather: _Gather, window: int | None = None) -> Tensor:
    """One query per sequence, `q` ``[B, H, D]``, over the context `gather`
    names; returns ``[B, H, D]``.

    NOTE: from `_BAG_MIN_TOKENS` context tokens on, the values are never
    gathered: softmax(q . K) . V is one `embedding_bag` over the value rows
    (a fused gather and weighted sum), and q . K one `bmm` of the gathered keys ``[B, width, KVH * D]`` against the
    queries laid out block-diagonally ``[B, H, KVH * D]`` (head h's query in
    the block of its KV head, zeros elsewhere: KVH times the multiply-adds of
    a dot product per head, which here cost nothing next to the bytes). The
    step reads each key once more and each value once, where gathering both
    for `scaled_dot_product_attention` writes and reads them all again.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    mask = gather.additive_mask(window, q.dtype)
    if batch * gather.width < _BAG_MIN_TOKENS:
        return _attend(q[:, None], k_buf, v_buf, gather, mask[:, :, None, :]).squeeze(1)
    bags, eye = gather.value_bags(num_heads, num_kv_heads, head_dim, q.dtype)
    keys = gather.fetch(k_buf).to(q.dtype).view(batch, gather.width, num_kv_heads * head_dim)
    block_q = (q.view(batch, num_kv_heads, group, 1, head_dim) * eye.view(1, num_kv_heads, 1, num_kv_heads, 1))
    scores = torch.bmm(block_q.view(batch, num_heads, num_kv_heads * head_dim), keys.transpose(1, 2))
    weights = torch.softmax(scores + mask, dim=-1).to(v_buf.dtype)  # [B, H, width]
    out = F.embedding_bag(bags, v_buf.view(-1, head_dim), per_sample_weights=weights.view(-1, gather.width),
                          mode="sum")
    return out.view(batch, num_heads, head_dim).to(q.dtype)


def _attend(q: Tensor, k_buf: Tensor, v_buf: Tensor, gather: _Gather, mask: Tensor) -> Tensor:
    """Attend `q` ``[B, Q, H, D]`` over the K/V that `gather` fetches; `mask`
    is boolean, broadcastable to ``[B, 1, group * Q, width]`` where query row
    ``g * Q + i`` is head-group member g, query i. Returns ``[B, Q, H, D]``."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    keys = gather.fetch(k_buf).to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
    values = gather.fetch(v_buf).to(q.dtype).transpose(1, 2)
    if q_len == 1:
        folded = q.view(batch, num_kv_heads, group, head_dim)
    else:
        folded = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        folded = folded.reshape(batch, num_kv_heads, group * q_len, head_dim)
        if group > 1:
            mask = mask.expand(batch, 1, q_len, -1).repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    if q_len == 1:
        return out.reshape(batch, 1, num_heads, head_dim)
    out = out.view(batch, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_heads, head_dim)
