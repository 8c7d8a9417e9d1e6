"""Entering and leaving `async with Engine(...)` under both anyio backends: the body's own exception comes
out as itself, a cancelled body leaves cleanly, and an engine built under one backend runs under the other."""

from __future__ import annotations

import anyio
import pytest

from engine import Engine, FinishReason, SamplingParams
from helpers import DEADLINE, small_config

PROMPT = [5, 17, 42, 99, 3]
BACKENDS = ["asyncio", "trio"]


class BodyError(Exception):
    """What the body of `async with Engine(...)` raises."""


class TestTheBodysException:
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_comes_out_unwrapped(self, backend):
        """`except BodyError:` around the block catches the body's exception itself (no ExceptionGroup); the
        request in flight was finished with SHUTDOWN and released first (the conftest checks the pools)."""
        engine = Engine(small_config())
        outputs: list = []

        async def main() -> BodyError | None:
            try:
                async with engine:
                    stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True))
                    outputs.append(await stream.__anext__())
                    raise BodyError("from the body")
            except BodyError as exc:
                outputs.extend([output async for output in stream])
                return exc
            return None

        caught = anyio.run(main, backend=backend)
        assert isinstance(caught, BodyError) and str(caught) == "from the body"
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.SHUTDOWN
        assert not engine.running and engine.idle

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_a_cancelled_body_leaves_cleanly(self, backend):
        """A body cancelled by an enclosing scope leaves `async with` through that scope, nothing raised."""
        engine = Engine(small_config())

        async def main() -> bool:
            with anyio.move_on_after(0.2) as scope:
                async with engine:
                    stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True))
                    await stream.__anext__()
                    await anyio.sleep(DEADLINE)
            return scope.cancelled_caught

        assert anyio.run(main, backend=backend) is True
        assert not engine.running and engine.idle


class TestBackends:
    @pytest.mark.parametrize(("built", "entered"), [("asyncio", "trio"), ("trio", "asyncio")])
    @pytest.mark.parametrize("role", ["none", "decode"])
    def test_built_under_one_entered_under_the_other(self, built, entered, role):
        """An engine constructed inside one backend's run serves under the other: requests complete, health
        stays ok (the loop's and the prefill worker's events are made on entry)."""

        async def build() -> Engine:
            return Engine(small_config(disaggregation=role))

        engine = anyio.run(build, backend=built)

        async def serve() -> tuple:
            async with engine:
                with anyio.fail_after(DEADLINE):
                    final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
                    await engine.health_check(timeout=DEADLINE)
                    await engine.wait_idle(DEADLINE)
                return final, engine.health()

        final, health = anyio.run(serve, backend=entered)
        assert final.finish_reason is FinishReason.LENGTH and len(final.token_ids) == 4
        assert health.healthy and engine.errored is None
