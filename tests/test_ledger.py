"""The ownership ledger, pool statistics, and the leak check's attribution."""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

from helpers import CountingPool
from resources.ledger import LeakError, Ledger, PoolStats, PoolUsage, check_memory, memory_report
from states import FinishReason, Request, RequestState

S = RequestState




class _Pool(CountingPool):
    """A counter pool whose holdings the ledger records, as the machine does for real pools."""

    def __init__(self, name: str, capacity: int, ledger: Ledger, unit: str = "pages") -> None:
        super().__init__(name, capacity, unit)
        self.ledger = ledger

    def take(self, request: Request, n: int) -> None:
        self.free -= n
        self.ledger.hold(self.name, request, n)

    def give(self, request: Request, n: int) -> None:
        self.free += n
        self.ledger.drop(self.name, request, n)


def _make_request(rid: str, state=S.DECODING, reason: FinishReason | None = None) -> Request:
    req = Request(rid, [1, 2, 3], None)
    req.state, req.finish_reason = state, reason
    return req


def _make_pools(ledger: Ledger) -> list[_Pool]:
    return [_Pool("kv_pages", 100, ledger), _Pool("request_slots", 4, ledger, unit="slots")]


class TestLedger:
    def test_hold_adjust_and_drop(self):
        """Holdings add up per owner (a request object) and per pool; each handle is dropped on its own."""
        ledger = Ledger()
        a, b = _make_request("a"), _make_request("b")
        ledger.hold("p", a, 3)
        ledger.hold("p", a, 2)
        ledger.hold("p", b, 4)
        assert (ledger.held("p"), ledger.holding("p", a), ledger.holding("p", b)) == (9, 5, 4)
        ledger.adjust("p", a, 2)
        ledger.drop("p", a, 3)
        assert ledger.holding("p", a) == 4 and [o.request_id for o in ledger.owners("p")] == ["a", "b"]
        ledger.drop("p", a, 4)
        assert ledger.holding("p", a) == 0 and ledger.held("p") == 4
        assert [o.request_id for o in ledger.owners("p")] == ["b"] and ledger.recent["p"][-1] == ("a", 4)

    def test_a_reused_id_is_another_owner(self):
        """Two requests with the same id are two owners: one's release never touches the other's holding."""
        ledger = Ledger()
        old, new = _make_request("same", S.RELEASED, FinishReason.TRANSFER_FAILED), _make_request("same")
        ledger.hold("p", old, 3)
        ledger.quarantine("p", old, 3)
        ledger.hold("p", new, 2)
        ledger.drop("p", new, 2)
        assert ledger.held("p") == ledger.quarantined("p") == 3 and ledger.holding("p", old) == 3

    def test_dropping_more_than_held_is_recorded_not_raised(self):
        """A drop beyond the holding never raises inside a release sequence: the pool turns suspect."""
        ledger = Ledger()
        a = _make_request("a")
        ledger.hold("p", a, 2)
        with capture_logs() as logs:
            ledger.drop("p", a, 3)
        assert ledger.held("p") == 0 and "p" in ledger.suspect
        assert [e["event"] for e in logs] == ["ledger.drop_mismatch"]

    def test_zero_holds_name_the_holder(self):
        """A handle of amount 0 (references to shared memory) still names its holder until dropped."""
        ledger = Ledger()
        a = _make_request("a")
        ledger.hold("p", a, 0)
        assert [o.request_id for o in ledger.owners("p")] == ["a"] and ledger.num_tracked_requests == 1
        ledger.drop("p", a, 0)
        assert ledger.owners("p") == [] and ledger.num_tracked_requests == 0

    def test_quarantine_keeps_the_amount_held(self):
        """Quarantined memory stays held and is counted apart, until unquarantined."""
        ledger = Ledger()
        a = _make_request("a")
        ledger.hold("p", a, 3)
        ledger.quarantine("p", a, 3)
        assert (ledger.held("p"), ledger.quarantined("p")) == (3, 3)
        assert [o.quarantined for o in ledger.owners("p")] == [True]
        ledger.unquarantine("p", a, 3)
        ledger.drop("p", a, 3)
        assert (ledger.held("p"), ledger.quarantined("p")) == (0, 0)


class TestPoolStats:
    @pytest.mark.parametrize(
        ("free", "evictable", "held", "ok"), [(5, 3, 2, True), (5, 3, 3, False), (0, 0, 10, True)]
    )
    def test_adds_up(self, free, evictable, held, ok):
        """free + evictable + held must equal capacity."""
        assert PoolStats(capacity=10, free=free, evictable=evictable, held=held).adds_up is ok


class TestCheckMemory:
    def test_clean_pools_pass(self):
        """Balanced pools pass whether or not the engine is idle."""
        ledger = Ledger()
        pools = _make_pools(ledger)
        req = _make_request("a")
        pools[0].take(req, 7)
        report = check_memory(pools, ledger, idle=False, live_requests=1)
        assert report.pools["kv_pages"].held == 7 and not report.idle
        pools[0].give(req, 7)
        report = check_memory(pools, ledger, idle=True)
        assert report.idle and all(s.held == 0 and s.adds_up for s in report.pools.values())

    @pytest.mark.parametrize("reason", [None, *FinishReason], ids=lambda r: getattr(r, "name", "live"))
    def test_idle_leak_names_pool_amount_and_owners(self, reason):
        """The error names the pool, the amount and every owner's id, state and finish reason."""
        ledger = Ledger()
        pools = _make_pools(ledger)
        state = S.DECODING if reason is None else S.RELEASED
        leaker = _make_request("req-leaky", state, reason)
        other = _make_request("req-other", S.FINISHED, FinishReason.STOP)
        pools[0].take(leaker, 5)
        pools[0].take(other, 2)
        with capture_logs() as logs, pytest.raises(LeakError) as info:
            check_memory(pools, ledger, idle=True)
        message = str(info.value)
        tag = reason.name if reason else "-"
        assert "kv_pages: 7 pages held while idle" in message
        assert f"req-leaky ({state.name}, {tag}) 5" in message
        assert "req-other (FINISHED, STOP) 2" in message
        assert "request_slots" not in message
        assert info.value.problems == [message.removeprefix("memory leak detected: ")]
        assert info.value.report.pools["kv_pages"].held == 7
        leak = [e for e in logs if e["event"] == "memory.leak"]
        assert len(leak) == 1 and leak[0]["pool"] == "kv_pages" and leak[0]["log_level"] == "error"

    def test_pool_that_does_not_add_up_raises_even_when_busy(self):
        """Memory freed behind the ledger's back breaks the sum and is reported with its owners."""
        ledger = Ledger()
        pools = _make_pools(ledger)
        req = _make_request("req-1")
        pools[1].take(req, 2)
        pools[1].free += 1  # a path that freed a slot without a hook release
        with pytest.raises(LeakError) as info:
            check_memory(pools, ledger, idle=False, live_requests=1)
        assert str(info.value) == (
            "memory leak detected: request_slots: free 3 + evictable 0 + held 2 != capacity 4"
            " (owners: req-1 (DECODING, -) 2; latest releases: none)"
        )

    def test_every_bad_pool_is_listed(self):
        """Each failing pool gets its own problem line."""
        ledger = Ledger()
        pools = _make_pools(ledger)
        req = _make_request("a")
        pools[0].take(req, 1)
        pools[1].take(req, 1)
        with pytest.raises(LeakError) as info:
            check_memory(pools, ledger, idle=True)
        assert [p.split(":")[0] for p in info.value.problems] == ["kv_pages", "request_slots"]

    def test_quarantined_memory_passes_but_is_named(self):
        """When idle, quarantined memory is not a leak, but the report names its owner."""
        ledger = Ledger()
        pools = _make_pools(ledger)
        req = _make_request("req-q", S.RELEASED, FinishReason.TRANSFER_FAILED)
        pools[0].take(req, 4)
        ledger.quarantine("kv_pages", req, 4)
        report = check_memory(pools, ledger, idle=True)
        assert report.pools["kv_pages"].quarantined == 4
        (owner,) = report.owners["kv_pages"]
        assert (owner.request_id, owner.amount, owner.quarantined) == ("req-q", 4, True)
        assert owner.describe() == "req-q (RELEASED, TRANSFER_FAILED) 4 quarantined"

    def test_unattributed_leak_says_so(self):
        """Held memory without an owner in the ledger is still reported."""
        ledger = Ledger()
        pool = _Pool("kv_pages", 10, ledger)
        pool.stats = lambda: PoolUsage(capacity=10, free=9, shared=1, unit="pages")
        with pytest.raises(LeakError, match=r"1 pages held while idle \(owners: no recorded owner\)"):
            check_memory([pool], ledger, idle=True)

    def test_suspect_pool_is_flagged(self):
        """A pool whose hook raised in release is marked suspect in the report."""
        ledger = Ledger()
        pools = _make_pools(ledger)
        ledger.suspect.add("kv_pages")
        report = memory_report(pools, ledger, idle=True)
        assert report.pools["kv_pages"].suspect and not report.pools["request_slots"].suspect

    def test_a_broken_stats_is_reported_not_raised(self):
        """A plugin pool whose stats() raises shows as suspect and not adding up; the check still runs."""
        ledger = Ledger()
        pool = _Pool("plugin", 4, ledger)
        pool.take(_make_request("a"), 1)
        pool.stats = lambda: 1 / 0
        report = memory_report([pool], ledger, idle=False)
        assert report.pools["plugin"].suspect and not report.pools["plugin"].adds_up

    def test_report_serialises(self):
        """as_dict is plain JSON: enums by name, a sum flag per pool, owners only where held."""
        ledger = Ledger()
        pools = _make_pools(ledger)
        pools[0].take(_make_request("a", S.FINISHED, FinishReason.ABORT), 3)
        data = json.loads(json.dumps(memory_report(pools, ledger, idle=False, live_requests=1).as_dict()))
        assert data["pools"]["kv_pages"]["adds_up"] is True
        assert data["owners"] == {"kv_pages": [
            {"request_id": "a", "state": "FINISHED", "finish_reason": "ABORT", "amount": 3, "quarantined": False}
        ]}
        assert data["live_requests"] == 1 and data["idle"] is False
