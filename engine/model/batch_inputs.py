"""A step's tensors on the general path: any batch of prefill chunks, drafts
and decode rows (a plain decode step takes `engine.model.decode_inputs`).

One pass over the rows builds the token ids, positions, token-table rows,
live flags, sampled rows and the sampler's fields; per-token values (a
chunk's positions, its slot and flag for every token) are written with
numpy from per-row values, never as lists built per token. Everything goes
into one upload (`engine.model.step_upload`); the new tokens' locations and
the page table are read on the device from the request -> token table.
`tests/test_step_inputs.py` holds the tensors equal to the per-token form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from torch import Tensor

from engine.model.attention import AttentionMetadata
from engine.model.batch import ScheduledSeq, row_tokens
from engine.model.sampling import SamplingBatch
from engine.model.step_types import StepInputs
from engine.model.step_upload import Sections, StepUpload
from resources.kv_buffers import KVBuffers
from resources.paging import round_up
from states import Request


def batch_inputs(seqs: Sequence[ScheduledSeq], batch: SamplingBatch | None, extra: Sequence[tuple[str, Sequence[int]]],
                 *, upload: StepUpload, table: Tensor, kv: KVBuffers,
                 slot_of: Callable[[Request], int | None]) -> StepInputs:
    """The batch's tensors, from one pass over `seqs`, one upload and no host sync (`extra`: named
    int sections uploaded with them, in `StepInputs.extra`); `table` is the token table."""
    ids: list[int] = []
    starts: list[int] = []
    shifts: list[int] = []  # a row's first position less its first token's place in the step
    q_lens: list[int] = []
    kv_lens: list[int] = []
    slots: list[int] = []
    live: list[bool] = []
    samples: list[int] = []
    decode_only = True
    offset = 0
    for s in seqs:
        request, start, n = s.request, s.start, s.num_tokens
        end = start + n
        if n == 1 and not s.draft:
            prompt = request.prompt_token_ids
            ids.append(prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)])
        else:
            decode_only = False
            ids.extend(row_tokens(s))
        starts.append(start)
        shifts.append(start - offset)
        q_lens.append(n)
        kv_lens.append(end)
        # NOTE: slot_of is None for rows whose backend keeps their KV itself (HiSparse
        # decode rows): their locations read as the padding page 0.
        slot = slot_of(request)
        slots.append(0 if slot is None else slot)
        live.append(slot is not None)
        offset += n
        if s.samples:
            if s.draft:  # from the request's last token on (a verify row: it and each draft)
                samples.extend(range(offset - min(n, len(s.draft) + 1), offset))
            else:
                samples.append(offset - 1)
    every_row = len(samples) == offset
    all_live = all(live)
    layout = Sections()
    for name, words in (("ids", offset), ("positions", offset), ("slots", len(seqs))):
        layout.add(name, words)
    if not decode_only:
        layout.add("token_slots", offset)
    if not all_live:
        layout.add("live", len(seqs))
        if not decode_only:
            layout.add("token_live", offset)
    if not every_row:
        layout.add("samples", len(samples))
    fields = batch.fields if batch is not None else None
    if fields is not None:
        layout.add("fields", fields.size)
    for name, values in extra:
        layout.add(name, len(values))
    host = upload.start(layout.size)
    layout.write(host, "ids", ids)
    layout.write(host, "slots", slots)
    if not all_live:
        layout.write(host, "live", live)
    if decode_only:  # one token a row: the row's start
        layout.write(host, "positions", starts)
    else:  # per token (numpy, no Python per token): positions on from each row's start, its slot, its flag
        counts = np.array(q_lens, dtype=np.int64)
        layout.write_ranges(host, "positions", np.array(shifts, dtype=np.int64), counts)
        layout.write_repeated(host, "token_slots", layout.section(host, "slots"), counts)
        if not all_live:
            layout.write_repeated(host, "token_live", layout.section(host, "live"), counts)
    if not every_row:
        layout.write(host, "samples", samples)
    if fields is not None:
        layout.write(host, "fields", fields.reshape(-1))
    for name, values in extra:
        layout.write(host, name, values)
    dev = upload.send(layout.size)
    ids_t, pos_t, slots_t = layout.view(dev, "ids"), layout.view(dev, "positions"), layout.view(dev, "slots")
    token_slots = slots_t if decode_only else layout.view(dev, "token_slots")
    out_locs = table[token_slots, pos_t]
    # NOTE: the page table is read straight from the token table (locations are
    # page * page_size + offset); columns past a row's context may name any page
    # (stale entries), which attention masks out and only ever reads.
    ps = kv.page_size
    pages = table[slots_t, : round_up(max(kv_lens), ps) : ps]
    if ps > 1:
        pages = pages // ps
    if not all_live:
        live_t = layout.view(dev, "live")
        out_locs = out_locs * (live_t if decode_only else layout.view(dev, "token_live"))
        pages = pages * live_t[:, None]
    meta = AttentionMetadata(out_locs=out_locs, q_lens=q_lens, kv_lens=kv_lens, kv_pages=pages, page_size=ps)
    sample_rows = None if every_row else layout.view(dev, "samples")
    fields_t = None if fields is None else layout.view(dev, "fields").view(fields.shape)
    sections = {name: layout.view(dev, name) for name, _ in extra}
    return StepInputs(ids_t, pos_t, meta, sample_rows, fields_t, sections)
