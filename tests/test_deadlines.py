"""Deadlines (issue 21): a request past its deadline finishes DEADLINE from whatever state it is in,
within the deadline plus one model step, through the one release path, with every pool whole.

Each state is reached with the engine's own fault injection or a test hook that refuses a move
(a fake only to hold a request where it is): QUEUED (admission refused: no step runs at all, so
only the loop's timer can see the deadline), PREFILLING and DECODING (slow steps), TRANSFERRING
and STAGING (copies held in flight, completed after the finish), RETRACTED (retracted by a higher
priority arrival, its requeue refused).
"""

from __future__ import annotations

import time

import anyio
import pytest

from engine import Engine, InvalidRequest, SamplingParams
from engine.runtime.deadlines import DeadlineTimer
from engine.testing import FaultInjector
from helpers import DEADLINE, assert_pools_whole, collect, live_request, small_config
from hisparse import HiSparseConfig
from resources import ResourceExhausted, ResourceHook
from states import HELD_STATES, FinishReason, Handle, Request, RequestState

S = RequestState
LIMIT = 0.15  # the deadline, seconds from submission
SLOW_STEP = 0.01
HISPARSE = HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=4)


class RefuseAdmission(ResourceHook):
    """Refuses every admission (a fault): requests stay QUEUED and no step ever runs."""

    name = "refuse_admission"
    acquire_on = frozenset({S.PREFILLING})
    scope = frozenset({S.PREFILLING, S.PREBUILT, S.DECODING, S.FINISHED})

    def acquire(self, request, into):
        raise ResourceExhausted("admission held by the test")


class RefuseRequeue(ResourceHook):
    """Released on retraction and refused on requeue (a fault): a retracted request stays RETRACTED."""

    name = "refuse_requeue"
    acquire_on = frozenset({S.QUEUED})
    scope = HELD_STATES - {S.RETRACTED}

    def acquire(self, request, into):
        if request.output_token_ids:  # not the first start: a requeue after a retraction
            raise ResourceExhausted("requeue held by the test")
        return Handle(self.name, request.request_id)


class Watch:
    """Step completion times and, per request id, (state it finished from, when, its deadline)."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[float] = []
        self.finished: dict[str, tuple[str, float, float | None]] = {}
        engine.loop.step_observers.append(lambda batch, out: self.steps.append(time.monotonic()))
        engine.parts.machine.transition_observers.append(self._on_transition)

    def _on_transition(self, request, src, dst) -> None:
        if dst is S.FINISHED:
            self.finished[request.request_id] = (src.name, time.monotonic(), request.deadline)

    def assert_met(self, request_id: str, state: str) -> None:
        src, at, deadline = self.finished[request_id]
        assert src == state
        assert deadline is not None and at >= deadline
        steps_after = [t for t in self.steps if deadline < t <= at]
        assert len(steps_after) <= 1, f"{len(steps_after)} steps ran between the deadline and the finish"
        assert at - deadline < 5.0  # the structural bound above is the real one; this only catches a hang


def _slow(seconds: float = SLOW_STEP) -> FaultInjector:
    return FaultInjector(stall_step=lambda ids: time.sleep(seconds))


async def _run_with_deadline(engine: Engine, prompt, params, request_id="late", **kwargs):
    final = (await collect(engine.generate(prompt, params, request_id=request_id, deadline=LIMIT, **kwargs)))[-1]
    assert final.finish_reason is FinishReason.DEADLINE
    assert final.error is not None and "deadline" in final.error
    return final


class TestEachState:
    @pytest.mark.anyio
    async def test_queued_with_no_step_running(self):
        """Admission never happens and no step runs: the loop's timer alone finishes it, from QUEUED."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null", resources=(RefuseAdmission(),))) as engine:
                watch = Watch(engine)
                await _run_with_deadline(engine, [1, 2, 3], SamplingParams(max_new_tokens=4))
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        assert not watch.steps
        watch.assert_met("late", "QUEUED")

    @pytest.mark.anyio
    async def test_prefilling(self):
        """A long prompt in small chunks on slow steps: finished from PREFILLING before its first token."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null", max_prefill_tokens=2), faults=_slow()) as engine:
                watch = Watch(engine)
                final = await _run_with_deadline(engine, list(range(1, 200)), SamplingParams(max_new_tokens=4))
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        watch.assert_met("late", "PREFILLING")
        assert final.token_ids == []

    @pytest.mark.anyio
    async def test_decoding(self):
        """Slow decode steps: finished from DECODING with the tokens made so far."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null"), faults=_slow()) as engine:
                watch = Watch(engine)
                final = await _run_with_deadline(engine, [1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True))
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        watch.assert_met("late", "DECODING")
        assert 0 < len(final.token_ids) < 200

    @pytest.mark.anyio
    async def test_transferring(self):
        """Decode role, a KV transfer that does not land: finished from TRANSFERRING; released once it lands."""
        faults = FaultInjector(stuck_fences={"kv_transfer"})
        config = small_config(model="null", disaggregation="decode", fence_timeout=20)
        with anyio.fail_after(DEADLINE):
            async with Engine(config, faults=faults) as engine:
                watch = Watch(engine)
                await _run_with_deadline(engine, [1, 2, 3], SamplingParams(max_new_tokens=4))
                faults.unstick()  # the late copy lands: the fenced pages are released, never quarantined
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        watch.assert_met("late", "TRANSFERRING")

    @pytest.mark.anyio
    async def test_staging(self):
        """HiSparse, a host backup that does not complete: finished from STAGING; released once it does."""
        faults = FaultInjector(stuck_fences={"host_backup"})
        config = small_config(model="null", hisparse=HISPARSE, fence_timeout=20)
        with anyio.fail_after(DEADLINE):
            async with Engine(config, faults=faults) as engine:
                watch = Watch(engine)
                await _run_with_deadline(engine, list(range(1, 20)), SamplingParams(max_new_tokens=40))
                faults.unstick()
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        watch.assert_met("late", "STAGING")

    @pytest.mark.anyio
    async def test_retracted(self):
        """Retracted for a higher priority arrival and held there: finished from RETRACTED."""
        config = small_config(model="null", max_running=1, resources=(RefuseRequeue(),))
        with anyio.fail_after(DEADLINE):
            async with Engine(config, faults=_slow(0.002)) as engine:
                watch = Watch(engine)
                stream = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True),
                                         request_id="late", priority=5, deadline=0.6)  # outlives the urgent one
                await stream.__anext__()  # decoding
                urgent = await engine.complete([4, 5, 6], SamplingParams(max_new_tokens=3), priority=0)
                assert live_request(engine, "late").state is S.RETRACTED
                final = (await collect(stream))[-1]
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        assert urgent.finish_reason is FinishReason.LENGTH and final.finish_reason is FinishReason.DEADLINE
        watch.assert_met("late", "RETRACTED")


class TestDeadlineContract:
    @pytest.mark.anyio
    async def test_a_request_done_in_time_is_untouched(self):
        """A request that finishes before its deadline ends as usual and leaves nothing watched."""
        async with Engine(small_config()) as engine:
            final = await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), deadline=60)
            await engine.wait_idle(DEADLINE)
            assert engine.loop.table_sizes()["deadlines"] == 0
        assert final.finish_reason is FinishReason.LENGTH

    @pytest.mark.anyio
    async def test_every_sequence_of_n_finishes(self):
        """n > 1: each sequence past the deadline finishes DEADLINE, once."""
        async with Engine(small_config(model="null"), faults=_slow()) as engine:
            outputs = await collect(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=200, n=3,
                                                                             ignore_eos=True), deadline=LIMIT))
            await engine.wait_idle(DEADLINE)
        finals = [o for o in outputs if o.finished]
        assert sorted(o.index for o in finals) == [0, 1, 2]
        assert {o.finish_reason for o in finals} == {FinishReason.DEADLINE}

    @pytest.mark.anyio
    async def test_counted_by_reason(self):
        """A deadline finish is counted under its own reason, not ABORT."""
        async with Engine(small_config(model="null"), faults=_slow()) as engine:
            await engine.complete([1, 2], SamplingParams(max_new_tokens=200, ignore_eos=True), deadline=0.05)
        assert engine.stats.finishes[("normal", "DEADLINE")] == 1
        assert engine.stats.finishes[("normal", "ABORT")] == 0

    @pytest.mark.anyio
    @pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "1", True])
    async def test_bad_deadline_is_refused_before_anything_is_allocated(self, value):
        """A deadline that is not a finite positive number is an InvalidRequest naming `deadline`."""
        async with Engine(small_config()) as engine:
            with pytest.raises(InvalidRequest) as info:
                engine.generate([1, 2], SamplingParams(), deadline=value)
            assert engine.idle and engine.stats.submitted == 0
        assert info.value.field == "deadline"



class TestTimer:
    def _request(self, rid: str, deadline: float | None) -> Request:
        request = Request(rid, [1], SamplingParams())
        request.deadline = deadline
        return request

    def test_due_in_order_and_forgets_released_requests(self):
        """`due` returns requests past their deadline, earliest first; released ones are never returned,
        and their entries do not accumulate."""
        timer = DeadlineTimer()
        requests = [self._request(f"r{i}", float(i)) for i in range(200)]
        for request in requests + [self._request("none", None)]:
            timer.add(request)
        assert len(timer) == 200 and timer.next_due() == 0.0
        for request in requests[:150]:
            timer.discard(request)
        assert len(timer) == 50 and len(timer._heap) <= 100
        assert timer.next_due() == 150.0
        assert [r.request_id for r in timer.due(152.0)] == ["r150", "r151", "r152"]
        assert timer.next_due() == 153.0
