"""Sparse decode attention, and the composite backend the runner uses.

`SparseDecodeAttention` serves the decode rows of DECODING HiSparse requests
for one step. For each layer, with p_b the new token's position in row b,
every step of it batched over the rows::

    1. new K/V -> each row's reserved slot; index keys -> the index store;
       K/V -> host: one device -> host copy of all rows (`HostCopier.backup`,
       a side stream on CUDA, fenced after the last layer; the fences are
       listed in `fences`, and the step's output carries them to the loop,
       which adds them through the machine)
    2. select top_k of tokens 0..p_b-1 by index score (recent window included):
       on an accelerator all rows at once (their pages' index keys gathered,
       scored and top-k'd together) and read back in one copy (`read_back`,
       the layer's one host sync); on the host, row by row in place
    3. LRU (host bookkeeping, per row): hits keep their slot, misses are
       copied host -> least recently used slots: every row's misses in one
       host -> device copy (`hisparse.lru`)
    4. attend over the selected slots plus the reserved one, all rows in one
       call (their slot ids uploaded in one copy)

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
from resources.device_io import read_back, upload
from resources.paging import pages_for
from states import Fence, Request

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
        self.new_loc = int(self.host.locs_np[position])


class SparseDecodeAttention:
    """`AttentionBackend` for decode rows of DECODING HiSparse requests, one step."""

    def __init__(self, state: HiSparseState, requests: Sequence[Any], positions: Sequence[int]) -> None:
        self.state = state
        cfg = state.config
        ps = state.host.page_size
        # the previous step's backups land in the host rows before anything reads them there
        state.copier.apply_backups()
        self.rows = [_Row(r, p, ps) for r, p in zip(requests, positions)]
        for row in self.rows:
            row.buffer.stamp += 1
        #: (request, fence) of each row's host backup, once the last layer has run
        self.fences: list[tuple[Request, Fence]] = []
        device = state.device
        #: rows whose selection is scored (the others attend their whole short context)
        self.scored = [b for b, row in enumerate(self.rows) if row.position > cfg.top_k]
        #: batched selection: on an accelerator (one read-back per layer), or when forced (tests)
        self.batched = bool(self.scored) and (device.type != "cpu" or state.batched_selection)
        self._new_host = torch.tensor([row.new_loc for row in self.rows], dtype=torch.int64)
        n, r = len(self.rows), len(self.scored)
        words = [self._new_host.numpy()]
        if self.batched:  # the scored rows' positions and indices
            words += [np.array([self.rows[b].position for b in self.scored], dtype=np.int64),
                      np.array(self.scored, dtype=np.int64)]
        sent = upload(np.concatenate(words), device)  # the step's one upload
        self._new_dev = sent[:n]
        self._reserved = torch.stack([row.buffer.slots[-1] for row in self.rows])
        self._scoring: tuple[Tensor, Tensor, Tensor] | None = None
        if self.batched:
            self._scoring = (*self._scoring_plan(sent[n : n + r]), sent[n + r : n + 2 * r])

    def _scoring_plan(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The scored rows' context pages ``[R, P]`` and a score bias ``[R, P * page_size]``:
        -inf past the row's context, +inf over its recent window, else 0."""
        state, ps = self.state, self.state.host.page_size
        num_pages = pages_for(max(self.rows[b].position for b in self.scored), ps)
        pages = torch.stack([self.rows[b].host.pages_dev[:num_pages] for b in self.scored])
        columns = torch.arange(num_pages * ps, device=positions.device)
        recent = state.config.recent_window
        bias = torch.zeros(pages.shape[0], num_pages * ps, device=positions.device)
        bias = bias.masked_fill(columns >= positions[:, None], float("-inf"))
        if recent:
            bias = bias.masked_fill((columns >= positions[:, None] - recent) & (columns < positions[:, None]),
                                    float("inf"))
        return pages, bias

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        state = self.state
        buf, host = state.device_pool.kv[layer_id], state.host
        new_kv = torch.stack((k, v), dim=1).to(buf.dtype)
        buf.index_copy_(0, self._reserved, new_kv)
        index = host.index[layer_id]
        index.index_copy_(0, self._new_dev, state.projection.keys(k).to(index.dtype))
        with state.copier.side():
            state.copier.backup(layer_id, host.kv[layer_id], self._new_host, new_kv)
        queries = state.projection.queries(q)
        selected = self._select(layer_id, queries)
        ids, lens = self._swap_in(layer_id, selected)
        out = _attend_slots(q, buf, ids, lens)
        if state.trace is not None:
            for b, row in enumerate(self.rows):
                state.trace.append({"request_id": row.request.request_id, "layer": layer_id,
                                    "position": row.position, "selected": torch.from_numpy(selected[b].copy()),
                                    "q": q[b].detach().cpu(), "out": out[b].detach().cpu()})
        if layer_id == state.num_layers - 1:
            self._fence_backups()
        return out

    # ------------------------------------------------------------ selection
    def _select(self, layer_id: int, queries: Tensor) -> list[np.ndarray]:
        """Each row's selected positions (ascending, host int64)."""
        cfg = self.state.config
        selected = [np.arange(row.position) for row in self.rows]
        if not self.scored:
            return selected
        if self.batched:
            assert self._scoring is not None
            pages, bias, scored = self._scoring
            scores = self._batched_scores(layer_id, pages, queries.index_select(0, scored))
            chosen = torch.topk(scores + bias, cfg.top_k, dim=-1, sorted=False).indices
            (host,) = read_back([torch.sort(chosen, dim=-1).values])  # NOTE: the layer's one host sync
            for i, b in enumerate(self.scored):
                selected[b] = host[i].numpy()
            return selected
        for b in self.scored:
            scores = self._scores(layer_id, self.rows[b], queries[b])
            selected[b] = top_positions(scores, top_k=cfg.top_k, recent=cfg.recent_window)
        return selected

    def _batched_scores(self, layer_id: int, pages: Tensor, queries: Tensor) -> Tensor:
        """Index scores ``[R, P * page_size]`` of the scored rows' context pages (whole pages at a time)."""
        index = self.state.host.index[layer_id]
        ps, dim = self.state.host.page_size, index.shape[1]
        keys = index.view(-1, ps * dim).index_select(0, pages.reshape(-1)).view(pages.shape[0], -1, dim)
        return torch.bmm(keys.float(), queries.float()[:, :, None])[:, :, 0]

    def _scores(self, layer_id: int, row: _Row, query: Tensor) -> Tensor:
        """Index scores ``[p]`` of one row's context tokens (host path)."""
        index = self.state.host.index[layer_id]
        query = query.float()
        if row.context_ranges is not None:  # read each run of pages in place
            parts = [index[start:end].float() @ query for start, end in row.context_ranges]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        # NOTE: whole pages at a time: a gather of page rows is several times faster than of token rows
        keys = index.view(-1, self.state.host.page_size * index.shape[1]).index_select(0, row.context_pages)
        return keys.view(-1, index.shape[1])[: row.position].float() @ query

    # -------------------------------------------------------------- swap-in
    def _swap_in(self, layer_id: int, selected: list[np.ndarray]) -> tuple[Tensor, Tensor | None]:
        """Make every row's selection resident (LRU per row; every miss in one copy); returns the
        slot ids ``[B, W]`` to attend (selected, then the reserved slot; padded with slot 0) and the
        rows' lengths (None when all are W)."""
        state = self.state
        width = max(s.shape[0] for s in selected) + 1
        ids = np.zeros((len(self.rows), width), dtype=np.int64)
        lens = np.empty(len(self.rows), dtype=np.int64)
        host_rows, targets = [], []
        for b, (row, chosen) in enumerate(zip(self.rows, selected)):
            buffer = row.buffer
            local, miss = lru.assign(row.slot_map.table[layer_id], buffer.slot_token[layer_id],
                                     buffer.last_used[layer_id], chosen, buffer.stamp)
            slots = buffer.slots_np[local]
            if miss.any():
                host_rows.append(row.context_np[chosen[miss]])
                targets.append(slots[miss])
            n = chosen.shape[0]
            ids[b, :n] = slots
            ids[b, n] = buffer.slots_np[-1]
            lens[b] = n + 1
        ragged = bool((lens != width).any())
        misses = np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64)
        words = [ids.reshape(-1), misses] + ([lens] if ragged else [])
        sent = upload(np.concatenate(words), state.device)  # one copy: slot ids, miss targets, lengths
        ids_dev = sent[: ids.size].view(ids.shape)
        if misses.shape[0]:
            rows_t = torch.from_numpy(np.concatenate(host_rows))
            buf = state.device_pool.kv[layer_id]
            target_dev = sent[ids.size : ids.size + misses.shape[0]]
            buf.index_copy_(0, target_dev, state.copier.from_host(state.host.kv[layer_id], rows_t))
            state.swapped_in += rows_t.shape[0]
        lens_dev = sent[ids.size + misses.shape[0] :] if ragged else None
        return ids_dev, lens_dev

    def _fence_backups(self) -> None:
        copier = self.state.copier
        event = copier.event()
        for row in self.rows:
            row.host.backup_event = event
            row.host.on_host = row.position + 1
            self.fences.append((row.request, copier.fence(self.state.backup_protects, row.request.request_id)))


def _attend_slots(q: Tensor, kv_buf: Tensor, ids: Tensor, lens: Tensor | None) -> Tensor:
    """Each query row ``q[b] [H, D]`` over the K/V in slots ``ids[b, :lens[b]]``; ``[B, H, D]``."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_buf.shape[2]
    group = num_heads // num_kv_heads
    width = ids.shape[1]
    mask = None
    if lens is not None:  # padded with the padding slot 0, masked out
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
    def fences(self) -> list[tuple[Request, Fence]]:
        """The sparse rows' backup fences (see `SparseDecodeAttention.fences`)."""
        return self._sparse.fences

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        d, s = self._dense_rows, self._sparse_rows
        out[d] = self._dense.attend(layer_id, q[d], k[d], v[d])
        out[s] = self._sparse.attend(layer_id, q[s], k[s], v[s])
        return out


def _select_meta(meta: Any, seqs: list[int], tokens: Tensor, rows: Tensor) -> Any:
    """`meta` of sequences `seqs` only, given their token rows and sequence rows on the device."""
    pick = (lambda t: None if t is None else t.index_select(0, rows))  # noqa: E731
    return type(meta)(out_locs=meta.out_locs.index_select(0, tokens), q_lens=[meta.q_lens[b] for b in seqs],
                      kv_lens=[meta.kv_lens[b] for b in seqs], kv_locs=pick(meta.kv_locs),
                      kv_pages=pick(meta.kv_pages), page_size=meta.page_size)


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
        dense_tokens = [t for b in dense for t in range(starts[b], starts[b + 1])]
        sparse_tokens = [starts[b] for b in sparse]
        # one copy: the dense rows' tokens, the sparse rows' tokens, the dense sequences
        sent = upload(np.array(dense_tokens + sparse_tokens + dense, dtype=np.int64), meta.out_locs.device)
        n_dense, n_sparse = len(dense_tokens), len(sparse_tokens)
        dense_rows, sparse_rows = sent[:n_dense], sent[n_dense : n_dense + n_sparse]
        dense_meta = _select_meta(meta, dense, dense_rows, sent[n_dense + n_sparse :])
        return CompositeAttention(dense_factory([seqs[b] for b in dense], dense_meta), backend, dense_rows,
                                  sparse_rows)

    return factory
