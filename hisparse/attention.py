"""Sparse decode attention, and the composite backend the runner uses.

`SparseDecodeAttention` serves the decode rows of DECODING HiSparse requests
for one step. For each layer and request, with p the new token's position::

    1. new K/V -> the reserved slot; its index key -> the index store;
       its K/V -> host (a side-stream copy on CUDA, fenced after the last layer;
       the fences are listed in `fences`, and the step's output carries them to
       the loop, which adds them through the machine)
    2. select top_k of tokens 0..p-1 by index score (recent window included)
    3. LRU (host bookkeeping): hits keep their slot, misses are copied
       host -> least recently used slots (`hisparse.lru`)
    4. attend over the selected slots plus the reserved one

`CompositeAttention` splits a mixed step: prefill rows (and any request
without a device buffer) go to the runner's dense paged backend, sparse
decode rows to `SparseDecodeAttention`.

NOTE: both satisfy the engine's `AttentionBackend` protocol structurally;
this package never imports the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hisparse import lru
from hisparse.hooks import DEVICE_HOOK, HOST_HOOK, MAP_HOOK, DeviceBuffer, HostRecord, SlotMap
from hisparse.selection import top_positions
from resources.paging import pages_for

if TYPE_CHECKING:
    from hisparse.state import HiSparseState

#: more runs of pages than this and scoring gathers the context's index keys page-wise
_MAX_RANGES = 8


class _Row:
    """One request's share of a sparse step."""

    __slots__ = ("request", "host", "buffer", "slot_map", "position", "context_pages", "context_ranges",
                 "context_np", "new_loc")

    def __init__(self, request: Any, position: int, page_size: int) -> None:
        self.request = request
        self.host: HostRecord = request.handles[HOST_HOOK].payload
        self.buffer: DeviceBuffer = request.handles[DEVICE_HOOK].payload
        self.slot_map: SlotMap = request.handles[MAP_HOOK].payload
        self.position = position
        self.context_pages = self.host.pages_dev[: pages_for(position, page_size)]
        # host rows [start, end) holding tokens 0..position-1, when they are a few runs
        ranges: list[tuple[int, int]] = []
        left = position
        for first, count in self.host.runs:
            if left <= 0 or len(ranges) > _MAX_RANGES:
                break
            n = min(count * page_size, left)
            ranges.append((first * page_size, first * page_size + n))
            left -= n
        self.context_ranges = ranges if left <= 0 else None
        self.context_np = self.host.locs_np[:position]
        self.new_loc = self.host.locs[position : position + 1]


class SparseDecodeAttention:
    """`AttentionBackend` for decode rows of DECODING HiSparse requests, one step."""

    def __init__(self, state: HiSparseState, requests: Sequence[Any], positions: Sequence[int]) -> None:
        self.state = state
        self.rows = [_Row(r, p, state.host.page_size) for r, p in zip(requests, positions)]
        device = state.device
        for row in self.rows:
            # the previous step's backup must be on the host before its rows are read there
            row.host.sync_backups()
            row.buffer.stamp += 1
        #: (request, fence) of each row's host backup, once the last layer has run
        self.fences: list[tuple[Any, Any]] = []
        self._reserved = torch.stack([row.buffer.slots[-1] for row in self.rows])
        self._new_host = torch.cat([row.new_loc for row in self.rows])
        self._new_dev = self._new_host.to(device)

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        state = self.state
        buf, host = state.device_pool.kv[layer_id], state.host
        new_kv = torch.stack((k, v), dim=1).to(buf.dtype)
        buf.index_copy_(0, self._reserved, new_kv)
        index = host.index[layer_id]
        index.index_copy_(0, self._new_dev, state.projection.keys(k).to(index.dtype))
        with state.copier.side():
            state.copier.to_host(host.kv[layer_id], self._new_host, new_kv)
        queries = state.projection.queries(q)
        selections = [self._select_and_swap(layer_id, row, queries[b]) for b, row in enumerate(self.rows)]
        out = _attend_slots(q, buf, [slots for _, slots in selections])
        if state.trace is not None:
            for b, (row, (selected, _)) in enumerate(zip(self.rows, selections)):
                state.trace.append({"request_id": row.request.request_id, "layer": layer_id,
                                    "position": row.position, "selected": torch.from_numpy(selected.copy()),
                                    "q": q[b].detach().cpu(), "out": out[b].detach().cpu()})
        if layer_id == state.num_layers - 1:
            self._fence_backups()
        return out

    def _scores(self, layer_id: int, row: _Row, query: Tensor) -> Tensor:
        """Index scores ``[p]`` of the row's context tokens."""
        index = self.state.host.index[layer_id]
        query = query.float()
        if row.context_ranges is not None:  # read each run of pages in place
            parts = [index[start:end].float() @ query for start, end in row.context_ranges]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        # NOTE: whole pages at a time: a gather of page rows is several times faster than of token rows
        keys = index.view(-1, self.state.host.page_size * index.shape[1]).index_select(0, row.context_pages)
        return keys.view(-1, index.shape[1])[: row.position].float() @ query

    def _select_and_swap(self, layer_id: int, row: _Row, query: Tensor) -> tuple[np.ndarray, Tensor]:
        """The row's selected positions, and the global slot ids of them then its reserved slot."""
        state = self.state
        cfg = state.config
        if row.position <= cfg.top_k:
            selected = np.arange(row.position)
        else:
            scores = self._scores(layer_id, row, query)
            # NOTE: on CUDA, the one host sync per layer: the LRU and the host gather run on the host
            selected = top_positions(scores, top_k=cfg.top_k, recent=cfg.recent_window)
        buffer = row.buffer
        local, miss = lru.assign(row.slot_map.table[layer_id], buffer.slot_token[layer_id],
                                 buffer.last_used[layer_id], selected, buffer.stamp)
        slots = buffer.slots_np[local]
        if miss.any():
            host_rows = torch.from_numpy(row.context_np[selected[miss]])
            targets = torch.from_numpy(slots[miss]).to(state.device)
            buf = state.device_pool.kv[layer_id]
            buf.index_copy_(0, targets, state.copier.from_host(state.host.kv[layer_id], host_rows))
            state.swapped_in += host_rows.shape[0]
        ids = torch.from_numpy(np.append(slots, buffer.slots_np[-1])).to(state.device)
        return selected, ids

    def _fence_backups(self) -> None:
        copier = self.state.copier
        event = copier.event()
        for row in self.rows:
            row.host.backup_event = event
            row.host.on_host = row.position + 1
            self.fences.append((row.request, copier.fence(self.state.backup_protects, row.request.request_id)))


def _attend_slots(q: Tensor, kv_buf: Tensor, slot_ids: list[Tensor]) -> Tensor:
    """Each query row ``q[b] [H, D]`` over the K/V in `slot_ids[b]`; ``[B, H, D]``."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_buf.shape[2]
    group = num_heads // num_kv_heads
    width = max(ids.shape[0] for ids in slot_ids)
    mask = None
    if all(ids.shape[0] == width for ids in slot_ids):
        ids = torch.stack(slot_ids)
    else:  # pad with the padding slot 0, masked out
        ids = torch.nn.utils.rnn.pad_sequence(slot_ids, batch_first=True, padding_value=0)
        lens = torch.tensor([t.shape[0] for t in slot_ids], device=q.device)
        mask = (torch.arange(width, device=q.device) < lens[:, None])[:, None, None, :]
    gathered = kv_buf.index_select(0, ids.reshape(-1)).view(batch, width, 2, num_kv_heads, head_dim).to(q.dtype)
    keys = gathered[:, :, 0].transpose(1, 2)  # [B, KVH, W, D]
    values = gathered[:, :, 1].transpose(1, 2)
    folded = q.view(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    return out.reshape(batch, num_heads, head_dim)


class CompositeAttention:
    """Dense rows through the runner's paged backend, sparse rows through HiSparse."""

    def __init__(self, dense: Any, sparse: SparseDecodeAttention, dense_rows: Tensor, sparse_rows: Tensor) -> None:
        self._dense, self._sparse = dense, sparse
        self._dense_rows, self._sparse_rows = dense_rows, sparse_rows

    @property
    def fences(self) -> list[tuple[Any, Any]]:
        """The sparse rows' backup fences (see `SparseDecodeAttention.fences`)."""
        return self._sparse.fences

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        d, s = self._dense_rows, self._sparse_rows
        out[d] = self._dense.attend(layer_id, q[d], k[d], v[d])
        out[s] = self._sparse.attend(layer_id, q[s], k[s], v[s])
        return out


def make_factory(state: HiSparseState, dense_factory: Callable[[Sequence[Any], Any], Any]) -> Callable:
    """`(seqs, meta) -> AttentionBackend` routing each seq to dense or sparse attention."""

    def factory(seqs: Sequence[Any], meta: Any) -> Any:
        sparse = [b for b, s in enumerate(seqs) if state.is_sparse(s.request)]
        if not sparse:
            return dense_factory(seqs, meta)
        backend = SparseDecodeAttention(state, [seqs[b].request for b in sparse], [seqs[b].start for b in sparse])
        if len(sparse) == len(seqs):
            return backend
        is_sparse = set(sparse)
        dense = [b for b in range(len(seqs)) if b not in is_sparse]
        starts = [0]
        for q_len in meta.q_lens:
            starts.append(starts[-1] + q_len)
        device = meta.out_locs.device
        dense_rows = torch.tensor([t for b in dense for t in range(starts[b], starts[b + 1])], device=device)
        sparse_rows = torch.tensor([starts[b] for b in sparse], device=device)
        dense_meta = meta.select(dense)
        return CompositeAttention(dense_factory([seqs[b] for b in dense], dense_meta), backend, dense_rows,
                                  sparse_rows)

    return factory
