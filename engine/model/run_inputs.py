"""A decode run's inputs, for all its steps, in one upload at its first step.

Within a run (`engine.model.decode_run`) every step's inputs but the token ids
are known before it starts: step j of a row is its position + j, its context
one token longer, its new token's KV slot the token table's entry there (the
planner extended every row for the whole run), and its pages those of the
run's last step cut to the step's own width. So the first step writes them
all, with the rows' first ids and one page table for the whole run, into
the runner's upload (one copy on CUDA), and each later step only takes views
of it and the token ids the step before sampled, which stay on the device:
no host list, no write, no copy. `decode_inputs` would build the same
tensors step by step (`tests/test_decode_runs.py` compares them).

Only for steps whose sampler needs no fields (greedy rows, logprobs for all
rows or none): a seeded row's fields change with every step, and such runs
take `decode_inputs` at each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from torch import Tensor

from engine.model.attention import PagedAttention
from engine.model.batch import ScheduledSeq
from engine.model.decode_inputs import DecodeInputs, plain_rows
from engine.model.native_kernels import NativeKernels
from engine.model.paged_attend import ContextBatch
from engine.model.step_upload import StepUpload
from resources.kv_buffers import KVBuffers
from resources.paging import round_up
from states import Request


class RunInputs:
    """Every step's inputs of one decode run (module docstring); `step(ahead, ids)` gives one."""

    __slots__ = ("n", "ps", "longest", "equal", "ids", "positions", "queries", "lens", "locs", "pages", "widths",
                 "slots", "table", "kv", "layer_windows", "kernel")

    def __init__(self, kv: KVBuffers, table: Tensor, layer_windows: tuple[int | None, ...],
                 kernel: NativeKernels | None, positions: list[int]) -> None:
        self.n, self.ps, self.kv, self.table = len(positions), kv.page_size, kv, table
        self.layer_windows, self.kernel = layer_windows, kernel
        #: the first step's longest context, and whether every row's is that long
        self.longest = max(positions) + 1
        self.equal = min(positions) + 1 == self.longest
        #: the uploaded views (`build`): the first step's ids; per step, positions, the same as
        #: [n, 1] queries, context lengths and new-token locations; the page table at the run's width
        self.ids: Tensor
        self.positions: tuple[Tensor, ...]
        self.queries: tuple[Tensor, ...]
        self.lens: tuple[Tensor, ...]
        self.locs: tuple[Tensor, ...] | None = None
        self.pages: Tensor
        self.slots: Tensor | None = None
        #: the page table cut to a step's width (it changes once a page)
        self.widths: dict[int, Tensor] = {}

    @classmethod
    def build(cls, seqs: Sequence[ScheduledSeq], steps: int, *, upload: StepUpload, table: Tensor,
              host_table: np.ndarray | None, kv: KVBuffers, slot_of: Callable[[Request], int | None],
              layer_windows: tuple[int | None, ...], kernel: NativeKernels | None = None) -> RunInputs | None:
        """The run's inputs uploaded, or None when `seqs` is not a plain decode batch (then
        `decode_inputs` says why not)."""
        plain = plain_rows(seqs, slot_of)
        if plain is None:
            return None
        ids, positions, slots = plain
        n = len(positions)
        self = cls(kv, table, layer_windows, kernel, positions)
        ps = self.ps
        # step j of row r: position p_r + j, context p_r + j + 1; step-major ([steps, n]), in numpy
        # (a run of 8 steps at batch 128 reads 1,024 token-table entries: one indexing, not 1,024)
        grid = np.add.outer(np.arange(steps, dtype=np.int64), np.asarray(positions, dtype=np.int64))
        cells = n * steps
        width = round_up(self.longest + steps - 1, ps)  # the run's last step
        if host_table is not None:
            rows = np.asarray(slots, dtype=np.int64)
            page_rows = host_table[rows, :width:ps]
            columns = page_rows.shape[1]
            size = n + 3 * cells + n * columns
        else:
            size = n + 2 * cells + n
        host = upload.start(size)
        host[:n] = ids
        host[n : n + cells] = grid.reshape(-1)
        np.add(grid.reshape(-1), 1, out=host[n + cells : n + 2 * cells])
        sizes = [n, cells, cells]
        if host_table is not None:
            host[n + 2 * cells : n + 3 * cells] = host_table[rows[None, :], grid].reshape(-1)
            np.floor_divide(page_rows, ps, out=host[n + 3 * cells : size].reshape(page_rows.shape))
            sizes += [cells, n * columns]
        else:
            host[n + 2 * cells : size] = slots
            sizes.append(n)
        parts = upload.send_sections(sizes)
        # NOTE: each step's views made here in a few calls (`unbind`), not a handful of ops per step
        self.ids = parts[0]
        self.positions = parts[1].view(steps, n).unbind(0)
        self.queries = parts[1].view(steps, n, 1).unbind(0)
        self.lens = parts[2].view(steps, n).unbind(0)
        if host_table is not None:
            self.locs, self.pages = parts[3].view(steps, n).unbind(0), parts[4].view(n, columns)
        else:
            self.slots = parts[3]
            pages = table[self.slots, :width:ps]
            self.pages = pages // ps if ps > 1 else pages
        return self

    def step(self, ahead: int, ids: Tensor | None = None) -> DecodeInputs:
        """Step `ahead` of the run (0: the first, with the uploaded ids); `ids`: the token ids
        the step before sampled, on the device."""
        ps = self.ps
        pos_t = self.positions[ahead]
        longest = self.longest + ahead
        columns = -(-longest // ps)
        pages = self.widths.get(columns)
        if pages is None:
            pages = self.widths[columns] = self.pages[:, :columns]
        out_locs = self.locs[ahead] if self.locs is not None else self.table[self.slots, pos_t]  # NOTE: on the device
        context = ContextBatch(pages, ps, self.lens[ahead], self.queries[ahead], longest if self.equal else None,
                               q_len=1)
        attention = PagedAttention.decode_rows(self.kv, out_locs, context, longest, self.layer_windows, self.kernel)
        return self.ids if ids is None else ids, pos_t, attention, None
