"""/health_generate: healthy while the engine makes progress, even with every slot busy; unhealthy
(503 with the reason) when it is stuck, dead or leaking."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from engine import Engine
from engine.serve.server import create_app
from engine.serve.settings import ServerSettings
from engine.testing import FaultInjector
from helpers import small_config
from http_helpers import StepGate, leak_once, serving
from states import RequestState

LONG = {"input_ids": [5, 6, 7, 8], "stream": True, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}


class TestUnderLoad:
    @pytest.mark.asyncio
    async def test_healthy_while_every_slot_is_busy_for_seconds(self):
        """With both slots decoding and one request waiting, repeated checks over seconds all answer 200
        from progress, and send no probe of their own."""
        slow = FaultInjector(stall_step=lambda ids: time.sleep(0.02))
        async with serving(faults=slow, max_running=2) as (engine, client):
            answers, busy = [], []
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(lambda i=i: client.post("/generate", json={**LONG, "rid": f"long-{i}"}))
                with anyio.fail_after(10):
                    while engine.requests_by_state().get(RequestState.DECODING, 0) < 2:
                        await anyio.sleep(0.01)
                for _ in range(10):
                    by_state = engine.requests_by_state()
                    busy.append((by_state.get(RequestState.DECODING, 0), by_state.get(RequestState.QUEUED, 0)))
                    answers.append(await client.get("/health_generate"))
                    await anyio.sleep(0.2)
                for i in range(3):
                    await client.post("/abort", json={"rid": f"long-{i}"})
            await engine.wait_idle(5)
        assert busy == [(2, 1)] * 10  # every slot was busy at every check
        assert [(a.status_code, a.json()["checked"]) for a in answers] == [(200, "progress")] * 10
        assert not any(kind == "health_check" for kind, _ in engine.stats.finishes)

    @pytest.mark.asyncio
    async def test_probe_when_a_slot_is_free(self):
        """With a slot free the check runs its one-token request alongside the traffic."""
        slow = FaultInjector(stall_step=lambda ids: time.sleep(0.01))
        async with serving(faults=slow, max_running=2) as (engine, client):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json={**LONG, "rid": "one"}))
                with anyio.fail_after(10):
                    while engine.requests_by_state().get(RequestState.DECODING, 0) < 1:
                        await anyio.sleep(0.01)
                answer = await client.get("/health_generate")
                await client.post("/abort", json={"rid": "one"})
        assert answer.status_code == 200 and answer.json()["checked"] == "request"
        assert engine.stats.finishes[("health_check", "LENGTH")] == 1


class TestUnhealthy:
    @pytest.mark.asyncio
    async def test_stuck_when_a_step_never_ends(self):
        """A model step that hangs with every slot busy: 503 'stuck', without waiting for a probe."""
        gate = StepGate()
        settings = ServerSettings(health_timeout=0.2)
        async with serving(settings, faults=FaultInjector(fail_step=gate), max_running=1) as (engine, client):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json={"input_ids": [1, 2, 3]}))
                await gate.wait_entered()
                with anyio.fail_after(10):
                    while (answer := await client.get("/health_generate")).status_code == 200:
                        await anyio.sleep(0.05)
                gate.open()
        assert answer.status_code == 503
        assert answer.json()["reason"] == "stuck" and answer.json()["checked"] == "state"
        assert not any(kind == "health_check" for kind, _ in engine.stats.finishes)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("idle_first", [0.0, 1.5])
    async def test_not_stuck_before_a_first_step_could_end(self, idle_first):
        """Requests admitted on a fresh server, or after an idle spell longer than the health timeout,
        whose first step is still running: /health and /health_generate answer 200 (a router that
        took the instance out here refused every request it was given: test_gateway's killed instance)."""
        gate = StepGate()
        faults, settings = FaultInjector(fail_step=gate), ServerSettings(health_timeout=1.0)
        async with serving(settings, faults=faults, max_running=1) as (engine, client):
            if idle_first:
                gate.open()
                await client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
                await anyio.sleep(idle_first)  # the latest progress is now older than the timeout
                gate = faults.fail_step = StepGate()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json={"input_ids": [4, 5, 6]}))
                await gate.wait_entered()
                ready, progress = await client.get("/health"), await client.get("/health_generate")
                gate.open()
        assert ready.status_code == 200, ready.json()
        assert progress.status_code == 200 and progress.json()["checked"] == "progress", progress.json()

    @pytest.mark.asyncio
    async def test_leaking_after_an_idle_leak_check_failed(self):
        """A release that leaks is found by the idle leak check; the health check then says 'leaking'."""
        faults = FaultInjector(fail_release={"kv"}, release_leaks=True)
        async with serving(faults=faults, leak_check="log") as (engine, client):
            await leak_once(engine, client)
            answer = await client.get("/health_generate")
        assert answer.status_code == 503 and answer.json()["reason"] == "leaking" and answer.json()["detail"]

    @pytest.mark.asyncio
    async def test_dead_when_the_engine_is_not_running(self):
        """An app whose engine has stopped answers 503 'dead'."""
        async with Engine(small_config()) as engine:
            app = create_app(engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            answer = await client.get("/health_generate")
        assert answer.status_code == 503 and answer.json()["reason"] == "dead"
