"""`Engine.complete` asks its stream for the final output only: the same final output as
iterating `generate` to the end, its caller woken once instead of once per token, and a
cancelled `complete` still aborts its request (pools whole: the conftest check)."""

from __future__ import annotations

import anyio
import pytest

from engine import Engine, SamplingParams
from engine.stream import OutputChannel
from helpers import small_config

PROMPT = list(range(3, 17))


class _CountingReceive:
    """Counts the outputs `OutputChannel.receive` hands a reader."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = OutputChannel.receive

        async def receive(channel):
            item = await original(channel)
            self.count += 1
            return item

        monkeypatch.setattr(OutputChannel, "receive", receive)


@pytest.mark.asyncio
async def test_complete_equals_the_streams_final_output_and_wakes_once(monkeypatch):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=1)
    async with Engine(small_config(prefix_cache=False)) as engine:  # both runs compute the same way
        streamed = [o async for o in engine.generate(PROMPT, params)]
        received = _CountingReceive(monkeypatch)
        final = await engine.complete(PROMPT, params)
        await engine.wait_idle(30)
    assert received.count == 1  # the final output alone, not one per token
    assert len(streamed) == 20 and streamed[-1].finished
    last = streamed[-1]
    assert (final.token_ids, final.text, final.finish_reason) == (last.token_ids, last.text, last.finish_reason)
    assert final.logprobs == last.logprobs and len(final.token_ids) == 20


@pytest.mark.asyncio
async def test_a_cancelled_complete_aborts_its_request():
    async with Engine(small_config()) as engine:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def cancel_once_decoding() -> None:
                    while engine.stats.tokens_generated < 3:
                        await anyio.sleep(0.001)
                    scope.cancel()

                tg.start_soon(cancel_once_decoding)
                await engine.complete(PROMPT, SamplingParams(max_new_tokens=230, ignore_eos=True))
        await engine.wait_idle(30)
    assert scope.cancelled_caught
    assert engine.stats.finishes[("normal", "ABORT")] == 1 and engine.stats.tokens_generated < 230
