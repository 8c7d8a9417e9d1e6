"""The general step path's inputs (`ModelRunner.prepare`, whose positions, token slots and live
flags numpy builds from per-row values) equal what they mean, computed per token: mixed batches of
prefill chunks at offsets, decode rows, draft rows, rows without a slot, sampled and unsampled
rows, with and without the sampler's fields and extra sections."""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.model.batch import ScheduledSeq, row_tokens
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.runner import ModelRunner
from engine.model.sampling import SamplingBatch
from engine.model.step_types import StepInputs
from helpers import TEST_DEVICE
from resources.kv_buffers import KVBuffers
from resources.paging import round_up
from resources.request_slots import RequestSlots


def expected_inputs(runner: ModelRunner, seqs, batch=None, extra=()) -> list:
    """What `prepare` must give, from its definition, per token (no upload, no sections): each row's
    tokens and positions in order, each token's location in its row's slot (0 for a row without one),
    each row's pages up to the longest context (0 without a slot), the sampled rows' last tokens."""
    table, ps = runner.slots.req_to_token, runner.kv.page_size
    ids, positions, out_locs, page_rows, samples = [], [], [], [], []
    offset, width = 0, round_up(max(s.start + s.num_tokens for s in seqs), ps)
    for s in seqs:
        slot = runner.slot_of(s.request)
        span = range(s.start, s.start + s.num_tokens)
        ids += row_tokens(s)
        positions += span
        out_locs += [0 if slot is None else int(table[slot, p]) for p in span]
        pages = table[0 if slot is None else slot, :width:ps] // ps
        page_rows.append(pages * (slot is not None))
        offset += s.num_tokens
        if s.samples:
            samples += range(offset - min(s.num_tokens, len(s.draft) + 1), offset) if s.draft else [offset - 1]
    long = dict(dtype=torch.int64, device=table.device)
    fields = None if batch is None or batch.fields is None else torch.as_tensor(batch.fields, device=table.device)
    return [torch.tensor(ids, **long), torch.tensor(positions, **long), torch.tensor(out_locs, **long),
            torch.stack(page_rows), None if len(samples) == offset else torch.tensor(samples, **long), fields,
            [s.num_tokens for s in seqs], [s.start + s.num_tokens for s in seqs], ps,
            {name: torch.tensor(values, **long) for name, values in extra}]


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
def test_prepare_gives_each_token_its_row_position_and_location(shape):
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
        want = expected_inputs(runner, seqs, batch, extra)
        got = _snapshot(runner.prepare(seqs, batch, extra))
        assert [i for i, (a, b) in enumerate(zip(got, want)) if not _equal(a, b)] == [], (trial, shape)
        checked += 1
    assert checked == 6
