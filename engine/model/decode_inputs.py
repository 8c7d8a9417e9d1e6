"""A plain decode step's inputs on a short path.

Most steps of a running engine are plain decode steps: every row is one new
token of a request that holds a slot of the token table, and every row is
sampled. Their inputs are three int sections (token ids, positions, slots)
and the sampler's fields, in the runner's one upload
(`engine.model.step_upload`); their attention plan is one `ContextBatch` of
all rows. `decode_inputs` builds exactly what the general path
(`ModelRunner.prepare`, then `PagedAttention`) builds for such a step, the
same tensors with the same values, with none of its general machinery: no
section layout, no `AttentionMetadata` checks, no host lists turned into
tensors (the context lengths and query positions are the uploaded positions,
on the device). At batch 1 that machinery cost about as much as the rest of
the engine's work per token.

Nothing is kept from one step to the next: every step reads the token table
afresh (a request's pages change when it grows, publishes or trims), so
nothing here can go stale.

Any other step (a prefill chunk, a draft, a row without a slot, prompt
logprobs, an attention backend other than `PagedAttention`) returns None and
takes the general path. `tests/test_decode_inputs.py` holds both paths to
the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from torch import Tensor

from engine.model.attention import PagedAttention
from engine.model.batch import ScheduledSeq
from engine.model.native_kernels import NativeKernels
from engine.model.paged_attend import ContextBatch
from engine.model.step_upload import StepUpload
from resources.kv_buffers import KVBuffers
from resources.paging import round_up
from states import Request

#: (token ids [B], positions [B], the step's attention, the sampler's fields [6, B] or None)
DecodeInputs = tuple[Tensor, Tensor, PagedAttention, "Tensor | None"]


def plain_rows(seqs: Sequence[ScheduledSeq], slot_of: Callable[[Request], int | None], *,
               ids: bool = True) -> tuple[list[int], list[int], list[int]] | None:
    """A plain decode batch's token ids (each row's last token; empty with `ids` False), positions
    and token-table slots; None when `seqs` is empty or not one (a row of several tokens, a draft,
    a row that does not sample, a request without a slot)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in seqs:
        if s.num_tokens != 1 or s.draft or not s.samples:
            return None
        request = s.request
        slot = slot_of(request)
        if slot is None:
            return None
        start = s.start
        if ids:
            prompt = request.prompt_token_ids
            tokens.append(prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)])
        positions.append(start)
        slots.append(slot)
    return (tokens, positions, slots) if positions else None


def decode_inputs(seqs: Sequence[ScheduledSeq], fields: np.ndarray | None, *, upload: StepUpload, table: Tensor,
                  host_table: np.ndarray | None, kv: KVBuffers, slot_of: Callable[[Request], int | None],
                  layer_windows: tuple[int | None, ...], kernel: NativeKernels | None = None,
                  next_ids: Sequence[int] | None = None) -> DecodeInputs | None:
    """The inputs of a plain decode step (module docstring), or None when `seqs` is not one.
    `fields`: the sampler's host fields (`SamplingBatch.fields`), uploaded with the rest;
    `host_table`: the token table `table` itself as a host array, when it lives on the host (the
    locations and pages are then read there and uploaded, not gathered on the device);
    `next_ids`: the rows' token ids when the requests do not hold them yet (a decode run's later
    steps, `engine.model.decode_run`: each row's token is the one the step before sampled)."""
    rows = plain_rows(seqs, slot_of, ids=next_ids is None)
    if rows is None:
        return None
    ids, positions, slots = rows
    if next_ids is not None:
        ids = list(next_ids)
    n = len(positions)
    ps = kv.page_size
    longest = max(positions) + 1
    width = round_up(longest, ps)
    # the upload: ids | positions | context lengths | then, from a host table, the new tokens'
    # locations | the page table [B, columns]; else the slots (the device gathers both)
    # NOTE: every torch or numpy call here runs with cold caches (the forward before it
    # streamed the weights through them), so the fewest calls win, not the fewest Python steps
    head = ids + positions + [p + 1 for p in positions]
    page_rows = None
    columns = 0
    if host_table is not None:
        head += [host_table[slot, p] for slot, p in zip(slots, positions)]
        if n == 1:  # one row: its pages as Python ints, in the same write as the rest
            row = host_table[slots[0], :width:ps].tolist()
            columns = len(row)
            head += [page // ps for page in row] if ps > 1 else row
        else:
            page_rows = host_table[slots, :width:ps]
            columns = page_rows.shape[1]
        size = 4 * n + n * columns
    else:
        head += slots
        size = 4 * n
    words = size if fields is None else size + fields.size
    host = upload.start(words)
    host[: len(head)] = head
    if page_rows is not None:
        np.floor_divide(page_rows, ps, out=host[4 * n : size].reshape(page_rows.shape))
    if fields is not None:
        host[size:words] = fields.reshape(-1)
    sizes = [n, n, n, n]
    if columns:
        sizes.append(n * columns)
    if fields is not None:
        sizes.append(fields.size)
    parts = upload.send_sections(sizes)  # NOTE: one call for every section's view
    ids_t, pos_t, lens_t, fourth = parts[:4]
    if columns:
        out_locs, pages = fourth, parts[4].view(n, columns)
    else:
        out_locs = table[fourth, pos_t]
        pages = table[fourth, :width:ps]
        if ps > 1:
            pages = pages // ps
    # NOTE: a row's context is its position + 1 tokens and its one query sits at its position
    context = ContextBatch(pages, ps, lens_t, pos_t.view(n, 1), longest if min(positions) + 1 == longest else None,
                           q_len=1)
    attention = PagedAttention.decode_rows(kv, out_locs, context, longest, layer_windows, kernel)
    return ids_t, pos_t, attention, None if fields is None else parts[-1].view(fields.shape)
