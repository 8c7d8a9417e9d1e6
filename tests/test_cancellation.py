"""Cancellation and shutdown at the worst moments: no leak, no hang, on asyncio and trio.

Each test runs under `anyio.fail_after` (a hang fails, it never stalls the
suite) and on both backends. A model step, a KV transfer or a staging copy
is held in flight with the engine's own fault injector (`stall_step`, a
slow `fail_transfer`, `stuck_fences`), then the client, the caller or the
engine's owner goes away. Afterwards every request is RELEASED, every pool
is whole (conftest checks each engine again), and memory a late copy could
still write is quarantined and named, never freed.
"""

from __future__ import annotations

import anyio
import pytest

from engine import Engine, HealthCheckFailed, SamplingParams
from engine.testing import FaultInjector
from hisparse import HiSparseConfig
from states import FinishReason, RequestState
from helpers import DEADLINE, StepGate, assert_pools_whole, collect, live_request, small_config, step_running

PROMPT = list(range(1, 20))
LONG = SamplingParams(max_new_tokens=60, ignore_eos=True)
HISPARSE = HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=4)


def _stuck(fence: str, **overrides) -> Engine:
    """An engine whose `fence` copies never complete, so they miss a short deadline."""
    return Engine(small_config(model="null", fence_timeout=0.3, **overrides),
                  faults=FaultInjector(stuck_fences={fence}))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class TestConsumerCancelled:
    @pytest.mark.anyio
    async def test_cancelled_consumers_abort_their_requests(self, anyio_backend):
        """Consumers cancelled mid-stream abort their requests; the others finish normally."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(max_running=4)) as engine:
                finals: dict[int, list] = {}

                async def consume(i: int, scope: anyio.CancelScope) -> None:
                    with scope:
                        finals[i] = await collect(engine.generate(PROMPT, LONG if i % 2 else SamplingParams(
                            max_new_tokens=5), request_id=f"c{i}"))

                scopes = [anyio.CancelScope() for _ in range(6)]
                async with anyio.create_task_group() as tg:
                    for i, scope in enumerate(scopes):
                        tg.start_soon(consume, i, scope)
                    await anyio.sleep(0.05)
                    while not all(engine.loop.is_live(f"c{i}") or i in finals for i in range(6)):
                        await anyio.sleep(0.01)
                    for i in (1, 3, 5):
                        scopes[i].cancel()
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        assert sorted(finals) == [0, 2, 4] and all(f[-1].finish_reason is FinishReason.LENGTH for f in finals.values())
        assert engine.stats.finishes[("normal", "ABORT")] == 3

    @pytest.mark.anyio
    async def test_cancelled_health_check_and_complete(self, anyio_backend):
        """A caller of complete() or health_check() cancelled during a held step leaves nothing behind."""
        gate = StepGate()
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(), faults=FaultInjector(stall_step=gate)) as engine:
                with anyio.move_on_after(0.2):
                    await engine.complete(PROMPT, LONG)
                with anyio.move_on_after(0.2), pytest.raises(HealthCheckFailed):
                    await engine.health_check(timeout=0.1)
                gate.open()
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine)
        assert engine.stats.finishes[("normal", "ABORT")] + engine.stats.finishes[("health_check", "ABORT")] == 2


class TestEngineCancelledDuringStep:
    @pytest.mark.anyio
    async def test_outer_scope_cancelled_during_model_step(self, anyio_backend):
        """Cancelling the scope around `async with Engine` mid-step waits for the step, then releases all."""
        gate = StepGate()
        streams = []
        with anyio.fail_after(DEADLINE):
            with anyio.CancelScope() as outer:
                async with Engine(small_config(), faults=FaultInjector(stall_step=gate)) as engine:
                    streams = [engine.generate(PROMPT, LONG) for _ in range(3)]
                    await gate.wait_entered()
                    gate.open_later(0.3)  # the step finishes only after the cancellation
                    outer.cancel()
                    await anyio.sleep(DEADLINE)
            assert outer.cancelled_caught
            finals = [(await collect(stream))[-1] for stream in streams]
        assert [f.finish_reason for f in finals] == [FinishReason.SHUTDOWN] * 3
        assert engine.stats.step_errors == 0, "the step ran on memory that was already released"
        assert_pools_whole(engine)

    @pytest.mark.anyio
    async def test_leaving_async_with_during_model_step(self, anyio_backend):
        """Leaving `async with` while a step is in flight finishes every request SHUTDOWN after the step."""
        gate = StepGate()
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(), faults=FaultInjector(stall_step=gate)) as engine:
                stream = engine.generate(PROMPT, LONG, request_id="mid-step")
                queued = [engine.generate(PROMPT, LONG) for _ in range(2)]  # admitted after the step, or not
                await gate.wait_entered()
                assert step_running(engine)
                gate.open_later(0.3)
            outputs = await collect(stream)
            others = [(await collect(q))[-1] for q in queued]
        assert outputs[-1].finish_reason is FinishReason.SHUTDOWN
        assert [o.finish_reason for o in others] == [FinishReason.SHUTDOWN] * 2
        assert engine.stats.step_errors == 0
        assert_pools_whole(engine)

    @pytest.mark.anyio
    async def test_step_error_during_shutdown(self, anyio_backend):
        """A step that raises while the engine is shutting down still ends in a clean SHUTDOWN."""
        gate = StepGate()
        faults = FaultInjector(stall_step=gate, fail_step=lambda ids: gate.entered.is_set())
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(), faults=faults) as engine:
                stream = engine.generate(PROMPT, LONG)
                await gate.wait_entered()
                gate.open_later(0.2)
            final = (await collect(stream))[-1]
        assert final.finish_reason in (FinishReason.ERROR, FinishReason.SHUTDOWN)
        assert_pools_whole(engine)


class TestExitDuringTransfer:
    @pytest.mark.anyio
    async def test_leaving_async_with_during_transfer(self, anyio_backend):
        """An engine left while a KV transfer is in flight waits for its fence, then frees the pages."""
        gate = StepGate()
        config = small_config(model="null", disaggregation="decode")
        with anyio.fail_after(DEADLINE):
            async with Engine(config, faults=FaultInjector(fail_transfer=gate)) as engine:
                stream = engine.generate(PROMPT, LONG, request_id="moving")
                await gate.wait_entered()
                assert live_request(engine, "moving").state is RequestState.TRANSFERRING
                gate.open_later(0.3)
            final = (await collect(stream))[-1]
        assert final.finish_reason is FinishReason.SHUTDOWN
        assert_pools_whole(engine)

    @pytest.mark.anyio
    async def test_transfer_that_never_lands(self, anyio_backend):
        """A transfer whose fence misses its deadline fails the request; its pages are quarantined, not freed."""
        with anyio.fail_after(DEADLINE):
            async with _stuck("kv_transfer", disaggregation="decode") as engine:
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=4))
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine, quarantined=True)
                owners = [o for owners in engine.memory_report().owners.values() for o in owners]
        assert final.finish_reason is FinishReason.TRANSFER_FAILED and "missed its deadline" in final.error
        assert owners and all(o.quarantined and o.request_id.endswith(final.request_id) for o in owners)


class TestExitDuringStaging:
    @pytest.mark.anyio
    async def test_leaving_async_with_during_staging_copy(self, anyio_backend):
        """Requests left in STAGING by a copy that never completes are quarantined at the deadline, no hang."""
        with anyio.fail_after(DEADLINE):
            async with _stuck("host_backup", hisparse=HISPARSE) as engine:
                streams = [engine.generate(PROMPT, LONG) for _ in range(2)]
                while not any(r.state is RequestState.STAGING for r in engine.loop.requests()):
                    await anyio.sleep(0.005)
            finals = [(await collect(stream))[-1] for stream in streams]
        assert {f.finish_reason for f in finals} <= {FinishReason.SHUTDOWN, FinishReason.ERROR}
        assert_pools_whole(engine, quarantined=True)

    @pytest.mark.anyio
    async def test_staging_copy_that_never_completes(self, anyio_backend):
        """A staging copy past its deadline finishes the request (no hang) and quarantines its memory."""
        with anyio.fail_after(DEADLINE):
            async with _stuck("host_backup", hisparse=HISPARSE) as engine:
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=4))
                await engine.wait_idle(DEADLINE)
                assert_pools_whole(engine, quarantined=True)
        assert final.finish_reason is FinishReason.ERROR and "missed its deadline" in final.error
