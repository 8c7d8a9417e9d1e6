"""The attention interface the model calls once per layer, and the dense
paged implementation over `resources.kv_buffers.KVBuffers`.

A step's tokens are flattened over the batch: sequence 0's new tokens, then
sequence 1's, and so on. For each sequence the model hands over the query,
key and value of its new tokens only; the backend stores the new K/V and
attends each new query causally over the sequence's whole context::

    flattened step tokens (T = sum(q_lens)):
        | seq 0: q_lens[0] | seq 1: q_lens[1] | ... |
    context of sequence b (kv_lens[b] tokens, the last q_lens[b] are new):
        kv_locs[b, 0 : kv_lens[b]]   token locations in the KV buffers
        kv_locs[b, kv_lens[b] : ]    0 (padding page), masked out

New query i of sequence b sits at position kv_lens[b] - q_lens[b] + i and
sees context tokens 0 ..= that position; in a layer with a sliding window W
(`layer_windows`), only the last W of them (positions > that position - W),
as transformers masks it.

Decode rows (q_len == 1) are attended in one padded batched call; each
prefill chunk (q_len > 1) gets its own call. Grouped-query attention never
copies K/V: the query heads that share a KV head are folded into the query
length of that KV head, so `scaled_dot_product_attention` sees
``[batch, kv_heads, group * q_len, head_dim]`` against
``[batch, kv_heads, context, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

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


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Where a step's tokens live in the KV buffers.

    - `out_locs`: LongTensor ``[T]``, the location each new token's K/V is
      written to, in flattened step order.
    - `q_lens`: new tokens per sequence (each >= 1, sum == T).
    - `kv_lens`: context length per sequence including its new tokens
      (each >= its q_len).
    - `kv_locs`: LongTensor ``[B, max_kv_len]``, row b holds the locations of
      sequence b's context in position order, padded with 0 past
      ``kv_lens[b]``; its last ``q_lens[b]`` valid entries equal that
      sequence's slice of `out_locs`.

    Build it with `from_locations` unless the locations are already padded.
    """

    out_locs: Tensor
    q_lens: tuple[int, ...] = attrs.field(converter=tuple)
    kv_lens: tuple[int, ...] = attrs.field(converter=tuple)
    kv_locs: Tensor

    def __attrs_post_init__(self) -> None:
        batch = len(self.q_lens)
        if len(self.kv_lens) != batch or self.kv_locs.shape[0] != batch:
            raise ValueError(
                f"q_lens ({batch}), kv_lens ({len(self.kv_lens)}) and kv_locs rows "
                f"({self.kv_locs.shape[0]}) must all count the same sequences"
            )
        for b, (q_len, kv_len) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            if not 1 <= q_len <= kv_len:
                raise ValueError(f"sequence {b}: need 1 <= q_len ({q_len}) <= kv_len ({kv_len})")
        if sum(self.q_lens) != self.out_locs.shape[0]:
            raise ValueError(f"out_locs has {self.out_locs.shape[0]} entries, q_lens sum to {sum(self.q_lens)}")
        if batch and self.kv_locs.shape[1] < max(self.kv_lens):
            raise ValueError(f"kv_locs has {self.kv_locs.shape[1]} columns, longest context is {max(self.kv_lens)}")

    @property
    def num_tokens(self) -> int:
        return self.out_locs.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return all(q_len == 1 for q_len in self.q_lens)

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
    the padding masks) is built once here and reused by every layer.
    `layer_windows[layer_id]` is that layer's sliding window (None or absent:
    full causal attention); one set of masks is built per distinct window.
    """

    def __init__(self, kv: KVBuffers, meta: AttentionMetadata, layer_windows: Sequence[int | None] = ()) -> None:
        self._kv = kv
        self._meta = meta
        self._layer_windows = tuple(layer_windows)
        device = meta.kv_locs.device
        starts = [0]
        for q_len in meta.q_lens:
            starts.append(starts[-1] + q_len)
        decode_seqs = [b for b, q_len in enumerate(meta.q_lens) if q_len == 1]
        self._decode_rows: Tensor | slice | None = None
        if decode_seqs:
            if len(decode_seqs) == len(meta.q_lens):
                self._decode_rows = slice(None)
                decode_locs = meta.kv_locs
            else:
                self._decode_rows = torch.tensor([starts[b] for b in decode_seqs], device=device)
                decode_locs = meta.kv_locs[torch.tensor(decode_seqs, device=device)]
            decode_kv_lens = [meta.kv_lens[b] for b in decode_seqs]
            width = max(decode_kv_lens)
            self._decode_locs = _GatherPlan(decode_locs[:, :width], kv.page_size)
            width = self._decode_locs.width
            kv_lens = torch.tensor(decode_kv_lens, device=device)
            # [B, 1 (kv heads), 1 (query rows), width]: a decode query sees its whole context.
            self._decode_mask = (torch.arange(width, device=device) < kv_lens[:, None])[:, None, None, :]
        # (row slice in T, context locations, causal mask [q_len, kv_len]) per prefill chunk
        self._prefills: list[tuple[slice, Tensor, Tensor]] = []
        for b, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens, strict=True)):
            if q_len == 1:
                continue
            query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
            mask = torch.arange(kv_len, device=device)[None, :] <= query_pos[:, None]
            self._prefills.append((slice(starts[b], starts[b + 1]), _GatherPlan(meta.kv_locs[b : b + 1, :kv_len], 1),
                                   mask[None, None]))
        # window -> (decode mask, one mask per prefill chunk); None is full causal attention
        self._masks: dict[int | None, tuple[Tensor | None, list[Tensor]]] = {
            None: (self._decode_mask if decode_seqs else None, [mask for _, _, mask in self._prefills])
        }
        for window in {w for w in self._layer_windows if w is not None}:
            self._masks[window] = self._masks[None] if window >= max(meta.kv_lens) else self._windowed(window)

    def _windowed(self, window: int) -> tuple[Tensor | None, list[Tensor]]:
        """The full masks, also hiding every key at or before query position - `window`."""
        decode_mask, prefill_masks = self._masks[None]
        device = self._meta.kv_locs.device
        if decode_mask is not None:
            decode_lens = [kv_len for q_len, kv_len in zip(self._meta.q_lens, self._meta.kv_lens) if q_len == 1]
            first = torch.tensor(decode_lens, device=device)[:, None] - window  # first visible key position
            decode_mask = decode_mask & (torch.arange(decode_mask.shape[-1], device=device) >= first)[:, None, None, :]
        windowed = []
        for mask in prefill_masks:
            q_len, kv_len = mask.shape[-2:]
            query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
            windowed.append(mask & (torch.arange(kv_len, device=device)[None, :] > query_pos[:, None] - window))
        return decode_mask, windowed

    @classmethod
    def factory(cls, kv: KVBuffers, layer_windows: Sequence[int | None] = ()
                ) -> Callable[[Sequence[object], AttentionMetadata], PagedAttention]:
        """The runner's attention factory: one `PagedAttention` per step over
        `kv`, with each layer's sliding window (`ModelConfig.layer_windows`)."""
        return lambda seqs, meta: cls(kv, meta, layer_windows)

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_buf, v_buf = self._kv.k[layer_id], self._kv.v[layer_id]
        # NOTE: padded rows may all write location 0 in one step; which one
        # wins is unspecified, and harmless, since location 0 is never context.
        k_buf.index_copy_(0, self._meta.out_locs, k.to(k_buf.dtype))
        v_buf.index_copy_(0, self._meta.out_locs, v.to(v_buf.dtype))
        window = self._layer_windows[layer_id] if layer_id < len(self._layer_windows) else None
        decode_mask, prefill_masks = self._masks[window]
        if self._decode_rows is not None and not self._prefills:
            # NOTE: decode-only step, the common case: no scatter into `out`.
            q_rows = q[:, None]
            return _attend_gathered(q_rows, k_buf, v_buf, self._decode_locs, decode_mask).squeeze(1)
        out = torch.empty_like(q)
        if self._decode_rows is not None:
            q_rows = q[self._decode_rows][:, None]
            out[self._decode_rows] = _attend_gathered(q_rows, k_buf, v_buf, self._decode_locs, decode_mask).squeeze(1)
        for (rows, locs, _), mask in zip(self._prefills, prefill_masks, strict=True):
            q_rows = q[rows][None]
            out[rows] = _attend_gathered(q_rows, k_buf, v_buf, locs, mask)[0]
        return out


class _GatherPlan:
    """How to gather a batch's context K/V: whole pages when the locations are
    page-aligned (they are for the engine's allocator), else token by token.

    NOTE: gathering 16-token pages instead of single tokens moves the same
    bytes in 16x fewer, 16x larger rows; on CPU that is most of a decode step.
    """

    def __init__(self, locs: Tensor, page_size: int) -> None:
        self.locs = locs
        self.page_size = 1
        self.width = locs.shape[1]
        if page_size > 1:
            width = -(-self.width // page_size) * page_size
            padded = F.pad(locs, (0, width - self.width))
            pages = padded[:, ::page_size] // page_size
            offsets = torch.arange(page_size, device=locs.device)
            rebuilt = (pages[:, :, None] * page_size + offsets).reshape(locs.shape[0], width)[:, : self.width]
            if bool((rebuilt == locs).all()):
                self.locs, self.page_size, self.width = pages, page_size, width

    def gather(self, buf: Tensor) -> Tensor:
        """``[B, width, kv_heads, head_dim]`` rows of `buf` at the planned locations."""
        batch = self.locs.shape[0]
        rows = buf.view(-1, self.page_size, *buf.shape[1:]) if self.page_size > 1 else buf
        return rows.index_select(0, self.locs.reshape(-1)).view(batch, self.width, *buf.shape[1:])


def _attend_gathered(q: Tensor, k_buf: Tensor, v_buf: Tensor, locs: _GatherPlan, mask: Tensor) -> Tensor:
    """Attend `q` ``[B, Q, H, D]`` over the K/V at `locs` (``[B, L]`` locations);
    `mask` is boolean, broadcastable to ``[B, 1, group * Q, L]`` where query
    row ``g * Q + i`` is head-group member g, query i. Returns ``[B, Q, H, D]``."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    keys = locs.gather(k_buf).to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
    values = locs.gather(v_buf).to(q.dtype).transpose(1, 2)
    folded = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(batch, num_kv_heads, group * q_len, head_dim)
    if q_len > 1 and group > 1:
        mask = mask.expand(batch, 1, q_len, -1).repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    out = out.view(batch, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_heads, head_dim)
