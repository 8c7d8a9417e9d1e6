"""Decode steps from static buffers, captured once per batch size as CUDA graphs.

A decode-only step of B sequences runs as the graph captured for the
smallest batch bucket >= B and the smallest context bucket (in pages) >= the
longest context. Every input lives in static device tensors, filled by one
host-to-device copy per step::

    static[0, :bucket]  token ids      (padding rows: 0)
    static[1, :bucket]  positions      (padding rows: 0)
    static[2, :bucket]  request slots  (padding rows: 0)
    static[3, :bucket]  1 = a real row, 0 = padding

and everything else is computed inside the graph from them: the new tokens'
locations and the page table (read from the request -> token table, as the
eager runner does), the attention plan, the forward pass, the greedy argmax.
NOTE: a padding row writes its K/V to location 0 (the reserved padding page)
and attends over the padding page alone, so it never touches a request's
pages, whatever the request in slot 0 holds.

Buckets follow vLLM's capture sizes (1, 2, 4, 8, then multiples of 16 up to
`max_batch`); context buckets are powers of two pages up to the table's
width. Graphs are captured lazily, on the first step that needs one, into
one shared memory pool.

Only the runner builds this, only on CUDA (``capture=True``), for a dense
model with the engine's own paged attention: MoE routing needs a host sync
and HiSparse plans its selection on the host. With ``capture=False`` the
same static step runs eagerly on any device, which is how CPU tests check
it against the eager runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog
import torch

from engine.config import SamplingParams
from engine.model.attention import PagedAttention
from engine.model.llama import LlamaModel
from engine.model.sampling import argmax_rows, sample
from engine.model.batch import ScheduledSeq
from resources.kv_buffers import KVBuffers
from resources.request_slots import RequestSlots
from states import Request


log = structlog.get_logger("kvlife.decode_graphs")

#: a captured step: the graph and its static outputs (logits, greedy tokens)
_Captured = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def page_buckets(max_pages: int) -> list[int]:
    sizes, p = [], 1
    while p < max_pages:
        sizes.append(p)
        p *= 2
    return sizes + [max_pages]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv: KVBuffers, slots: RequestSlots, device: torch.device, *,
                 slot_of: Callable[[Request], int | None], max_batch: int,
                 layer_windows: tuple[int | None, ...] = (), capture: bool = True) -> None:
        self.model, self.kv, self.table, self.device = model, kv, slots.req_to_token, device
        self.layer_windows = layer_windows
        self.slot_of = slot_of
        self.capture = capture
        self.batch_sizes = batch_buckets(max_batch)
        self.page_sizes = page_buckets(slots.width // kv.page_size)
        largest = self.batch_sizes[-1]
        self.static = torch.zeros(4, largest, dtype=torch.int64, device=device)
        self._host = torch.zeros(4, largest, dtype=torch.int64, pin_memory=device.type == "cuda")
        #: (batch bucket, page bucket) -> (graph, logits, tokens), or None when not capturing
        self._graphs: dict[tuple[int, int], _Captured | None] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None
        #: set when a capture failed: every later step runs eagerly
        self.disabled = False

    def step(self, seqs: Sequence[ScheduledSeq], params: list[SamplingParams], out_pos: list[int]) -> list[int] | None:
        """The sampled tokens of a decode-only batch, or None when the batch
        does not fit (a prefill chunk, images, too many rows): run it eagerly."""
        n = len(seqs)
        if self.disabled or n > self.batch_sizes[-1] or len(params) != n:
            return None
        ids, positions, slots = [], [], []
        for s in seqs:
            request = s.request
            slot = self.slot_of(request)
            if s.num_tokens != 1 or request.mm_inputs or slot is None:
                return None
            prompt = request.prompt_token_ids
            ids.append(prompt[s.start] if s.start < len(prompt) else request.output_token_ids[s.start - len(prompt)])
            positions.append(s.start)
            slots.append(slot)
        bucket = next(b for b in self.batch_sizes if b >= n)
        pages = next(p for p in self.page_sizes if p * self.kv.page_size >= max(positions) + 1)
        host = self._host
        host[:, :bucket].zero_()
        host[0, :n] = torch.tensor(ids)
        host[1, :n] = torch.tensor(positions)
        host[2, :n] = torch.tensor(slots)
        host[3, :n] = 1
        self.static[:, :bucket].copy_(host[:, :bucket], non_blocking=True)
        try:
            captured = self._graph(bucket, pages)
        except Exception as exc:  # NOTE: a capture that fails must not fail the step: run eagerly from now on
            self.disabled = True
            log.warning("decode_graphs.disabled", error=repr(exc), batch=bucket, pages=pages)
            return None
        if captured is not None:
            graph, logits, tokens = captured
            graph.replay()
        else:
            logits, tokens = self._forward(bucket, pages)
        if all(p.greedy for p in params):
            return tokens[:n].tolist()
        return sample(logits[:n], params, out_pos)

    def _forward(self, bucket: int, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the static inputs; every op is capturable (no host sync)."""
        ids, positions, slots, real = self.static[:, :bucket]
        real = real.bool()
        ps = self.kv.page_size
        out_locs = torch.where(real, self.table[slots, positions], 0)
        pages = self.table[slots, : num_pages * ps : ps]
        if ps > 1:
            pages = pages // ps
        pages = pages.masked_fill(~real[:, None], 0)
        kv_lens = torch.where(real, positions + 1, 1)
        attention = PagedAttention.decode(self.kv, out_locs, pages, kv_lens, self.layer_windows)
        logits = self.model(ids, positions, attention)
        return logits, argmax_rows(logits)

    def _graph(self, bucket: int, num_pages: int) -> _Captured | None:
        key = (bucket, num_pages)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, num_pages) if self.capture else None
        return self._graphs[key]

    def _capture(self, bucket: int, num_pages: int) -> _Captured:
        # NOTE: the static inputs hold this step's rows; capture runs the step on them
        # (writing their K/V, as the replay after it will again: the same values).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: lazily built tables, allocator, kernels
                self._forward(bucket, num_pages)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, tokens = self._forward(bucket, num_pages)
        self._pool = graph.pool()
        return graph, logits, tokens
