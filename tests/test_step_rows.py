"""A step's row count and the size classes the CPU projections are built for: a step that prefills a
full chunk beside decode rows is trimmed to end on a class (engine.runtime.scheduler), never below half
its budget; `size_class_below` is the class grid rounded down."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.runtime.scheduler import Scheduler
from resources.paging import size_class, size_class_below
from states import Request

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


def test_size_class_below_is_the_largest_class_at_most_n():
    for n in range(1, 20_000):
        below = size_class_below(n)
        assert below <= n and size_class(below) == below
        assert below == n or size_class(below + 1) > n  # no class between it and n


def _rows(scheduler: Scheduler, decoding: int, prompt: int) -> tuple[int, int]:
    decode = [Request(f"d{i}", [1, 2], PARAMS) for i in range(decoding)]
    long = Request("p", [3] * prompt, PARAMS)
    batch = scheduler.select_batch([long], decode)
    chunk = sum(s.num_tokens for s in batch if s.request is long)
    return chunk, sum(s.num_tokens for s in batch)


@pytest.mark.parametrize("budget,decoding,chunk", [
    (4096, 32, 4064),   # 4,128 rows would pad to 5,120: 4,096 rows instead
    (512, 64, 448),     # 576 would pad to 640
    (512, 1, 511),
    (512, 300, 468),    # 812 rows: 768, the class below
    (4096, 0, 4096),    # no decode rows: the whole budget
    (10, 100, 10),      # trimming would take more than half: the budget stays
])
def test_a_full_chunk_beside_decode_rows_ends_on_a_size_class(budget, decoding, chunk):
    scheduler = Scheduler(max_running=512, max_prefill_tokens=budget, page_size=16, priority_aging=None)
    got, rows = _rows(scheduler, decoding, 10_000)
    assert got == chunk
    assert rows == decoding + chunk
    if chunk < budget:
        assert size_class(rows) == rows and chunk * 2 >= budget


def test_a_prompt_shorter_than_the_budget_is_not_cut():
    scheduler = Scheduler(max_running=64, max_prefill_tokens=4096, page_size=16, priority_aging=None)
    assert _rows(scheduler, 32, 100) == (100, 132)
