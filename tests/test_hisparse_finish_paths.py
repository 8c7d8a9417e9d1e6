"""Every finish path with HiSparse on ends with every pool whole, and the
HiSparse pools add up at every transition and after every step.

The autouse fixture in conftest.py checks each engine is idle with nothing
held (beyond quarantine) after each test; `_always_adds_up` makes every
test also run `check_memory()` on each transition and step.
"""

from __future__ import annotations

import anyio
import pytest
import structlog

from engine import Engine, HealthCheckFailed, SamplingParams
from engine.testing import FaultInjector
from hisparse import DEVICE_SLOTS, HOST_PAGES, SLOT_MAPS, HiSparseConfig
from resources.kv_pool import KV_PAGES
from states import FinishReason, RequestState
from helpers import collect, live_request, small_config

S = RequestState
PROMPT = list(range(3, 33))  # 30 tokens: longer than the 16-slot buffer, so decoding swaps in
SPARSE = HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=2, index_dim=16)


def _engine(faults=None, **overrides) -> Engine:
    overrides.setdefault("hisparse", SPARSE)
    engine = Engine(small_config(**overrides), faults=faults)
    checks = engine.memory_checks_run = [0]

    def check(*_):
        engine.check_memory()  # raises LeakError if any pool fails free + evictable + held == capacity
        checks[0] += 1

    engine.parts.machine.transition_observers.append(check)
    engine.loop.step_observers.append(check)
    return engine


def _abort_on_entry(engine: Engine, request_id: str, state: RequestState) -> None:
    """Queue an abort for `request_id` when it enters `state` (applied next iteration)."""

    def observer(request, src, dst):
        if request.request_id == request_id and dst is state:
            engine.loop.abort(request_id)

    engine.parts.machine.transition_observers.append(observer)


def _finished_from(engine: Engine) -> list[str]:
    return [src for (src, dst) in engine.stats.transitions if dst == "FINISHED"]


class TestPoolsReported:
    @pytest.mark.asyncio
    async def test_memory_report_lists_hisparse_pools(self):
        """memory_report() lists the HiSparse device, host and map pools, whole at idle."""
        async with _engine() as engine:
            await engine.complete(PROMPT, SamplingParams(max_new_tokens=4))
            await engine.wait_idle(5)
            report = engine.check_memory()
        assert {DEVICE_SLOTS, HOST_PAGES, SLOT_MAPS} <= set(report.pools)
        assert engine.memory_checks_run[0] >= 8


class TestNormalFinishes:
    @pytest.mark.asyncio
    async def test_length(self):
        """LENGTH after several sparse decode steps."""
        async with _engine() as engine:
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=9))
        assert final.finish_reason is FinishReason.LENGTH and len(final.token_ids) == 9
        assert engine.stats.transitions[("STAGING", "DECODING")] == 1

    @pytest.mark.asyncio
    async def test_first_token_finish(self):
        """max_new_tokens=1 goes PREBUILT -> FINISHED, never staging, and releases host pages and KV."""
        async with _engine() as engine:
            with structlog.testing.capture_logs() as logs:
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=1))
                await engine.wait_idle(5)
        assert final.finish_reason is FinishReason.LENGTH
        released = [e["resource"] for e in logs if e["event"] == "resource.released"]
        assert released == ["hisparse_host", "kv", "request_slot", "timing"]
        assert ("PREBUILT", "STAGING") not in engine.stats.transitions

    @pytest.mark.asyncio
    async def test_stop_token(self):
        """A stop token mid-decode finishes with STOP."""
        async with _engine() as engine:
            free_run = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6))
            stop = free_run.token_ids[3]
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6, stop_token_ids=[stop]))
        assert final.finish_reason is FinishReason.STOP
        assert final.token_ids == free_run.token_ids[: free_run.token_ids.index(stop) + 1]

    @pytest.mark.asyncio
    async def test_health_check(self):
        """A health check (one token) with HiSparse on leaves nothing held."""
        async with _engine() as engine:
            assert await engine.health_check(timeout=10)
            await engine.wait_idle(5)
        assert engine.stats.finishes[("health_check", "LENGTH")] == 1


class TestAborts:
    @pytest.mark.asyncio
    async def test_abort_queued(self):
        """An abort in QUEUED finishes without ever taking host pages."""
        async with _engine(max_running=1) as engine:
            first = engine.generate(PROMPT, SamplingParams(max_new_tokens=20), request_id="first")
            second = engine.generate(PROMPT, SamplingParams(max_new_tokens=20), request_id="second")
            await first.__anext__()
            assert await engine.abort("second")
            outputs = await collect(second)
            await collect(first)
        assert outputs[-1].finish_reason is FinishReason.ABORT and outputs[-1].token_ids == []

    @pytest.mark.asyncio
    @pytest.mark.parametrize("state", [S.PREFILLING, S.STAGING, S.DECODING])
    async def test_abort_running(self, state):
        """An abort applied in PREFILLING (chunked), STAGING or DECODING finishes ABORT from there."""
        async with _engine(max_prefill_tokens=8) as engine:
            _abort_on_entry(engine, "r", state)
            outputs = await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=30), request_id="r"))
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert _finished_from(engine) == [state.name]

    @pytest.mark.asyncio
    async def test_abort_in_staging_with_stuck_copy_quarantines(self):
        """A staging copy that never finishes: the abort quarantines host and KV pages at fence_timeout."""
        faults = FaultInjector(stuck_fences={"host_backup"})
        async with _engine(faults=faults, fence_timeout=0.2) as engine:
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=5), request_id="stuck")
            await stream.__anext__()
            await anyio.sleep(0.05)
            assert live_request(engine, "stuck").state is S.STAGING
            assert await engine.abort("stuck")
            outputs = await collect(stream)
            await engine.wait_idle(5)
            report = engine.check_memory()
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert report.pools[HOST_PAGES].quarantined > 0 and report.pools[KV_PAGES].quarantined > 0
        assert report.pools[DEVICE_SLOTS].held == 0

    @pytest.mark.asyncio
    async def test_client_disconnect(self):
        """A client that stops iterating mid-decode aborts its request."""
        async with _engine() as engine:
            async with engine.generate(PROMPT, SamplingParams(max_new_tokens=40), request_id="gone") as stream:
                async for output in stream:
                    if len(output.token_ids) == 3:
                        break
            await engine.wait_idle(5)
        assert engine.stats.finishes[("normal", "ABORT")] == 1


class TestFailures:
    @pytest.mark.asyncio
    async def test_model_step_error_while_decoding(self):
        """A decode step that raises finishes the request with ERROR from DECODING."""
        seen = {"steps": 0}

        def fail(ids):
            if "bad" in ids:
                seen["steps"] += 1
                return seen["steps"] == 4
            return False

        async with _engine(faults=FaultInjector(fail_step=fail)) as engine:
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=10), request_id="bad")
        assert final.finish_reason is FinishReason.ERROR and _finished_from(engine) == ["DECODING"]

    @pytest.mark.asyncio
    async def test_health_check_failure(self):
        """A health check whose step fails raises and leaks nothing."""
        faults = FaultInjector(fail_step=lambda ids: any(i.startswith("health") for i in ids))
        async with _engine(faults=faults) as engine:
            with pytest.raises(HealthCheckFailed):
                await engine.health_check(timeout=10)
            await engine.wait_idle(5)


class TestShutdown:
    @pytest.mark.asyncio
    async def test_shutdown_mid_decode(self):
        """Leaving `async with` while requests decode finishes them with SHUTDOWN and frees everything."""
        async with _engine() as engine:
            streams = [engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True))
                       for _ in range(3)]
            for stream in streams:
                await stream.__anext__()
        finals = [(await collect(stream))[-1] for stream in streams]
        assert {f.finish_reason for f in finals} == {FinishReason.SHUTDOWN}


class TestRetraction:
    @pytest.mark.asyncio
    async def test_host_pressure_retracts_and_output_is_unchanged(self):
        """A host pool too small for three growing requests retracts; outputs equal an unpressured run."""
        exact = HiSparseConfig(top_k=128, device_buffer_size=128, recent_window=2, index_dim=8)
        prompts = [[(11 * i + j) % 250 for i in range(40)] for j in range(3)]
        params = SamplingParams(max_new_tokens=60, ignore_eos=True)

        async def run(engine):
            results = {}

            async def one(i):
                results[i] = (await engine.complete(prompts[i], params)).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
            return [results[i] for i in range(3)]

        async with _engine(hisparse=exact) as calm:
            expected = await run(calm)
        pressured = HiSparseConfig(top_k=128, device_buffer_size=128, recent_window=2, index_dim=8,
                                   host_pool_tokens=256)
        async with _engine(hisparse=pressured) as engine:
            got = await run(engine)
        assert engine.stats.retractions > 0
        assert got == expected


class TestDecodeRole:
    @pytest.mark.asyncio
    async def test_host_pages_at_transferring_and_same_output(self):
        """Decode role: host pages are held from TRANSFERRING on; output equals the single engine's."""
        async with _engine() as single:
            expected = (await single.complete(PROMPT, SamplingParams(max_new_tokens=8))).token_ids
        entered = []
        async with _engine(disaggregation="decode") as engine:
            engine.parts.machine.transition_observers.append(
                lambda r, src, dst: entered.append("hisparse_host" in r.handles) if dst is S.TRANSFERRING else None)
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=8))
        assert entered == [True] and final.token_ids == expected
        assert engine.stats.transitions[("STAGING", "DECODING")] == 1
