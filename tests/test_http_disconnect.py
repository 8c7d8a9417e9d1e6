"""A client that disconnects aborts its request, which is released like any other.

The autouse fixture in conftest.py checks every engine's pools after each test.
"""

from __future__ import annotations

import time

import anyio
import pytest

from engine.testing import FaultInjector
from http_helpers import StepGate, serving

PROMPT = [5, 17, 42, 99, 3, 8, 120, 77, 31]
STREAMS = {
    "/generate": {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 200}},
    "/v1/completions": {"prompt": PROMPT, "stream": True, "max_tokens": 200, "temperature": 0},
}


def _slow_steps() -> FaultInjector:
    """Each model step takes at least 10 ms, so 200 tokens outlast the test's reads."""
    return FaultInjector(fail_step=lambda ids: time.sleep(0.01))


class TestClientLeavesMidStream:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("path", sorted(STREAMS))
    async def test_closing_the_connection_aborts(self, path):
        """Closing the connection after the first event aborts the request; it is released, pools whole."""
        async with serving(faults=_slow_steps()) as (engine, client):
            async with client.stream("POST", path, json=STREAMS[path]) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # leaving the block closes the connection mid-stream
            await engine.wait_idle(5)
            memory = (await client.get("/debug/memory")).json()
        assert engine.stats.finishes[("normal", "ABORT")] == 1
        assert engine.stats.transitions[("DECODING", "FINISHED")] == 1
        assert engine.stats.transitions[("FINISHED", "RELEASED")] == 1
        assert engine.stats.tokens_generated < 200
        assert memory["idle"] and all(p["held"] == 0 and p["adds_up"] for p in memory["pools"].values())

    @pytest.mark.asyncio
    async def test_many_clients_leave_at_once(self):
        """Eight streams closed mid-way all end ABORT and every pool is whole."""
        async with serving(faults=_slow_steps()) as (engine, client):

            async def leave_after_first_event() -> None:
                async with client.stream("POST", "/generate", json=STREAMS["/generate"]) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            return

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(leave_after_first_event)
            await engine.wait_idle(5)
        assert engine.stats.finishes[("normal", "ABORT")] == 8


class TestClientLeavesBeforeAnswer:
    @pytest.mark.asyncio
    async def test_non_streaming_client_gives_up_while_queued(self):
        """A non-streaming client that gives up while its request is queued aborts it from QUEUED."""
        gate = StepGate()
        async with serving(faults=FaultInjector(fail_step=gate), max_running=1) as (engine, client):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json={"input_ids": PROMPT}))
                await gate.wait_entered()
                with anyio.move_on_after(0.3):  # the client gives up; httpx closes the connection
                    await client.post("/generate", json={"input_ids": PROMPT, "rid": "quitter"})
                gate.open()
            await engine.wait_idle(5)
        assert engine.stats.transitions[("QUEUED", "FINISHED")] == 1
        assert engine.stats.finishes == {("normal", "ABORT"): 1, ("normal", "LENGTH"): 1}
