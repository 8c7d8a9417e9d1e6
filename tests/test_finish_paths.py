"""Every finish path through the public API, dense and with HiSparse, ends RELEASED with every pool whole.

Each test runs once per engine kind (`kind`: "dense", "hisparse"), on engines
built by `make_engine`, whose `PoolWatch` checks that every pool adds up at
every transition and after every step; conftest checks that each engine ends
idle with nothing held beyond quarantine. Paths only HiSparse has (staging,
host pressure, the decode role's host pages) are in `TestHiSparseOnly`.
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
from helpers import PoolWatch, abort_on_entry, collect, finished_from, live_request, run_all, small_config

S = RequestState
PROMPT = list(range(3, 33))  # 30 tokens: longer than HiSparse's 16-slot buffer, so decoding swaps in
SPARSE = HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=2, index_dim=16)
KINDS = {"dense": {}, "hisparse": {"hisparse": SPARSE}}
#: what a first-token finish releases, in the one release order
FIRST_TOKEN_RELEASES = {"dense": ["kv", "request_slot", "timing"],
                        "hisparse": ["hisparse_host", "kv", "request_slot", "timing"]}
#: the states a running request can be aborted in
RUNNING = {"dense": [S.PREFILLING, S.DECODING], "hisparse": [S.PREFILLING, S.STAGING, S.DECODING]}


class EngineFactory:
    """Builds engines of one kind, each with a pool watch."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.watches: list[PoolWatch] = []

    def __call__(self, faults: FaultInjector | None = None, **overrides) -> Engine:
        engine = Engine(small_config(**{**KINDS[self.kind], **overrides}), faults=faults)
        self.watches.append(PoolWatch(engine))
        return engine


@pytest.fixture(params=list(KINDS))
def kind(request) -> str:
    return request.param


@pytest.fixture
def make_engine(kind):
    """The engine factory of this kind; afterwards every pool of every engine added up at every check."""
    factory = EngineFactory(kind)
    yield factory
    for watch in factory.watches:
        watch.assert_clean()


class TestNormalFinishes:
    @pytest.mark.asyncio
    async def test_length(self, kind, make_engine):
        """max_new_tokens bounds the output and finishes LENGTH with timings; HiSparse stages once on the way."""
        async with make_engine() as engine:
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=9))
        assert final.finish_reason is FinishReason.LENGTH and len(final.token_ids) == 9
        assert final.time_to_first_token is not None and final.completion_time >= final.time_to_first_token
        assert engine.stats.transitions[("STAGING", "DECODING")] == int(kind == "hisparse")

    @pytest.mark.asyncio
    async def test_first_token_finish(self, kind, make_engine):
        """max_new_tokens=1 goes PREBUILT -> FINISHED, never decoding or staging, and releases everything."""
        async with make_engine() as engine:
            with structlog.testing.capture_logs() as logs:
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=1))
                await engine.wait_idle(5)
        assert final.finish_reason is FinishReason.LENGTH and len(final.token_ids) == 1
        edges = [(e["src"], e["dst"]) for e in logs if e["event"] == "request.transition"]
        assert ("PREBUILT", "FINISHED") in edges and ("FINISHED", "RELEASED") in edges
        assert ("PREBUILT", "DECODING") not in edges and ("PREBUILT", "STAGING") not in edges
        assert [e["resource"] for e in logs if e["event"] == "resource.released"] == FIRST_TOKEN_RELEASES[kind]

    @pytest.mark.asyncio
    async def test_stop_token(self, make_engine):
        """A stop token mid-decode finishes with STOP and is the last token."""
        async with make_engine() as engine:
            free_run = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6))
            stop = free_run.token_ids[3]
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6, stop_token_ids=[stop]))
        assert final.finish_reason is FinishReason.STOP
        assert final.token_ids == free_run.token_ids[: free_run.token_ids.index(stop) + 1]

    @pytest.mark.asyncio
    async def test_streaming_chunks_add_up(self, make_engine):
        """Streamed new tokens concatenate to the final token list; only the last output is finished."""
        async with make_engine() as engine:
            outputs = await collect(engine.generate("hello", SamplingParams(max_new_tokens=5)))
        assert [o.finished for o in outputs] == [False] * 4 + [True]
        assert sum((o.new_token_ids for o in outputs), []) == outputs[-1].token_ids

    @pytest.mark.asyncio
    async def test_health_check(self, make_engine):
        """A health check is a one-token request through the same path, counted as a health check."""
        async with make_engine() as engine:
            assert await engine.health_check(timeout=10) is True
            await engine.wait_idle(5)
        assert engine.stats.finishes[("health_check", "LENGTH")] == 1


class TestAborts:
    @pytest.mark.asyncio
    async def test_abort_queued(self, make_engine):
        """A request aborted while queued behind a full engine finishes ABORT from QUEUED, holding nothing."""
        async with make_engine(max_running=1) as engine:
            first = engine.generate(PROMPT, SamplingParams(max_new_tokens=20), request_id="first")
            second = engine.generate(PROMPT, SamplingParams(max_new_tokens=20), request_id="second")
            await first.__anext__()
            assert live_request(engine, "second").state is S.QUEUED
            assert await engine.abort("second") is True
            outputs = await collect(second)
            await collect(first)
        assert outputs[-1].finish_reason is FinishReason.ABORT and outputs[-1].token_ids == []
        assert "QUEUED" in finished_from(engine)  # so it never took a slot, KV or host pages

    @pytest.mark.asyncio
    @pytest.mark.parametrize(("kind", "state"), [(k, s) for k in KINDS for s in RUNNING[k]],
                             ids=[f"{k}-{s.name}" for k in KINDS for s in RUNNING[k]])
    async def test_abort_running(self, make_engine, state):
        """An abort applied in PREFILLING (chunked), STAGING (HiSparse) or DECODING finishes ABORT from there."""
        async with make_engine(max_prefill_tokens=8) as engine:
            abort_on_entry(engine, "r", state)
            outputs = await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=30), request_id="r"))
        assert outputs[-1].finish_reason is FinishReason.ABORT and len(outputs[-1].token_ids) < 30
        assert finished_from(engine) == [state.name]

    @pytest.mark.asyncio
    async def test_abort_unknown_or_finished(self, make_engine):
        """Aborting an unknown or finished id returns False."""
        async with make_engine() as engine:
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=2), request_id="done")
            await engine.wait_idle(5)
            assert await engine.abort("done") is False
            assert await engine.abort("never-seen") is False
        assert final.finished

    @pytest.mark.asyncio
    async def test_client_stops_iterating(self, make_engine):
        """A client that closes its stream mid-decode aborts the request."""
        async with make_engine() as engine:
            async with engine.generate(PROMPT, SamplingParams(max_new_tokens=40), request_id="gone") as stream:
                async for output in stream:
                    if len(output.token_ids) == 3:
                        break
            await engine.wait_idle(5)
        assert engine.stats.finishes[("normal", "ABORT")] == 1

    @pytest.mark.asyncio
    async def test_client_cancelled(self, make_engine):
        """A consumer cancelled mid-stream aborts its request."""
        async with make_engine() as engine:
            with anyio.CancelScope() as consumer:
                async for output in engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True)):
                    if len(output.token_ids) == 2:
                        consumer.cancel()  # lands in the stream's next wait for an output
            await engine.wait_idle(5)
        assert consumer.cancelled_caught and len(output.token_ids) == 2
        assert engine.stats.finishes[("normal", "ABORT")] == 1


class TestFailures:
    @pytest.mark.asyncio
    @pytest.mark.parametrize(("failing", "where"), [(1, "PREFILLING"), (4, "DECODING")], ids=["prefill", "decode"])
    async def test_model_step_error(self, make_engine, failing, where):
        """A step that raises finishes its batch with ERROR from where it was; the engine keeps serving."""
        steps = {"bad": 0}

        def fail(ids) -> bool:
            if "bad" in ids:
                steps["bad"] += 1
                return steps["bad"] == failing
            return False

        async with make_engine(faults=FaultInjector(fail_step=fail)) as engine:
            bad = await engine.complete(PROMPT, SamplingParams(max_new_tokens=10), request_id="bad")
            bad_from = finished_from(engine)
            good = await engine.complete(PROMPT, SamplingParams(max_new_tokens=5), request_id="good")
        assert bad.finish_reason is FinishReason.ERROR and "injected" in bad.error and bad_from == [where]
        assert good.finish_reason is FinishReason.LENGTH and len(good.token_ids) == 5

    @pytest.mark.asyncio
    async def test_release_hook_raises(self, make_engine):
        """A release hook that raises does not stop the others; the failure is logged and counted."""
        faults = FaultInjector(fail_release={"timing"})
        async with make_engine(faults=faults) as engine:
            with structlog.testing.capture_logs() as logs:
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=3))
                await engine.wait_idle(5)
        assert final.finish_reason is FinishReason.LENGTH
        assert any(e["event"] == "resource.release_failed" for e in logs)
        assert faults.releases_failed == 1

    @pytest.mark.asyncio
    async def test_health_check_fails_with_reason(self, make_engine):
        """A health check whose step fails raises HealthCheckFailed naming why, with no leak."""
        faults = FaultInjector(fail_step=lambda ids: any(i.startswith("health") for i in ids))
        async with make_engine(faults=faults) as engine:
            with pytest.raises(HealthCheckFailed, match="ERROR"):
                await engine.health_check(timeout=10)
            await engine.wait_idle(5)


class TestShutdown:
    @pytest.mark.asyncio
    async def test_leaving_async_with_finishes_streams(self, make_engine):
        """Requests decoding when the engine exits end with a final SHUTDOWN output and free everything."""
        async with make_engine() as engine:
            streams = [engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True))
                       for _ in range(3)]
            for stream in streams:
                await stream.__anext__()
        finals = [(await collect(stream))[-1] for stream in streams]
        assert [f.finish_reason for f in finals] == [FinishReason.SHUTDOWN] * 3
        assert engine.idle


@pytest.mark.parametrize("kind", ["hisparse"])
class TestHiSparseOnly:
    @pytest.mark.asyncio
    async def test_memory_report_lists_hisparse_pools(self, make_engine):
        """memory_report() lists the HiSparse device, host and map pools, whole at idle and at every check."""
        async with make_engine() as engine:
            await engine.complete(PROMPT, SamplingParams(max_new_tokens=4))
            await engine.wait_idle(5)
            report = engine.check_memory()
        assert {DEVICE_SLOTS, HOST_PAGES, SLOT_MAPS} <= set(report.pools)
        assert make_engine.watches[0].checks >= 8

    @pytest.mark.asyncio
    async def test_abort_in_staging_with_stuck_copy_quarantines(self, make_engine):
        """A staging copy that never finishes: the abort quarantines host and KV pages at fence_timeout."""
        faults = FaultInjector(stuck_fences={"host_backup"})
        async with make_engine(faults=faults, fence_timeout=0.2) as engine:
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=5), request_id="stuck")
            await stream.__anext__()  # the first token is out: the staging copy has begun
            assert live_request(engine, "stuck").state is S.STAGING
            assert await engine.abort("stuck")
            outputs = await collect(stream)
            await engine.wait_idle(5)
            report = engine.check_memory()
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert report.pools[HOST_PAGES].quarantined > 0 and report.pools[KV_PAGES].quarantined > 0
        assert report.pools[DEVICE_SLOTS].held == 0

    @pytest.mark.asyncio
    async def test_host_pressure_retracts_and_output_is_unchanged(self, make_engine):
        """A host pool too small for three growing requests retracts; outputs equal an unpressured run."""
        exact = HiSparseConfig(top_k=128, device_buffer_size=128, recent_window=2, index_dim=8)
        prompts = [[(11 * i + j) % 250 for i in range(40)] for j in range(3)]
        async with make_engine(hisparse=exact) as calm:
            expected = await run_all(calm, prompts, 60)
        pressured = HiSparseConfig(top_k=128, device_buffer_size=128, recent_window=2, index_dim=8,
                                   host_pool_tokens=256)
        async with make_engine(hisparse=pressured) as engine:
            got = await run_all(engine, prompts, 60)
        assert engine.stats.retractions > 0
        assert got == expected

    @pytest.mark.asyncio
    async def test_host_pages_at_transferring_and_same_output(self, make_engine):
        """Decode role: host pages are held from TRANSFERRING on; output equals the single engine's."""
        async with make_engine() as single:
            expected = (await single.complete(PROMPT, SamplingParams(max_new_tokens=8))).token_ids
        entered = []
        async with make_engine(disaggregation="decode") as engine:
            engine.parts.machine.transition_observers.append(
                lambda r, src, dst: entered.append("hisparse_host" in r.handles) if dst is S.TRANSFERRING else None)
            final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=8))
        assert entered == [True] and final.token_ids == expected
        assert engine.stats.transitions[("STAGING", "DECODING")] == 1
