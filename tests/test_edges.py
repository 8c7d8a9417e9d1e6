"""Issue 11's edges, one regression test each: configs, inputs and faults that used
to lose memory, wedge the queue or kill the engine. Every engine ends with its
pools whole (conftest)."""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from engine import (
    Engine,
    EngineConfig,
    EngineDead,
    FinishReason,
    InvalidRequest,
    LeakError,
    RequestState,
    SamplingParams,
)
from engine.testing import FaultInjector
from helpers import DEADLINE, collect, live_request, small_config
from plugin_example import LoraSlotHook

S = RequestState
PROMPT = list(range(5, 25))


class _Forgetful(LoraSlotHook):
    """A plugin whose release forgets to give its slot back: a real leak."""

    def release(self, request, handle):
        pass


class TestConfigs:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("max_context", [37, 61, 100])
    async def test_max_context_not_a_whole_number_of_pages(self, max_context):
        """Any max_context works with any page size: a request using all of it decodes to the end (item 7)."""
        config = small_config(page_size=8, num_kv_pages=40, max_context=max_context)
        async with Engine(config) as engine:
            prompt = list(range(1, max_context - 9))
            final = await engine.complete(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
        assert final.finish_reason is FinishReason.LENGTH and len(final.token_ids) == 10

    @pytest.mark.asyncio
    async def test_a_prompt_that_fills_the_pool_is_admitted(self):
        """A request using the whole pool runs when alone: no spare page is kept back then (item 11)."""
        config = small_config(page_size=4, num_kv_pages=11, max_context=40)
        async with Engine(config) as engine:
            final = await engine.complete(list(range(1, 39)), SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert final.finish_reason is FinishReason.LENGTH

    def test_max_context_is_derived_from_the_pool_and_the_model(self):
        """A small pool no longer needs max_context spelled out (item 16); the model's limit bounds it."""
        engine = Engine(EngineConfig(num_kv_pages=24, page_size=16, use_entry_points=False))
        assert engine.max_context == 23 * 16
        with pytest.raises(InvalidRequest, match="max_position_embeddings"):
            Engine(EngineConfig(num_kv_pages=4096, page_size=16, max_context=40000, use_entry_points=False))


class TestInputs:
    @pytest.mark.asyncio
    async def test_an_image_larger_than_the_cache_is_refused_at_submit(self):
        """An image whose embeddings can never fit the multimodal cache is refused, not queued (item 10)."""
        image = torch.zeros(64, 64, 3, dtype=torch.uint8)  # 64 patches x 256 floats = 64 KiB
        async with Engine(small_config(mm_cache_bytes=32 << 10)) as engine:
            with pytest.raises(InvalidRequest, match="mm_cache_bytes = 32768"):
                engine.generate([1, 2], mm_inputs=[image])
            final = await engine.complete([1, 2], SamplingParams(max_new_tokens=2))
        assert final.finish_reason is FinishReason.LENGTH

    @pytest.mark.asyncio
    @pytest.mark.parametrize("odd", [["a"], {"a": 1}, {"a"}, 7, None, b"a"])
    async def test_abort_with_an_odd_id_is_false(self, odd):
        """abort() of anything but a live id returns False, never raises (item 14)."""
        async with Engine(small_config(model="null")) as engine:
            assert await engine.abort(odd) is False


class TestIdentity:
    @pytest.mark.asyncio
    async def test_closing_an_old_stream_aborts_only_its_own_request(self):
        """A stream closed after its id was reused by a new request leaves the new one running (item 13)."""
        async with Engine(small_config(model="null")) as engine:
            old = engine.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="same")
            await engine.wait_idle(DEADLINE)
            new = engine.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True), request_id="same")
            await old.aclose()
            final = (await collect(new))[-1]
        assert final.finish_reason is FinishReason.LENGTH and len(final.token_ids) == 8

    @pytest.mark.asyncio
    async def test_a_reused_id_never_touches_a_quarantined_holding(self):
        """A request reusing the id of one whose KV is quarantined frees only its own pages (item 9)."""
        faults = FaultInjector(stuck_fences={"kv_transfer"})
        config = small_config(model="null", disaggregation="decode", fence_timeout=0.2)
        async with Engine(config, faults=faults) as engine:
            first = await engine.complete(PROMPT, SamplingParams(max_new_tokens=2), request_id="same")
            await engine.wait_idle(DEADLINE)
            faults.stuck_fences = frozenset()
            second = await engine.complete(PROMPT, SamplingParams(max_new_tokens=2), request_id="same")
            await engine.wait_idle(DEADLINE)
            report = engine.check_memory()
            assert report.pools["kv_pages"].held == report.pools["kv_pages"].quarantined > 0
            faults.unstick()
            while engine.memory_report().pools["kv_pages"].quarantined:
                await anyio.sleep(0.01)
        assert first.finish_reason is FinishReason.TRANSFER_FAILED and second.finish_reason is FinishReason.LENGTH


class TestQuarantineEnds:
    @pytest.mark.asyncio
    async def test_a_late_copy_gives_its_pages_and_slot_back(self):
        """Quarantined pages come back when the stuck copy completes after all; slots never stay lost (item 8)."""
        faults = FaultInjector(stuck_fences={"kv_transfer"})
        config = small_config(model="null", disaggregation="decode", fence_timeout=0.2, max_running=2)
        async with Engine(config, faults=faults) as engine:
            lost = [await engine.complete(PROMPT, SamplingParams(max_new_tokens=2)) for _ in range(3)]
            await engine.wait_idle(DEADLINE)
            assert engine.memory_report().pools["request_slots"].held == 0  # more lost copies than slots
            faults.stuck_fences = frozenset()
            fine = await engine.complete(PROMPT, SamplingParams(max_new_tokens=2))
            faults.unstick()
            while engine.memory_report().pools["kv_pages"].held:
                await anyio.sleep(0.01)
        assert {f.finish_reason for f in lost} == {FinishReason.TRANSFER_FAILED}
        assert fine.finish_reason is FinishReason.LENGTH

    @pytest.mark.asyncio
    async def test_abort_before_the_transfer_starts_frees_at_once(self):
        """A decode-role request aborted while its prefill job waits is released without any deadline (item 8)."""
        started = anyio.Event()
        release = anyio.Event()
        token = anyio.lowlevel.current_token()

        def stall(ids):  # the prefill runtime's step of the first job blocks until released
            if any(i.startswith("prefill:first") for i in ids):
                anyio.from_thread.run_sync(started.set, token=token)
                anyio.from_thread.run(release.wait, token=token)

        config = small_config(model="null", disaggregation="decode", fence_timeout=60)
        async with Engine(config, faults=FaultInjector(stall_step=stall)) as engine:
            try:
                first = engine.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="first")
                await started.wait()  # the prefill runtime is inside a step: the next job waits for it
                queued = engine.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="queued")
                with anyio.fail_after(DEADLINE):
                    while not engine.requests_by_state().get(RequestState.TRANSFERRING, 0) == 2:
                        await anyio.sleep(0.005)
                assert await engine.abort("queued")
                with anyio.fail_after(2):  # no 60 s fence deadline to wait out
                    final = (await collect(queued))[-1]
                    while engine.loop.is_live("queued"):
                        await anyio.sleep(0.005)
            finally:
                release.set()
            await collect(first)
        assert final.finish_reason is FinishReason.ABORT


class TestLeaksAndDeaths:
    @pytest.mark.asyncio
    async def test_a_leak_at_idle_is_reported_and_service_goes_on(self):
        """An idle leak is logged and counted while the engine serves on; leak_check="raise" raises at exit (item 4)."""
        engine = Engine(small_config(resources=(_Forgetful,)))
        engine._expect_leak = True
        with pytest.raises(LeakError, match="lora_slots"):
            async with engine:
                for i in range(3):
                    final = await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2), request_id=f"r{i}")
                    assert final.finish_reason is FinishReason.LENGTH
                    await engine.wait_idle(DEADLINE)
                    while engine.stats.leak_check_failures <= i:  # the idle check after each one finds it
                        await anyio.sleep(0.005)
                health = engine.health()
                report = engine.memory_report()
        assert report.leaks_found >= 3 and engine.stats.leak_check_failures >= 3
        assert not health.healthy and health.reason == "leaking" and "lora_slots" in health.detail

    @pytest.mark.asyncio
    async def test_a_leaking_plugin_that_starves_the_queue_is_reported(self):
        """Requests that can never get the plugin's slot are reported as starved, naming the pool (item 12)."""
        engine = Engine(small_config(resources=(_Forgetful,), starvation_timeout=0.05, leak_check="log"))
        engine._expect_leak = True
        async with engine:
            for i in range(4):  # each leaks one of the plugin's four slots
                await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2), request_id=f"leak{i}")
            stream = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="starved")
            with anyio.fail_after(DEADLINE):
                while not engine.memory_report().starved:
                    await anyio.sleep(0.01)
            report = engine.memory_report()
            assert engine.errored is None and engine.health().reason in ("leaking", "starved")
            assert engine.stats.starved == 1
            await stream.aclose()
        (record,) = report.starved
        assert record["request_id"] == "starved" and "lora_slots" in record["pools"]

    @pytest.mark.asyncio
    async def test_a_dead_loop_ends_every_stream_with_engine_dead(self, monkeypatch):
        """If the loop itself fails, open streams raise EngineDead with the cause and new submissions too."""
        async with Engine(small_config(model="null")) as engine:
            engine._expect_dead = True
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=50, ignore_eos=True))
            await stream.__anext__()

            def broken():
                raise RuntimeError("a bug in the loop")

            monkeypatch.setattr(engine.loop.planner, "prepare", broken)  # the fault: not a hook, the loop
            with pytest.raises(EngineDead) as info:
                await collect(stream)
            assert isinstance(info.value.cause, RuntimeError) and isinstance(engine.errored, RuntimeError)
            with pytest.raises(EngineDead):
                engine.generate(PROMPT)
            assert engine.health().reason == "dead"
        assert engine.idle


class TestSeededPaths:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("role", ["none", "decode"])
    async def test_a_retracted_seeded_request_gets_the_same_tokens(self, role):
        """Sampling seeded by output position: retraction or a re-prefill changes no token (item 15)."""
        params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
        async with Engine(small_config(disaggregation=role)) as roomy:
            want = await roomy.complete(PROMPT[:8], params)
        config = small_config(disaggregation=role, page_size=4, num_kv_pages=12, max_context=40)
        async with Engine(config) as tight:
            streams = [tight.generate(PROMPT[:8], params, request_id=f"s{i}") for i in range(2)]
            finals = [(await collect(s))[-1] for s in streams]
        assert tight.stats.retractions >= 1
        assert all(f.token_ids == want.token_ids for f in finals)


class TestRefusedStarts:
    @pytest.mark.asyncio
    async def test_exhausted_at_queued_waits_then_runs(self):
        """A hook refusing QUEUED with ResourceExhausted leaves the request unstarted, then it runs (item 3)."""
        from resources import ResourceExhausted, ResourceHook
        from states import Handle

        class Gate(ResourceHook):
            name, acquire_on = "gate", frozenset({S.QUEUED})
            refusals = 3

            def acquire(self, request, into):
                if self.refusals:
                    self.refusals -= 1
                    raise ResourceExhausted("gate closed")
                return Handle(self.name, request.request_id)

        gate = Gate()
        async with Engine(small_config(model="null", resources=(gate,))) as engine:
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="waits")
            assert live_request(engine, "waits") is not None
            final = (await collect(stream))[-1]
        assert final.finish_reason is FinishReason.LENGTH and gate.refusals == 0


class TestStarvationEnds:
    @pytest.mark.asyncio
    async def test_a_starved_request_that_finishes_is_no_longer_reported(self):
        """A request reported starved and then aborted from QUEUED leaves the report and health() at release."""
        slow = FaultInjector(stall_step=lambda ids: time.sleep(0.005))  # the first request holds the slot a while
        async with Engine(small_config(model="null", max_running=1, starvation_timeout=0.05), faults=slow) as engine:
            first = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True), request_id="first")
            second = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="second")
            with anyio.fail_after(DEADLINE):
                while not engine.memory_report().starved:
                    await anyio.sleep(0.01)
            assert engine.health().reason == "starved"
            await engine.abort("second")
            await collect(second)
            await engine.abort("first")
            await collect(first)
            await engine.wait_idle(DEADLINE)
            assert engine.memory_report().starved == () and engine.health().healthy


class TestAdmissionWindow:
    @pytest.mark.asyncio
    async def test_an_admission_window_serves_like_no_window(self):
        """With a window after finishing steps, requests one after another and at once still all complete alike."""
        async with Engine(small_config(model="null", admission_window=0.02)) as engine:
            alone = [await engine.complete(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True)) for _ in range(3)]
            streams = [engine.generate(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True)) for _ in range(4)]
            together = [(await collect(s))[-1] for s in streams]
        assert {tuple(f.token_ids) for f in alone + together} == {tuple(alone[0].token_ids)}
