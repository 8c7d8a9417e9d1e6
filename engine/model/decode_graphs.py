"""Decode steps from static buffers, captured as CUDA graphs at startup.

A decode-only step of B sequences runs as the graph captured for the
smallest batch bucket >= B. Graphs are keyed by batch bucket alone: the
graph attends over the whole token-table row (the engine's max_context,
masked by each row's length), so no step ever needs a graph that is not
there. Every input lives in one static device buffer, filled by the step's
one host-to-device copy (`engine.model.step_upload`)::

    inputs[0, :bucket]  token ids      (padding rows: 0)
    inputs[1, :bucket]  positions      (padding rows: 0)
    inputs[2, :bucket]  request slots  (padding rows: 0)
    inputs[3, :bucket]  1 = a real row, 0 = padding
    then the sampler's fields [6, largest bucket] (`engine.model.sampling`)

and everything else is computed inside the graph from them: the new tokens'
locations and the page table (read from the request -> token table, as the
eager runner does), the attention plan, the forward pass (MoE layers
included, when their expert matmuls need no host sync), the greedy argmax,
the routed experts. Sampling and logprobs run on the graph's logits after
the replay, so any batch of decode rows can take the graph.
NOTE: a padding row writes its K/V to location 0 (the reserved padding page)
and attends over the padding page alone, so it never touches a request's
pages, whatever the request in slot 0 holds.

Capture (`capture_all`) runs once, when the runner is built, before the
engine starts any thread: on the engine's device, from a side stream that
first waits for the compute stream, in thread-local capture mode (another
thread's CUDA work cannot invalidate it), inside try/finally so that a
failed capture always ends and the thread is back on its own stream. A
capture that fails disables the graphs (every step runs eagerly). Buckets
follow vLLM's capture sizes (1, 2, 4, 8, then multiples of 16 up to
`max_batch`); all share one memory pool.

With ``capture=False`` the same static step runs eagerly on any device,
which is how CPU tests check it against the eager runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from engine.model.attention import PagedAttention
from engine.model.batch import ScheduledSeq
from engine.model.llama import LlamaModel
from engine.model.sampling import FIELD_ROWS, argmax_rows
from engine.model.step_upload import StepUpload
from resources.device_io import compute_stream, on_device
from resources.kv_buffers import KVBuffers
from resources.request_slots import RequestSlots
from states import Request

log = structlog.get_logger("kvlife.decode_graphs")

#: rows of the static inputs (the sampler's `FIELD_ROWS` rows of fields follow them)
IDS, POSITIONS, SLOTS, REAL = range(4)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class _Captured:
    """One bucket's graph and its static outputs."""

    __slots__ = ("graph", "logits", "tokens", "routing")

    def __init__(self, graph: Any, logits: torch.Tensor, tokens: torch.Tensor, routing: torch.Tensor | None) -> None:
        self.graph, self.logits, self.tokens, self.routing = graph, logits, tokens, routing


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv: KVBuffers, slots: RequestSlots, device: torch.device, *,
                 max_batch: int, layer_windows: tuple[int | None, ...] = (), capture: bool = True) -> None:
        self.model, self.kv, self.table, self.device = model, kv, slots.req_to_token, device
        self.layer_windows = layer_windows
        self.capture = capture
        self.batch_sizes = batch_buckets(max_batch)
        self.largest = self.batch_sizes[-1]
        #: the static inputs, then the sampler's fields (see the module docstring)
        self.buffer = torch.zeros((4 + FIELD_ROWS) * self.largest, dtype=torch.int64, device=device)
        self.inputs = self.buffer[: 4 * self.largest].view(4, self.largest)
        self.fields = self.buffer[4 * self.largest :].view(FIELD_ROWS, self.largest)
        self._graphs: dict[int, _Captured] = {}
        self._pool: Any = None
        #: set when a capture failed: every step runs eagerly
        self.disabled = False
        #: steps run from the static buffers (replays, or eager static steps when not capturing)
        self.replays = 0

    def bucket(self, rows: int) -> int | None:
        """The batch bucket of a decode step of `rows` rows (None: more than the largest)."""
        return next((b for b in self.batch_sizes if b >= rows), None)

    # ------------------------------------------------------------ capture
    def capture_all(self) -> None:
        """Capture every bucket's graph (CUDA; see the module docstring). A failure disables them all."""
        if not self.capture or self.disabled:
            return
        try:
            with on_device(self.device):
                for bucket in self.batch_sizes:
                    self._graphs[bucket] = self._capture(bucket)
        except Exception as exc:  # noqa: BLE001 - a capture that fails must not fail the engine: run eagerly
            self.disabled = True
            self._graphs.clear()
            log.warning("decode_graphs.disabled", error=repr(exc), device=str(self.device))

    def _capture(self, bucket: int) -> _Captured:
        # NOTE: the static inputs are zeros: padding rows, which write only the padding page
        main = compute_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: lazily built tables, allocator, kernels
                self._forward(bucket)
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):  # NOTE: left on every path, so this thread is back on its own stream
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                logits, tokens, routing = self._forward(bucket)
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture is invalid anyway: report the first error
                    pass
                raise
            graph.capture_end()
        main.wait_stream(side)
        self._pool = graph.pool()
        return _Captured(graph, logits, tokens, routing)

    # -------------------------------------------------------------- steps
    def run(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Run the step whose inputs are in `inputs[:, :bucket]` (written by the caller's upload):
        (logits, greedy tokens, routing [layers, rows, top_k] or None) of its `rows` real rows,
        on the device; None when the graphs are disabled."""
        bucket = self.bucket(rows)
        if self.disabled or bucket is None:
            return None
        self.replays += 1
        if self.capture:
            captured = self._graphs.get(bucket)
            if captured is None:
                return None
            captured.graph.replay()
            logits, tokens, routing = captured.logits, captured.tokens, captured.routing
        else:
            logits, tokens, routing = self._forward(bucket)
        return logits[:rows], tokens[:rows], None if routing is None else routing[:, :rows]

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step on the static inputs; every op is capturable (no host sync)."""
        ids, positions, slots, real = self.inputs[:, :bucket]
        ps = self.kv.page_size
        out_locs = self.table[slots, positions] * real
        pages = self.table[slots, ::ps]
        if ps > 1:
            pages = pages // ps
        pages = pages * real[:, None]
        kv_lens = torch.where(real.bool(), positions + 1, 1)
        attention = PagedAttention.decode(self.kv, out_locs, pages, kv_lens, self.layer_windows)
        routing: list[torch.Tensor] = []
        logits = self.model(ids, positions, attention, routing=routing)
        return logits, argmax_rows(logits), torch.stack(routing) if routing else None

    def replay(self, seqs: Sequence[ScheduledSeq], fields: np.ndarray | None, upload: StepUpload,
               slot_of: Callable[[Request], int | None], next_ids: Sequence[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """A decode-only batch through its graph (the runner's path for one): the inputs, and the
        sampler's `fields` if any, in one upload straight into the static buffer, then the replay;
        (logits, greedy ids, routing, fields on the device). None: the batch does not fit a graph.
        `next_ids`: the rows' token ids at a decode run's later step (`engine.model.decode_run`)."""
        ids, positions, slots = [], [], []
        for row, s in enumerate(seqs):
            request = s.request
            slot = slot_of(request)
            if s.num_tokens != 1 or request.mm_inputs or slot is None:
                return None
            prompt = request.prompt_token_ids
            ids.append(next_ids[row] if next_ids is not None else
                       prompt[s.start] if s.start < len(prompt) else request.output_token_ids[s.start - len(prompt)])
            positions.append(s.start)
            slots.append(slot)
        largest = self.largest
        if self.disabled or len(seqs) > largest:
            return None
        words = (4 + FIELD_ROWS) * largest if fields is not None else 4 * largest
        host = upload.start(words)
        self.write_inputs(host, largest, ids, positions, slots)
        if fields is not None:
            # the fields region is [6, largest]; this step's rows are its first columns
            host[4 * largest : words].reshape(FIELD_ROWS, largest)[:, : len(seqs)] = fields
        upload.send(words, into=self.buffer)
        ran = self.run(len(seqs))
        if ran is None:
            return None
        logits, greedy, routing = ran
        return logits, greedy, routing, None if fields is None else self.fields[:, : len(seqs)]

    @staticmethod
    def write_inputs(host: Any, largest: int, ids: Sequence[int], positions: Sequence[int],
                     slots: Sequence[int]) -> None:
        """Fill the static inputs' words (a [4 * largest] host view) for one step; padding rows zero."""
        n = len(ids)
        view = host[: 4 * largest].reshape(4, largest)
        view[:, n:] = 0
        view[IDS, :n] = ids
        view[POSITIONS, :n] = positions
        view[SLOTS, :n] = slots
        view[REAL, :n] = 1
