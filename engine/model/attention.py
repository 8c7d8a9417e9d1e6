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

Per layer, `PagedAttention` makes one attention call for all of a step's
decode rows (q_len == 1) and one for all of its prefill chunks (q_len > 1,
padded to the longest chunk), planned once per step (`ContextBatch`) and
reused by every layer with no host synchronisation. K/V are read a page at a
time when the context is given by pages (the engine's runner always does: its
allocator hands out whole pages), else token by token; the forms of the call
(SDPA with or without a mask, the CPU's embedding bags, bounded blocks) are
`engine.model.paged_attend`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
from torch import Tensor

from engine.model.paged_attend import ContextBatch, attend, attend_fresh

if TYPE_CHECKING:
    from engine.model.native_kernels import NativeKernels
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

    Construct one per step; the plan (which rows decode together, which
    prefill chunks, their contexts and masks) is built once here and reused by
    every layer, with no host synchronisation. `layer_windows[layer_id]` is
    that layer's sliding window (None or absent: full causal attention).
    """

    def __init__(self, kv: KVBuffers, meta: AttentionMetadata, layer_windows: Sequence[int | None] = (),
                 kernel: NativeKernels | None = None) -> None:
        self._kv = kv
        #: kvlife's native decode attention (`engine.model.native_kernels`); None: torch's forms only
        self._kernel = kernel
        self._out_locs = meta.out_locs
        longest = max(meta.kv_lens)
        # NOTE: a window at least as long as every context is no window
        self._windows = tuple(None if w is not None and w >= longest else w for w in layer_windows)
        device = meta.out_locs.device
        q_lens, kv_lens, ps = meta.q_lens, meta.kv_lens, kv.page_size
        context, unit = (meta.kv_locs, 1) if meta.kv_pages is None else (meta.kv_pages, meta.page_size)
        assert context is not None  # exactly one of kv_locs and kv_pages (checked at construction)
        #: the decode rows' batch and their rows of T (None: every row, in order)
        self._decode: ContextBatch | None = None
        self._decode_rows: Tensor | None = None
        #: the prefill chunks' batch ([C, Q] queries), where its queries come from and its outputs go
        self._prefill: ContextBatch | None = None
        self._prefill_queries: Tensor | None = None  # rows of T, [C * Q]; None: T is exactly [C, Q]
        self._prefill_out: tuple[Tensor, Tensor | None] | None = None  # (rows of [C * Q], rows of T or None: all)
        #: every sequence a whole prompt in one chunk, all of one length: attended on their own k/v ([C, Q])
        self._fresh: tuple[int, int] | None = None
        self._fresh_masks: dict[int | None, Tensor] = {}
        if q_lens == kv_lens and min(q_lens) == max(q_lens) > 1:
            self._fresh = (len(q_lens), q_lens[0])
            return
        if meta.is_decode_only:
            positions = torch.tensor(kv_lens, device=device)[:, None] - 1
            self._decode = ContextBatch.of(context, unit, ps, kv_lens, positions, q_lens)
            return
        starts = [0]
        for q_len in q_lens:
            starts.append(starts[-1] + q_len)
        decode = [b for b, q_len in enumerate(q_lens) if q_len == 1]
        prefill = [b for b, q_len in enumerate(q_lens) if q_len > 1]
        if decode:
            self._decode_rows = torch.tensor([starts[b] for b in decode], device=device)
            lens = [kv_lens[b] for b in decode]
            self._decode = ContextBatch.of(context.index_select(0, torch.tensor(decode, device=device)), unit, ps,
                                           lens, torch.tensor(lens, device=device)[:, None] - 1, [1] * len(decode))
        self._plan_prefill(context, unit, ps, prefill, starts, q_lens, kv_lens, whole=not decode)

    def _plan_prefill(self, context: Tensor, unit: int, page_size: int, seqs: list[int], starts: list[int],
                      q_lens: Sequence[int], kv_lens: Sequence[int], whole: bool) -> None:
        """The prefill chunks `seqs` as one batch ``[C, Q]``, Q the longest chunk;
        a shorter chunk's padding queries repeat its last query. `whole`: the
        chunks are every sequence of the step."""
        device = context.device
        width = max(q_lens[b] for b in seqs)
        positions: list[int] = []
        queries: list[int] = []
        source: list[int] = []
        for c, b in enumerate(seqs):
            q_len, first, start = q_lens[b], kv_lens[b] - q_lens[b], starts[b]
            pad = width - q_len
            positions.extend(range(first, first + q_len))
            positions.extend([first + q_len - 1] * pad)
            queries.extend(range(start, start + q_len))
            queries.extend([start + q_len - 1] * pad)
            source.extend(range(c * width, c * width + q_len))
        rows = context if whole else context.index_select(0, torch.tensor(seqs, device=device))
        self._prefill = ContextBatch.of(rows, unit, page_size, [kv_lens[b] for b in seqs],
                                        torch.tensor(positions, device=device).view(len(seqs), width),
                                        [q_lens[b] for b in seqs])
        if whole and len(source) == len(queries):  # every sequence a chunk of the same length: T is [C, Q]
            return
        self._prefill_queries = torch.tensor(queries, device=device)
        target = None if whole else torch.tensor([starts[b] + i for b in seqs for i in range(q_lens[b])],
                                                 device=device)
        self._prefill_out = (torch.tensor(source, device=device), target)

    @classmethod
    def decode(cls, kv: KVBuffers, out_locs: Tensor, pages: Tensor, kv_lens: Tensor,
               layer_windows: Sequence[int | None] = (), kernel: NativeKernels | None = None) -> PagedAttention:
        """A decode-only step given by device tensors alone (no host lengths,
        so the plan can be captured in a CUDA graph): one new token per
        sequence written at `out_locs` ``[B]``, contexts of `kv_lens` ``[B]``
        tokens in the pages `pages` ``[B, P]`` (page size `kv.page_size`)."""
        context = ContextBatch(pages, kv.page_size, kv_lens, (kv_lens - 1)[:, None], q_len=1)
        return cls._decoding(kv, out_locs, context, tuple(layer_windows), kernel)

    @classmethod
    def decode_rows(cls, kv: KVBuffers, out_locs: Tensor, context: ContextBatch, longest: int,
                    layer_windows: tuple[int | None, ...] = (), kernel: NativeKernels | None = None) -> PagedAttention:
        """A decode-only step planned by its caller (`engine.model.decode_inputs`): the same
        plan as the constructor's for a step whose every row is one new token, from a
        `ContextBatch` of those rows whose longest context is `longest` tokens."""
        if layer_windows.count(None) == len(layer_windows):  # NOTE: no window (the common case): nothing to trim
            return cls._decoding(kv, out_locs, context, layer_windows, kernel)
        windows = tuple(None if w is not None and w >= longest else w for w in layer_windows)
        return cls._decoding(kv, out_locs, context, windows, kernel)

    @classmethod
    def _decoding(cls, kv: KVBuffers, out_locs: Tensor, context: ContextBatch,
                  windows: tuple[int | None, ...], kernel: NativeKernels | None) -> PagedAttention:
        self = cls.__new__(cls)
        self._kv, self._out_locs, self._windows, self._kernel = kv, out_locs, windows, kernel
        self._decode_rows, self._prefill, self._prefill_queries, self._prefill_out = None, None, None, None
        self._fresh, self._fresh_masks = None, {}
        self._decode = context
        return self

    @classmethod
    def factory(cls, kv: KVBuffers, layer_windows: Sequence[int | None] = (),
                decode_kernel: NativeKernels | None = None) -> PagedFactory:
        """The runner's attention factory: one `PagedAttention` per step over
        `kv`, with each layer's sliding window (`ModelConfig.layer_windows`) and
        the native decode kernel where the engine has one."""
        return PagedFactory(kv, tuple(layer_windows), decode_kernel)

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_buf, v_buf = self._kv.k[layer_id], self._kv.v[layer_id]
        window = self._windows[layer_id] if layer_id < len(self._windows) else None
        kernel, decode = self._kernel, self._decode
        if (kernel is not None and decode is not None and self._prefill is None and self._fresh is None
                and kernel.takes_attention(q, k_buf) and kernel.takes_store(k, v, self._out_locs)):
            # every row decodes: the native kernel stores the new K/V and attends, one call
            return kernel.decode_attention(q, k_buf, v_buf, decode.columns, decode.unit, decode.kv_lens, window,
                                           (k, v, self._out_locs))
        # NOTE: padded rows may all write location 0 in one step; which one
        # wins is unspecified, and harmless, since location 0 is never context.
        if k.dtype != k_buf.dtype:  # a cache in its own dtype (kv_cache_dtype): attend what was stored
            k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)
        k_buf.index_copy_(0, self._out_locs, k)
        v_buf.index_copy_(0, self._out_locs, v)
        if self._fresh is not None:
            chunks, width = self._fresh
            shape = (chunks, width, -1, q.shape[2])
            out = attend_fresh(q.view(shape), k.view(shape).to(q.dtype), v.view(shape).to(q.dtype), window,
                               self._fresh_masks)
            return out.reshape(q.shape)
        decode, prefill, rows = self._decode, self._prefill, self._decode_rows
        if prefill is None:  # NOTE: the common case, every row decodes: no scatter into `out`
            assert decode is not None
            return attend(q[:, None], k_buf, v_buf, decode, window, self._kernel)[:, 0]
        tokens, heads, head_dim = q.shape
        chunks, width = prefill.query_pos.shape
        queries = q if self._prefill_queries is None else q.index_select(0, self._prefill_queries)
        chunked = attend(queries.view(chunks, width, heads, head_dim), k_buf, v_buf, prefill, window)
        if self._prefill_out is None:
            return chunked.reshape(tokens, heads, head_dim)
        source, target = self._prefill_out
        chunked = chunked.reshape(chunks * width, heads, head_dim).index_select(0, source)
        if target is None:
            return chunked
        out = torch.empty_like(q)
        out[target] = chunked
        if decode is not None:
            out[rows] = attend(q[rows][:, None], k_buf, v_buf, decode, window, self._kernel)[:, 0]
        return out



@attrs.frozen
class PagedFactory:
    """`(seqs, metadata) -> PagedAttention` over `kv` with `layer_windows`
    (what `PagedAttention.factory` returns; the runner recognises it to run
    decode steps from static buffers)."""

    kv: KVBuffers
    layer_windows: tuple[int | None, ...] = ()
    #: decode rows through kvlife's native kernel (`engine.model.native_kernels`); None: torch's forms
    decode_kernel: NativeKernels | None = None

    def __call__(self, seqs: Sequence[object], meta: AttentionMetadata) -> PagedAttention:
        return PagedAttention(self.kv, meta, self.layer_windows, self.decode_kernel)
