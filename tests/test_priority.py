"""Priority (issue 21): vLLM's convention (lower runs first, equal keeps arrival order).

With running full a higher priority arrival runs before earlier lower priority ones; the queue's
head retracts lower priority running requests (lowest class first, newest first within it), never
the reverse; a retracted request keeps its place in its class; aging bounds how long the lowest
class waits; outputs of preempted requests are what they would have been.
"""

from __future__ import annotations

import time

import anyio
import pytest
from structlog.testing import capture_logs

from engine import Engine, InvalidRequest, SamplingParams
from engine.runtime.scheduler import Scheduler
from engine.testing import FaultInjector
from helpers import DEADLINE, collect, small_config
from states import Request, RequestState

S = RequestState
LONG = SamplingParams(max_new_tokens=60, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=4, ignore_eos=True)


class Order:
    """The order of admissions (first ones, and all) and retractions, by request id."""

    def __init__(self, engine: Engine) -> None:
        self.admitted: list[str] = []
        self.all_admitted: list[str] = []
        self.retracted: list[str] = []
        engine.parts.machine.transition_observers.append(self._on)

    def _on(self, request, src, dst) -> None:
        if dst is S.RETRACTED:
            self.retracted.append(request.request_id)
        elif src is S.QUEUED and dst is S.PREFILLING:
            self.all_admitted.append(request.request_id)
            if request.request_id not in self.admitted:
                self.admitted.append(request.request_id)


def _retraction_reasons(logs: list[dict]) -> list[tuple[str, str]]:
    return [(e["request_id"], e["reason"]) for e in logs
            if e["event"] == "request.transition" and e["dst"] == "RETRACTED"]


def _slow(seconds: float = 0.002) -> FaultInjector:
    return FaultInjector(stall_step=lambda ids: time.sleep(seconds))


def _prompt(i: int) -> list[int]:
    return [(7 * i + j) % 200 + 3 for j in range(6)]


async def _started(stream) -> None:
    """Wait until the request's first token is out (it is running)."""
    await stream.__anext__()


async def _finals(streams: dict) -> dict:
    return {rid: (await collect(stream))[-1] for rid, stream in streams.items()}


class TestAdmissionOrder:
    @pytest.mark.anyio
    async def test_high_priority_arrival_runs_before_earlier_low_ones(self):
        """Running full: a later priority-0 arrival is admitted before earlier priority-5 ones."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null", max_running=1), faults=_slow()) as engine:
                order = Order(engine)
                streams = {"run": engine.generate(_prompt(0), LONG, request_id="run")}
                await _started(streams["run"])
                for rid, priority in (("low-a", 5), ("low-b", 5), ("high", 0)):  # taken in one iteration
                    streams[rid] = engine.generate(_prompt(1), SHORT, request_id=rid, priority=priority)
                finals = await _finals(streams)
        assert order.admitted == ["run", "high", "low-a", "low-b"]
        assert order.retracted == []  # "run" has the same priority as "high": never retracted for it
        assert all(f.finish_reason.name == "LENGTH" for f in finals.values())

    @pytest.mark.anyio
    async def test_arrival_order_within_a_class(self):
        """Equal priority keeps arrival order, whatever the other classes do."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null", max_running=1), faults=_slow()) as engine:
                order = Order(engine)
                streams = {"run": engine.generate(_prompt(0), LONG, request_id="run", priority=-1)}
                await _started(streams["run"])
                for i, priority in enumerate((3, 1, 3, 1, 3)):
                    rid = f"p{priority}-{i}"
                    streams[rid] = engine.generate(_prompt(i), SHORT, request_id=rid, priority=priority)
                await _finals(streams)
        assert order.admitted == ["run", "p1-1", "p1-3", "p3-0", "p3-2", "p3-4"]

    @pytest.mark.anyio
    async def test_bad_priority_is_refused(self):
        """A priority that is not an integer is an InvalidRequest naming `priority`."""
        async with Engine(small_config()) as engine:
            with pytest.raises(InvalidRequest) as info:
                engine.generate([1, 2], SamplingParams(), priority=1.5)  # type: ignore[arg-type]
        assert info.value.field == "priority"


class TestRetraction:
    @pytest.mark.anyio
    async def test_lowest_class_then_newest_is_retracted_and_keeps_its_place(self):
        """Slots full: each priority-0 arrival retracts the lowest class's newest running request;
        the retracted ones then run again in their classes' order, ahead of later arrivals of their class."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null", max_running=3), faults=_slow()) as engine:
                order = Order(engine)
                streams = {}
                for rid, priority in (("l3", 3), ("l5-a", 5), ("l5-b", 5)):
                    streams[rid] = engine.generate(_prompt(len(streams)), LONG, request_id=rid, priority=priority)
                for rid in ("l3", "l5-a", "l5-b"):
                    await _started(streams[rid])
                for i in range(3):
                    streams[f"high-{i}"] = engine.generate(_prompt(9), SHORT, request_id=f"high-{i}", priority=0)
                while len(order.retracted) < 3:
                    await anyio.sleep(0.002)
                streams["l5-late"] = engine.generate(_prompt(5), SHORT, request_id="l5-late", priority=5)
                finals = await _finals(streams)
        assert order.retracted == ["l5-b", "l5-a", "l3"]
        readmitted = [rid for rid in order.all_admitted if rid.startswith("l")]
        assert readmitted[3:] == ["l3", "l5-a", "l5-b", "l5-late"]
        assert all(f.finish_reason.name == "LENGTH" for f in finals.values())

    @pytest.mark.anyio
    async def test_never_the_reverse(self):
        """A lower priority arrival waits: it never retracts a higher priority running request."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null", max_running=1), faults=_slow()) as engine:
                order = Order(engine)
                streams = {"high": engine.generate(_prompt(0), LONG, request_id="high", priority=0)}
                await _started(streams["high"])
                streams["low"] = engine.generate(_prompt(1), SHORT, request_id="low", priority=9)
                await _finals(streams)
        assert order.retracted == [] and order.admitted == ["high", "low"]

    @pytest.mark.anyio
    async def test_page_pressure_retracts_for_priority(self):
        """Pages, not slots, short: the high priority arrival retracts the low priority request."""
        config = small_config(model="null", num_kv_pages=24, max_context=64, max_running=8)
        with anyio.fail_after(DEADLINE), capture_logs() as logs:
            async with Engine(config, faults=_slow()) as engine:
                low = engine.generate(list(range(1, 40)), SamplingParams(max_new_tokens=24, ignore_eos=True),
                                      request_id="low", priority=1)
                await _started(low)  # 10 of 23 pages held: the arrival's 15 (+1) do not fit
                high = await engine.complete(list(range(50, 100)), SamplingParams(max_new_tokens=8, ignore_eos=True),
                                             request_id="high", priority=0)
                final_low = (await collect(low))[-1]
        assert _retraction_reasons(logs)[0] == ("low", "priority of high")
        assert high.finish_reason.name == final_low.finish_reason.name == "LENGTH"

    @pytest.mark.anyio
    async def test_growth_retracts_the_lowest_priority_first(self):
        """Decode growth short of pages retracts the lowest priority request even when it was admitted first."""
        config = small_config(model="null", num_kv_pages=20, max_context=64, max_running=8)
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        with anyio.fail_after(DEADLINE), capture_logs() as logs:
            async with Engine(config, faults=_slow()) as engine:
                low = engine.generate(list(range(1, 20)), params, request_id="low", priority=2)
                await _started(low)
                high = engine.generate(list(range(30, 49)), params, request_id="high", priority=1)
                await _finals({"low": low, "high": high})
        reasons = _retraction_reasons(logs)
        assert reasons and set(reasons) == {("low", "page pressure")}


class TestOutputsUnchanged:
    @pytest.mark.anyio
    async def test_preempted_outputs_equal_undisturbed_runs(self):
        """Greedy and seeded requests retracted for priority produce exactly their undisturbed outputs."""
        greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
        seeded = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_k=20, seed=7)
        prompts = {"g": _prompt(1), "s": _prompt(2)}
        params = {"g": greedy, "s": seeded}
        async with Engine(small_config(max_running=2)) as calm:
            expected = {rid: (await calm.complete(prompts[rid], params[rid])).token_ids for rid in prompts}
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(max_running=2), faults=_slow()) as engine:
                order = Order(engine)
                streams = {rid: engine.generate(prompts[rid], params[rid], request_id=rid, priority=4)
                           for rid in prompts}
                for stream in streams.values():
                    await _started(stream)
                for i in range(2):
                    streams[f"h{i}"] = engine.generate(_prompt(7), SHORT, request_id=f"h{i}", priority=0)
                finals = await _finals(streams)
        assert sorted(order.retracted) == ["g", "s"]
        assert {rid: finals[rid].token_ids for rid in prompts} == expected


class TestAgingIsPolicy:
    def _request(self, rid: str, priority: int, arrival: float) -> Request:
        request = Request(rid, [1, 2, 3], SHORT, priority=priority)
        request.arrival_time = arrival
        return request

    def test_strict_priority_without_aging(self):
        """priority_aging=None: strict classes, arrival order within each."""
        scheduler = Scheduler(max_running=4, max_prefill_tokens=64, page_size=4, priority_aging=None)
        waiting = [self._request("old-low", 1, 0.0), self._request("new-high", 0, 1000.0),
                   self._request("old-high", 0, 5.0)]
        assert [r.request_id for r in scheduler.order(waiting)] == ["old-high", "new-high", "old-low"]

    def test_aging_bounds_the_lowest_class_wait(self):
        """With aging T, a class-1 request ranks ahead of class-0 requests arriving more than T after it."""
        scheduler = Scheduler(max_running=4, max_prefill_tokens=64, page_size=4, priority_aging=10.0)
        waiting = [self._request("high-late", 0, 12.0), self._request("low", 1, 0.0),
                   self._request("high-soon", 0, 8.0)]
        assert [r.request_id for r in scheduler.order(waiting)] == ["high-soon", "low", "high-late"]

    def test_an_aged_request_is_not_retracted_by_later_arrivals(self):
        """A running low priority request that ranks ahead of the waiting head is no victim."""
        scheduler = Scheduler(max_running=1, max_prefill_tokens=64, page_size=4, priority_aging=10.0)
        running = self._request("low", 1, 0.0)
        running.admitted_seq = 1
        young = self._request("high-young", 0, 5.0)
        late = self._request("high-late", 0, 20.0)
        kwargs = dict(num_running=1, free_slots=0, available_pages=100, retractable=lambda r: True,
                      freed_pages=lambda r: 2)
        assert scheduler.select_preemptions(young, [running], **kwargs) == [running]
        assert scheduler.select_preemptions(late, [running], **kwargs) == []

