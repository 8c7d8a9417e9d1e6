"""A leak is found while the engine is busy, not only at idle; a starved request's record names the pool it
waits for and who holds it; a pool whose stats() raises makes the engine say it cannot be checked."""

from __future__ import annotations

import time

import anyio
import pytest

from engine import Engine, FinishReason, LeakError, SamplingParams
from engine.testing import FaultInjector
from helpers import DEADLINE, small_config
from plugin_example import LoraSlotHook


class _Forgetful(LoraSlotHook):
    """A plugin whose release forgets to give its slot back: a real leak."""

    def release(self, request, handle):
        pass


class _UnreadableSlots(LoraSlotHook):
    """A plugin whose pool's stats() raises (its accounting is broken), while the hook itself works."""

    def __init__(self, context) -> None:
        super().__init__(context)

        def broken():
            raise RuntimeError("stats are broken")

        self.slots.stats = broken


class TestBusyLeaks:
    @pytest.mark.asyncio
    async def test_a_leak_that_drains_a_plugin_pool_is_found_while_busy(self):
        """Three requests leak three of the plugin's four slots while a long request keeps the engine busy
        (it never goes idle): the leak is found anyway, health says leaking, and the request that starves for
        the last slot names lora_slots, the long request holding one, and the three slots nobody holds."""
        slow = FaultInjector(stall_step=lambda ids: time.sleep(0.003))
        engine = Engine(small_config(resources=(_Forgetful,), starvation_timeout=0.05, leak_check="log"),
                        faults=slow)
        engine._expect_leak = True
        async with engine:
            long = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=240, ignore_eos=True), request_id="long")
            await long.__anext__()
            for i in range(3):
                await engine.complete([4, 5, 6], SamplingParams(max_new_tokens=2), request_id=f"leak{i}")
            starved = engine.generate([7, 8, 9], SamplingParams(max_new_tokens=2), request_id="starved")
            with anyio.fail_after(DEADLINE):
                while not (engine.memory_report().starved and engine.memory_report().last_leak):
                    await anyio.sleep(0.01)
            report, health, idle = engine.memory_report(), engine.health(), engine.idle
            await starved.aclose()
            await long.aclose()
        assert not idle and engine.stats.leak_check_failures >= 1
        assert any(p.startswith("lora_slots: free 0") for p in report.last_leak), report.last_leak
        assert not health.healthy and health.reason == "leaking" and "lora_slots" in health.detail
        (record,) = report.starved
        assert record["request_id"] == "starved" and record["waiting_for"] == ["lora_slots"]
        assert record["pools"]["lora_slots"] == {"free": 0, "evictable": 0, "held": 1, "capacity": 4}
        assert record["holders"]["lora_slots"] == ["long (DECODING, -) 1", "3 slots held by no live request (leaked)"]

    @pytest.mark.asyncio
    async def test_a_request_refused_at_queued_starves_visibly(self):
        """A hook acquiring on QUEUED whose pool leaked dry leaves requests unstarted: they are reported starved
        too (naming the pool), not left waiting unseen."""
        from states import RequestState

        class QueuedLease(_Forgetful):
            acquire_on = frozenset({RequestState.QUEUED})
            scope = frozenset(RequestState) - {RequestState.RELEASED}

        engine = Engine(small_config(resources=(QueuedLease,), starvation_timeout=0.05, leak_check="log"))
        engine._expect_leak = True
        async with engine:
            for i in range(4):
                await engine.complete([1, 2], SamplingParams(max_new_tokens=1), request_id=f"leak{i}")
            waiting = engine.generate([1, 2], SamplingParams(max_new_tokens=1), request_id="unstarted")
            with anyio.fail_after(DEADLINE):
                while not engine.memory_report().starved:
                    await anyio.sleep(0.01)
            (record,) = engine.memory_report().starved
            assert engine.health().reason == "leaking"
            await waiting.aclose()
        assert record["request_id"] == "unstarted" and record["waiting_for"] == ["lora_slots"]
        assert record["holders"]["lora_slots"] == ["4 slots held by no live request (leaked)"]


class TestUncheckablePools:
    @pytest.mark.asyncio
    async def test_a_pool_whose_stats_raise_is_not_ok(self):
        """A plugin pool whose stats() raises: requests still run, but health is "unchecked" naming the pool,
        the memory report lists it as unchecked (not a pool of capacity 0 that adds up), and the leak check
        reports it instead of passing."""
        engine = Engine(small_config(resources=(_UnreadableSlots,), leak_check="log"))
        engine._expect_leak = True
        async with engine:
            final = await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2))
            await engine.wait_idle(DEADLINE)
            health, report = engine.health(), engine.memory_report()
            with pytest.raises(LeakError, match="lora_slots: cannot be checked"):
                engine.check_memory()
        assert final.finish_reason is FinishReason.LENGTH
        assert not health.healthy and health.reason == "unchecked"
        assert "lora_slots" in health.detail and "stats are broken" in health.detail
        assert set(report.unchecked) == {"lora_slots"} and not report.pools["lora_slots"].adds_up
        assert report.as_dict()["unchecked"] == {"lora_slots": "RuntimeError('stats are broken')"}
        assert report.pools["kv_pages"].adds_up and engine.stats.leak_check_failures >= 1

    @pytest.mark.asyncio
    async def test_health_generate_says_unchecked(self):
        """Over HTTP, /health_generate is a 503 with reason "unchecked" naming the pool."""
        from http_helpers import serving

        async with serving(resources=(_UnreadableSlots,), leak_check="log") as (engine, client):
            engine._expect_leak = True
            response = await client.get("/health_generate")
            memory = (await client.get("/debug/memory")).json()
        body = response.json()
        assert response.status_code == 503 and body["reason"] == "unchecked" and "lora_slots" in body["detail"]
        assert "lora_slots" in memory["unchecked"] and memory["pools"]["lora_slots"]["error"]
