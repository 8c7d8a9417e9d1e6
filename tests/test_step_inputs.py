"""The general step path's inputs (`ModelRunner.prepare`) are bit-identical to those of its
per-token form (the form before positions, token slots and live flags were built with numpy):
mixed batches of prefill chunks at offsets, decode rows, draft rows, rows without a slot,
sampled and unsampled rows, with and without the sampler's fields and extra sections."""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.model.attention import AttentionMetadata
from engine.model.batch import ScheduledSeq, row_tokens
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.runner import ModelRunner
from engine.model.sampling import SamplingBatch
from engine.model.step_types import StepInputs
from engine.model.step_upload import Sections
from helpers import TEST_DEVICE
from resources.kv_buffers import KVBuffers
from resources.paging import round_up
from resources.request_slots import RequestSlots


def per_token_prepare(self: ModelRunner, seqs, batch=None, extra=()) -> StepInputs:
    """`ModelRunner.prepare` as it was: every per-token list built in Python (the reference)."""
    ids, positions, q_lens, kv_lens, slots, live, samples = [], [], [], [], [], [], []
    decode_only = True
    offset = 0
    for s in seqs:
        request, start, n = s.request, s.start, s.num_tokens
        end = start + n
        if n == 1 and not s.draft:
            prompt = request.prompt_token_ids
            ids.append(prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)])
            positions.append(start)
        else:
            decode_only = False
            ids.extend(row_tokens(s))
            positions.extend(range(start, end))
        q_lens.append(n)
        kv_lens.append(end)
        slot = self.slot_of(request)
        slots.append(0 if slot is None else slot)
        live.append(slot is not None)
        offset += n
        if s.samples:
            if s.draft:
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
    host = self.upload.start(layout.size)
    layout.write(host, "ids", ids)
    layout.write(host, "positions", positions)
    layout.write(host, "slots", slots)
    if not decode_only:
        layout.write(host, "token_slots", [slot for slot, n in zip(slots, q_lens) for _ in range(n)])
    if not all_live:
        layout.write(host, "live", live)
        if not decode_only:
            layout.write(host, "token_live", [flag for flag, n in zip(live, q_lens) for _ in range(n)])
    if not every_row:
        layout.write(host, "samples", samples)
    if fields is not None:
        layout.write(host, "fields", fields.reshape(-1))
    for name, values in extra:
        layout.write(host, name, values)
    dev = self.upload.send(layout.size)
    ids_t, pos_t, slots_t = layout.view(dev, "ids"), layout.view(dev, "positions"), layout.view(dev, "slots")
    token_slots = slots_t if decode_only else layout.view(dev, "token_slots")
    table = self.slots.req_to_token
    out_locs = table[token_slots, pos_t]
    ps = self.kv.page_size
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


class _Request:
    def __init__(self, prompt: list[int], output: list[int], params: SamplingParams) -> None:
        self.prompt_token_ids, self.output_token_ids, self.params = prompt, output, params


def _runner() -> tuple[ModelRunner, dict[int, int | None]]:
    device = torch.device(TEST_DEVICE)
    slots = RequestSlots(16, 512, 4, device)
    # stale, distinct entries everywhere: a wrong slot or position reads a different location
    slots.req_to_token.copy_(torch.randperm(slots.req_to_token.numel(), device=device).view_as(slots.req_to_token))
    kv = KVBuffers(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=8,
                   dtype=torch.float32, device=device)
    model = LlamaModel.from_seed(ModelConfig.tiny(num_layers=1), 0, device=device)
    slot_map: dict[int, int | None] = {}
    return ModelRunner(model, kv, slots, device, slot_of=lambda r: slot_map[id(r)], cuda_graphs=False), slot_map


def _batch(rng: random.Random, slot_map: dict[int, int | None], *, chunks: int, decodes: int, drafts: int,
           unslotted: int) -> list[ScheduledSeq]:
    """Rows in a shuffled order: prefill chunks at offsets (the last one samples, a chunk that
    crosses into the outputs), decode rows, verify rows with drafts; `unslotted` rows have no slot."""
    greedy, sampled = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.7, seed=3)
    rows: list[ScheduledSeq] = []
    free = list(range(16))
    rng.shuffle(free)

    def request(prompt_len: int, outputs: int) -> _Request:
        r = _Request([rng.randrange(1000) for _ in range(prompt_len)], [rng.randrange(1000) for _ in range(outputs)],
                     rng.choice((greedy, sampled)))
        slot_map[id(r)] = free.pop()
        return r

    for i in range(chunks):
        start, n = rng.choice((0, 4, 37, 64)), rng.choice((1 + i % 2, 16, 45, 96))
        r = request(start + n + rng.choice((0, 3)), 0 if i % 3 else 5)
        rows.append(ScheduledSeq(r, start, n, samples=rng.random() < 0.5))
    for _ in range(decodes):
        r = request(rng.randrange(5, 120), rng.randrange(1, 30))
        rows.append(ScheduledSeq(r, len(r.prompt_token_ids) + len(r.output_token_ids) - 1, 1,
                                 samples=rng.random() < 0.8))
    for _ in range(drafts):
        r = request(rng.randrange(5, 60), rng.randrange(1, 9))
        draft = tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 4)))
        kv_len = len(r.prompt_token_ids) + len(r.output_token_ids)
        rows.append(ScheduledSeq(r, kv_len - 1, 1 + len(draft), samples=True, draft_budget=len(draft), draft=draft))
    rng.shuffle(rows)
    for s in rows[:unslotted]:
        slot_map[id(s.request)] = None
    return rows


def _snapshot(inputs: StepInputs) -> list:
    meta = inputs.meta
    got: list = [inputs.ids, inputs.positions, meta.out_locs, meta.kv_pages, inputs.sample_rows, inputs.fields]
    got = [None if t is None else t.clone() for t in got]  # the views are of a buffer the next step reuses
    return [*got, list(meta.q_lens), list(meta.kv_lens), meta.page_size,
            {name: t.clone() for name, t in inputs.extra.items()}]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


SHAPES = [  # chunks, decodes, drafts, unslotted
    (1, 0, 0, 0), (3, 0, 0, 0), (4, 6, 0, 0), (4, 6, 2, 0), (2, 5, 0, 2), (5, 3, 3, 1),
    (0, 7, 0, 0), (0, 5, 0, 2), (0, 3, 2, 0),
]


@pytest.mark.parametrize("shape", SHAPES, ids=["-".join(map(str, s)) for s in SHAPES])
def test_prepare_equals_the_per_token_form(shape):
    runner, slot_map = _runner()
    rng = random.Random(hash(shape) & 0xFFFF)
    checked = 0
    for trial in range(6):
        seqs = _batch(rng, slot_map, chunks=shape[0], decodes=shape[1], drafts=shape[2], unslotted=shape[3])
        sampled = [s for s in seqs if s.samples]
        batch = None
        if sampled and trial % 2:
            batch = SamplingBatch([s.request.params for s in sampled], [s.start for s in sampled])
        extra = (("drafts", [rng.randrange(9) for _ in range(3)]),) if trial % 3 == 2 else ()
        want = _snapshot(per_token_prepare(runner, seqs, batch, extra))
        got = _snapshot(runner.prepare(seqs, batch, extra))
        assert all(_equal(a, b) for a, b in zip(got, want)), (trial, shape)
        assert got[1].tolist() == [p for s in seqs for p in range(s.start, s.start + s.num_tokens)]
        checked += 1
    assert checked == 6
