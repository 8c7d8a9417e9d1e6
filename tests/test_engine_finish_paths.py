"""Every finish path through the public API ends RELEASED with pools whole.

The autouse fixture in conftest.py checks every engine after each test.
"""

from __future__ import annotations

import anyio
import pytest
import structlog

from engine import Engine, HealthCheckFailed, SamplingParams
from engine.testing import FaultInjector
from states import FinishReason, RequestState
from helpers import abort_when_step_sees, collect, live_request, small_config

PROMPT = [5, 17, 42, 99, 3, 8, 120, 77, 31]


class TestNormalFinishes:
    @pytest.mark.asyncio
    async def test_length(self):
        """max_new_tokens bounds the output and finishes with LENGTH."""
        async with Engine(small_config()) as engine:
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=7))
        assert final.finish_reason is FinishReason.LENGTH
        assert len(final.token_ids) == 7
        assert final.time_to_first_token is not None and final.completion_time >= final.time_to_first_token

    @pytest.mark.asyncio
    async def test_first_token_finish(self):
        """max_new_tokens=1 finishes PREBUILT -> FINISHED and releases everything."""
        async with Engine(small_config()) as engine:
            with structlog.testing.capture_logs() as logs:
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=1))
                await engine.wait_idle(5)
        assert final.finish_reason is FinishReason.LENGTH and len(final.token_ids) == 1
        edges = [(e["src"], e["dst"]) for e in logs if e["event"] == "request.transition"]
        assert ("PREBUILT", "FINISHED") in edges and ("FINISHED", "RELEASED") in edges
        assert ("PREBUILT", "DECODING") not in edges

    @pytest.mark.asyncio
    async def test_stop_token(self):
        """A stop token finishes with STOP and is the last token."""
        async with Engine(small_config()) as engine:
            free_run = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6))
            stop = free_run.token_ids[3]
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6, stop_token_ids=[stop]))
        assert final.finish_reason is FinishReason.STOP
        assert final.token_ids == free_run.token_ids[: free_run.token_ids.index(stop) + 1]

    @pytest.mark.asyncio
    async def test_streaming_chunks_add_up(self):
        """Streamed new tokens concatenate to the final token list; only the last is finished."""
        async with Engine(small_config()) as engine:
            outputs = await collect(engine.generate("hello", SamplingParams(max_new_tokens=5)))
        assert [o.finished for o in outputs] == [False] * 4 + [True]
        assert sum((o.new_token_ids for o in outputs), []) == outputs[-1].token_ids

    @pytest.mark.asyncio
    async def test_health_check(self):
        """A health check is a one-token request through the same path."""
        async with Engine(small_config()) as engine:
            assert await engine.health_check(timeout=10) is True
            await engine.wait_idle(5)
        assert engine.stats.finishes[("health_check", "LENGTH")] == 1


class TestAborts:
    @pytest.mark.asyncio
    async def test_abort_queued(self):
        """A request aborted while queued behind a full engine finishes ABORT without running."""
        async with Engine(small_config(max_running=1)) as engine:
            first = engine.generate(PROMPT, SamplingParams(max_new_tokens=30), request_id="first")
            second = engine.generate(PROMPT, SamplingParams(max_new_tokens=30), request_id="second")
            await first.__anext__()
            assert live_request(engine, "second").state is RequestState.QUEUED
            assert await engine.abort("second") is True
            outputs = await collect(second)
            await collect(first)
        assert outputs[-1].finish_reason is FinishReason.ABORT and outputs[-1].token_ids == []

    @pytest.mark.asyncio
    @pytest.mark.parametrize("state", [RequestState.PREFILLING, RequestState.DECODING])
    async def test_abort_running(self, state):
        """An abort applied in PREFILLING (chunked) or DECODING finishes ABORT."""
        async with Engine(small_config(max_prefill_tokens=4)) as engine:
            abort_when_step_sees(engine, "r", state)
            outputs = await collect(engine.generate(list(range(1, 30)), SamplingParams(max_new_tokens=40),
                                                     request_id="r"))
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert len(outputs[-1].token_ids) < 40
        assert [s for s, _ in engine.loop.stats.transitions if _ == "FINISHED"] == [state.name]

    @pytest.mark.asyncio
    async def test_abort_unknown_or_finished(self):
        """Aborting an unknown or finished id returns False."""
        async with Engine(small_config()) as engine:
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=2), request_id="done")
            await engine.wait_idle(5)
            assert await engine.abort("done") is False
            assert await engine.abort("never-seen") is False
        assert final.finished

    @pytest.mark.asyncio
    async def test_client_stops_iterating(self):
        """A client that closes its stream mid-way aborts the request."""
        async with Engine(small_config()) as engine:
            async with engine.generate(PROMPT, SamplingParams(max_new_tokens=50), request_id="gone") as stream:
                async for output in stream:
                    if len(output.token_ids) == 2:
                        break
            await engine.wait_idle(5)
        assert engine.stats.finishes[("normal", "ABORT")] == 1

    @pytest.mark.asyncio
    async def test_client_cancelled(self):
        """A consumer cancelled mid-stream aborts its request."""
        async with Engine(small_config()) as engine:
            with anyio.move_on_after(0.2):
                await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True)))
            await engine.wait_idle(5)
        assert engine.stats.finishes[("normal", "ABORT")] == 1


class TestFailures:
    @pytest.mark.asyncio
    async def test_model_step_error(self):
        """A step that raises finishes its batch with ERROR; the engine keeps serving."""
        faults = FaultInjector(fail_step=lambda ids: "bad" in ids)
        async with Engine(small_config(), faults=faults) as engine:
            bad = await engine.complete(PROMPT, SamplingParams(max_new_tokens=5), request_id="bad")
            good = await engine.complete(PROMPT, SamplingParams(max_new_tokens=5), request_id="good")
        assert bad.finish_reason is FinishReason.ERROR and "injected" in bad.error
        assert good.finish_reason is FinishReason.LENGTH and len(good.token_ids) == 5

    @pytest.mark.asyncio
    async def test_release_hook_raises(self):
        """A release hook that raises does not stop the others; the pool is marked suspect."""
        faults = FaultInjector(fail_release={"timing"})
        async with Engine(small_config(), faults=faults) as engine:
            with structlog.testing.capture_logs() as logs:
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=3))
                await engine.wait_idle(5)
        assert final.finish_reason is FinishReason.LENGTH
        assert any(e["event"] == "resource.release_failed" for e in logs)
        assert faults.releases_failed == 1

    @pytest.mark.asyncio
    async def test_health_check_fails_with_reason(self):
        """A health check whose step fails raises HealthCheckFailed naming why, with no leak."""
        faults = FaultInjector(fail_step=lambda ids: any(i.startswith("health") for i in ids))
        async with Engine(small_config(), faults=faults) as engine:
            with pytest.raises(HealthCheckFailed, match="ERROR"):
                await engine.health_check(timeout=10)
            await engine.wait_idle(5)


class TestShutdown:
    @pytest.mark.asyncio
    async def test_leaving_async_with_finishes_streams(self):
        """Requests in flight when the engine exits end with a final SHUTDOWN output."""
        finals = []
        async with Engine(small_config()) as engine:
            streams = [engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True))
                       for _ in range(3)]
            await streams[0].__anext__()
        for stream in streams:
            outputs = await collect(stream)
            finals.append(outputs[-1])
        assert [f.finish_reason for f in finals] == [FinishReason.SHUTDOWN] * 3
        assert engine.idle
