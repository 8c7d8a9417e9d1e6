"""HiSparse's per-layer batching (what a CUDA step relies on), checked on the host:
batched top-k selection equals the row-by-row one with one read-back per layer;
decode backups are one staged copy per layer that lands in the host rows only
after its event, before anything reads or frees them."""

from __future__ import annotations

import pytest
import torch

import hisparse.attention as sparse_attention
from engine import Engine
from hisparse import HiSparseConfig
from hisparse.copies import HostCopier
from helpers import hisparse_state, run_all, small_config

PROMPTS = [list(range(1, 40)), [(7 * i) % 250 for i in range(70)], [5, 17, 42, 99, 3, 8, 120, 77, 31] * 3]
CONFIG = HiSparseConfig(top_k=8, device_buffer_size=12, recent_window=2, index_dim=16)


class FakeEvent:
    """A CUDA event stand-in: done once `finish()` is called; logs synchronize and query calls."""

    log: list[str] = []

    def __init__(self) -> None:
        self.finished = False

    def record(self, stream=None) -> None:
        FakeEvent.log.append("record")

    def finish(self) -> None:
        self.finished = True

    def query(self) -> bool:
        FakeEvent.log.append("query")
        return self.finished

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")
        self.finished = True


class DoneEvent(FakeEvent):
    """An event whose copies are done as soon as it is recorded (a quick device)."""

    def __init__(self) -> None:
        self.finished = True


async def _traced(batched: bool, reads: list[int] | None = None, copier=None) -> tuple[list, list]:
    async with Engine(small_config(hisparse=CONFIG)) as engine:
        state = hisparse_state(engine)
        state.batched_selection = batched
        if copier is not None:
            state.copier = copier
        state.trace = []
        tokens = await run_all(engine, PROMPTS, 10)
    return tokens, state.trace


def _keys(trace: list) -> list[tuple[int, int, int]]:
    """(request by order of first appearance, position, layer) of each trace entry."""
    order: dict[str, int] = {}
    return [(order.setdefault(e["request_id"], len(order)), e["position"], e["layer"]) for e in trace]


class TestBatchedSelection:
    @pytest.mark.asyncio
    async def test_batched_top_k_equals_row_by_row(self, monkeypatch):
        """Every row's selection and output are the same whether its top-k is taken alone or with the batch's."""
        expected_tokens, expected = await _traced(False)
        reads: list[int] = []
        original = sparse_attention.read_back

        def counting(parts):
            reads.append(len(parts))
            return original(parts)

        monkeypatch.setattr(sparse_attention, "read_back", counting)
        tokens, got = await _traced(True)
        assert tokens == expected_tokens
        assert len(got) == len(expected)
        by_key = {key: e for key, e in zip(_keys(expected), expected)}
        for key, entry in zip(_keys(got), got):
            other = by_key[key]
            assert entry["selected"].tolist() == other["selected"].tolist()
            torch.testing.assert_close(entry["out"], other["out"], atol=1e-5, rtol=1e-5)
        scored_layers = {(e["position"], e["layer"]) for e in got if e["position"] > CONFIG.top_k}
        assert reads and all(n == 1 for n in reads)  # one tensor per read: every row's selection at once
        # at most one read per layer of a step with scored rows (rows of one step share it)
        assert len(reads) <= len(scored_layers) * len(PROMPTS)
        assert len(reads) < sum(1 for e in got if e["position"] > CONFIG.top_k)


class TestDeferredBackups:
    def test_backups_land_only_after_their_event(self):
        """A staged backup leaves the host rows untouched until its event is waited for; its fence is
        open until the event completes; apply_backups synchronizes first, then scatters."""
        FakeEvent.log = []
        copier = HostCopier(torch.device("cpu"), fence_timeout=5.0, deferred=True, events=FakeEvent)
        dst = torch.zeros(10, 2, 3)
        rows = torch.tensor([7, 2, 5])
        src = torch.arange(18, dtype=torch.float32).view(3, 2, 3)
        copier.backup(0, dst, rows, src)
        copier.backup(1, dst, torch.tensor([1, 0, 9]), src + 100)
        fence = copier.fence({"hisparse_host"}, "r1")
        assert not fence.done() and torch.count_nonzero(dst) == 0
        copier.apply_backups()
        assert [e for e in FakeEvent.log if e != "query"] == ["record", "synchronize"]
        assert torch.equal(dst[rows], src) and torch.equal(dst[torch.tensor([1, 0, 9])], src + 100)
        assert fence.done()
        copier.apply_backups()  # nothing pending: no second wait
        assert [e for e in FakeEvent.log if e != "query"] == ["record", "synchronize"]

    def test_drain_lands_backups_without_a_fence(self):
        """A step that failed before its fence: drain still lands what was staged (no event to wait for)."""
        copier = HostCopier(torch.device("cpu"), fence_timeout=5.0, deferred=True, events=FakeEvent)
        dst = torch.zeros(4, 2)
        copier.backup(0, dst, torch.tensor([3]), torch.ones(1, 2))
        copier.drain()
        assert dst[3].tolist() == [1.0, 1.0] and dst[:3].abs().sum() == 0

    @pytest.mark.asyncio
    async def test_engine_with_staged_backups_decodes_the_same(self):
        """Decode backups staged and landed at the next step (as on CUDA) give the same tokens and
        selections as direct copies, and every pool is whole at the end (the conftest checks)."""
        expected_tokens, expected = await _traced(False)
        async with Engine(small_config(hisparse=CONFIG)) as engine:
            state = hisparse_state(engine)
            copier = HostCopier(torch.device("cpu"), fence_timeout=5.0, deferred=True, events=DoneEvent)
            state.copier = copier
            state.trace = []
            tokens = await run_all(engine, PROMPTS, 10)
            got = state.trace
        assert tokens == expected_tokens
        assert [e["selected"].tolist() for e in got] == [e["selected"].tolist() for e in expected]
        assert not copier._pending
