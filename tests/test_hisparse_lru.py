"""Tests for hisparse.lru and hisparse.selection: the per-layer LRU against a
plain Python model (hypothesis), the swap-in never serving a stale slot, and
top-k selection with its recent window."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse import lru
from hisparse.selection import IndexProjection, select, select_top, top_positions


class _ModelLRU:
    """The LRU written the obvious way: dicts, lists and a sort."""

    def __init__(self, num_slots: int) -> None:
        self.slot_token = [-1] * num_slots
        self.last_used = [-1] * num_slots

    def assign(self, selected: list[int], stamp: int) -> tuple[list[int], list[bool]]:
        where = {t: s for s, t in enumerate(self.slot_token) if t >= 0}
        protected = {where[t] for t in selected if t in where}
        free = sorted((s for s in range(len(self.slot_token)) if s not in protected),
                      key=lambda s: (self.last_used[s], s))
        local, miss = [], []
        for t in selected:
            if t in where:
                local.append(where[t])
                miss.append(False)
            else:
                slot = free.pop(0)
                self.slot_token[slot] = t
                local.append(slot)
                miss.append(True)
        for slot in local:
            self.last_used[slot] = stamp
        return local, miss


class _BufferLRU:
    """One layer's LRU state as the device buffer keeps it, plus slot contents."""

    def __init__(self, num_slots: int, context: int, dim: int = 3) -> None:
        self.map = np.full(context, -1, dtype=np.int64)
        self.slot_token = np.full(num_slots, -1, dtype=np.int64)
        self.last_used = np.full(num_slots, -1, dtype=np.int64)
        self.slots = torch.full((num_slots, dim), float("nan"))
        self.host = torch.arange(context * dim, dtype=torch.float32).view(context, dim)

    def step(self, selected: list[int], stamp: int) -> tuple[list[int], list[bool]]:
        sel = np.array(selected, dtype=np.int64)
        local, miss = lru.assign(self.map, self.slot_token, self.last_used, sel, stamp)
        self.slots[torch.from_numpy(local[miss])] = self.host[torch.from_numpy(sel[miss])]  # the swap-in
        return local.tolist(), miss.tolist()


@st.composite
def _workloads(draw):
    num_slots = draw(st.integers(1, 8))
    context = draw(st.integers(num_slots, 24))
    steps = draw(st.lists(
        st.lists(st.integers(0, context - 1), unique=True, min_size=1, max_size=num_slots),
        min_size=1, max_size=12,
    ))
    return num_slots, context, steps


class TestLRUAgainstModel:
    @settings(max_examples=150, deadline=None)
    @given(_workloads())
    def test_same_slots_and_misses_as_the_model(self, workload):
        """Every step picks the same slots and the same misses as the plain model."""
        num_slots, context, steps = workload
        model, buffer = _ModelLRU(num_slots), _BufferLRU(num_slots, context)
        for stamp, selected in enumerate(steps, start=1):
            assert buffer.step(selected, stamp) == model.assign(selected, stamp)
            assert buffer.slot_token.tolist() == model.slot_token
            assert buffer.last_used.tolist() == model.last_used

    @settings(max_examples=150, deadline=None)
    @given(_workloads())
    def test_never_serves_a_stale_slot(self, workload):
        """After each swap-in every selected token's slot holds that token's host K/V."""
        num_slots, context, steps = workload
        buffer = _BufferLRU(num_slots, context)
        for stamp, selected in enumerate(steps, start=1):
            local, _ = buffer.step(selected, stamp)
            assert torch.equal(buffer.slots[local], buffer.host[selected])

    @settings(max_examples=150, deadline=None)
    @given(_workloads())
    def test_map_and_owners_agree(self, workload):
        """token -> slot and slot -> token are inverse maps after every step."""
        num_slots, context, steps = workload
        buffer = _BufferLRU(num_slots, context)
        for stamp, selected in enumerate(steps, start=1):
            buffer.step(selected, stamp)
            mapped = {t: s for t, s in enumerate(buffer.map.tolist()) if s >= 0}
            assert mapped == {t: s for s, t in enumerate(buffer.slot_token.tolist()) if t >= 0}


class TestPreload:
    def test_preload_then_hits(self):
        """Preloaded tokens are hits in their own slots; every layer at once."""
        maps = np.full((2, 10), -1, dtype=np.int64)
        owners = np.full((2, 6), -1, dtype=np.int64)
        used = np.full((2, 6), -1, dtype=np.int64)
        lru.preload(maps, owners, used, 4)
        local, miss = lru.assign(maps[1], owners[1], used[1], np.array([0, 3, 5]), 1)
        assert local.tolist() == [0, 3, 4] and miss.tolist() == [False, False, True]


class TestSelection:
    def test_short_context_selects_everything(self):
        """With no more tokens than top_k, every token is selected, in order."""
        keys = torch.randn(5, 4)
        assert select(keys, torch.randn(4), top_k=8, recent=2).tolist() == [0, 1, 2, 3, 4]

    def test_recent_window_and_top_scores(self):
        """The recent window is always in; the rest are the best scores; ascending."""
        keys = torch.zeros(10, 1)
        keys[:, 0] = torch.tensor([9.0, 1, 8, 2, 3, 0, 7, 1, -5, -6])
        chosen = select(keys, torch.ones(1), top_k=4, recent=2)
        assert chosen.tolist() == [0, 2, 8, 9]

    def test_top_positions_equals_select_top(self):
        """The host partition selects the same positions as torch.topk (distinct scores), ascending."""
        for seed in range(5):
            scores = torch.randn(3000, generator=torch.Generator().manual_seed(seed))
            expected = select_top(scores.clone(), top_k=256, recent=16).tolist()
            got = top_positions(scores.clone(), top_k=256, recent=16)
            assert got.dtype == np.int64 and got.tolist() == expected

    def test_exact_projection_sums_head_logits(self):
        """With index_dim >= kv_heads * head_dim, q_index . k_index is the sum of per-head logits."""
        proj = IndexProjection(num_heads=4, num_kv_heads=2, head_dim=3, index_dim=64, device=torch.device("cpu"),
                               dtype=torch.float32)
        q, k = torch.randn(1, 4, 3), torch.randn(1, 2, 3)
        expected = sum(float(q[0, h] @ k[0, h // 2]) for h in range(4))
        assert abs(float(proj.queries(q)[0] @ proj.keys(k)[0]) - expected) < 1e-5
