"""Sparse decode attention, and the composite backend the runner uses.

`SparseDecodeAttention` serves the decode rows of DECODING HiSparse requests
for one step. For each layer and request, with p the new token's position::

    1. new K/V -> the reserved slot; its index key -> the index store;
       its K/V -> host (a side-stream copy on CUDA, fenced after the last layer)
    2. select top_k of tokens 0..p-1 by index score (recent window included)
    3. LRU: hits keep their slot, misses are copied host -> least recently
       used slots (`hisparse.lru`)
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

import torch
import torch.nn.functional as F
from torch import Tensor

from hisparse import lru
from hisparse.hooks import DEVICE_HOOK, HOST_HOOK, MAP_HOOK, DeviceBuffer, HostRecord, SlotMap
from hisparse.selection import select

if TYPE_CHECKING:
    from hisparse.state import HiSparseState


class _Row:
    """One request's share of a sparse step."""

    __slots__ = ("request", "host", "buffer", "slot_map", "position", "context_dev", "context_host", "new_loc")

    def __init__(self, request: Any, position: int) -> None:
        self.request = request
        self.host: HostRecord = request.handles[HOST_HOOK].payload
        self.buffer: DeviceBuffer = request.handles[DEVICE_HOOK].payload
        self.slot_map: SlotMap = request.handles[MAP_HOOK].payload
        self.position = position
        self.context_dev = self.host.locs_dev[:position]
        self.context_host = self.host.locs[:position]
        self.new_loc = self.host.locs[position : position + 1]


class SparseDecodeAttention:
    """`AttentionBackend` for decode rows of DECODING HiSparse requests, one step."""

    def __init__(self, state: HiSparseState, requests: Sequence[Any], positions: Sequence[int]) -> None:
        self.state = state
        self.rows = [_Row(r, p) for r, p in zip(requests, positions)]
        device = state.device
        for row in self.rows:
            # the previous step's backup must be on the host before rows are read there,
            # and out of the reserved slot before this step overwrites it
            row.host.sync_backups()
            row.buffer.stamp += 1
        self._reserved = torch.stack([row.buffer.slots[-1] for row in self.rows])
        self._new_host = torch.cat([row.new_loc for row in self.rows])
        self._new_dev = self._new_host.to(device)

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        state = self.state
        dev, host = state.device_pool, state.host
        k_buf, v_buf = dev.k[layer_id], dev.v[layer_id]
        k_buf.index_copy_(0, self._reserved, k.to(k_buf.dtype))
        v_buf.index_copy_(0, self._reserved, v.to(v_buf.dtype))
        index = host.index[layer_id]
        index.index_copy_(0, self._new_dev, state.projection.keys(k).to(index.dtype))
        with state.copier.side():
            state.copier.to_host(host.k[layer_id], self._new_host, k_buf.index_select(0, self._reserved))
            state.copier.to_host(host.v[layer_id], self._new_host, v_buf.index_select(0, self._reserved))
        queries = state.projection.queries(q)
        selections = [self._select_and_swap(layer_id, row, queries[b]) for b, row in enumerate(self.rows)]
        out = _attend_slots(q, k_buf, v_buf, [slots for _, slots in selections])
        if state.trace is not None:
            for b, (row, (selected, _)) in enumerate(zip(self.rows, selections)):
                state.trace.append({"request_id": row.request.request_id, "layer": layer_id,
                                    "position": row.position, "selected": selected.cpu(),
                                    "q": q[b].detach().cpu(), "out": out[b].detach().cpu()})
        if layer_id == state.num_layers - 1:
            self._fence_backups()
        return out

    def _select_and_swap(self, layer_id: int, row: _Row, query: Tensor) -> tuple[Tensor, Tensor]:
        """The row's selected positions, and the global slot ids of them then its reserved slot."""
        state = self.state
        cfg = state.config
        index_keys = state.host.index[layer_id].index_select(0, row.context_dev)
        selected = select(index_keys, query, top_k=cfg.top_k, recent=cfg.recent_window)
        buffer = row.buffer
        local, miss = lru.assign(row.slot_map.table[layer_id], buffer.slot_token[layer_id],
                                 buffer.last_used[layer_id], selected, buffer.stamp)
        missed = miss.nonzero().squeeze(1)  # NOTE: on CUDA, the one host sync per layer
        slots = buffer.slots.index_select(0, local)
        if missed.numel():
            host_rows = row.context_host.index_select(0, selected.index_select(0, missed).cpu())
            targets = slots.index_select(0, missed)
            dev = state.device_pool
            dev.k[layer_id].index_copy_(0, targets, state.copier.from_host(state.host.k[layer_id], host_rows))
            dev.v[layer_id].index_copy_(0, targets, state.copier.from_host(state.host.v[layer_id], host_rows))
        state.swapped_in += int(missed.numel())
        return selected, torch.cat((slots, buffer.slots[-1:]))

    def _fence_backups(self) -> None:
        copier = self.state.copier
        event = copier.event()
        for row in self.rows:
            row.host.backup_event = event
            row.host.on_host = row.position + 1
            row.request.fences.append(copier.fence(self.state.backup_protects))


def _attend_slots(q: Tensor, k_buf: Tensor, v_buf: Tensor, slot_ids: list[Tensor]) -> Tensor:
    """Each query row ``q[b] [H, D]`` over the K/V in `slot_ids[b]`; ``[B, H, D]``."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    width = max(ids.shape[0] for ids in slot_ids)
    mask = None
    if all(ids.shape[0] == width for ids in slot_ids):
        ids = torch.stack(slot_ids)
    else:  # pad with the padding slot 0, masked out
        ids = torch.nn.utils.rnn.pad_sequence(slot_ids, batch_first=True, padding_value=0)
        lens = torch.tensor([t.shape[0] for t in slot_ids], device=q.device)
        mask = (torch.arange(width, device=q.device) < lens[:, None])[:, None, None, :]
    shape = (batch, width, num_kv_heads, head_dim)
    keys = k_buf.index_select(0, ids.reshape(-1)).view(shape).to(q.dtype).transpose(1, 2)
    values = v_buf.index_select(0, ids.reshape(-1)).view(shape).to(q.dtype).transpose(1, 2)
    folded = q.view(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    return out.reshape(batch, num_heads, head_dim)


class CompositeAttention:
    """Dense rows through the runner's paged backend, sparse rows through HiSparse."""

    def __init__(self, dense: Any, sparse: SparseDecodeAttention, dense_rows: Tensor, sparse_rows: Tensor) -> None:
        self._dense, self._sparse = dense, sparse
        self._dense_rows, self._sparse_rows = dense_rows, sparse_rows

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
        dense_meta = type(meta)(
            out_locs=meta.out_locs.index_select(0, dense_rows),
            q_lens=[meta.q_lens[b] for b in dense],
            kv_lens=[meta.kv_lens[b] for b in dense],
            kv_locs=meta.kv_locs.index_select(0, torch.tensor(dense, device=device)),
        )
        return CompositeAttention(dense_factory([seqs[b] for b in dense], dense_meta), backend, dense_rows,
                                  sparse_rows)

    return factory
