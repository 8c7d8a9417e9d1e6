"""The decode role with a prefill server in another process: the constraint travels with the job,
the prefill compiles it itself and samples the first token under it; both sides end whole."""

from __future__ import annotations

import re

import anyio
import pytest

from disagg_helpers import SECRET, PointStore, PrefillChild, assert_child_whole, remote_config
from engine import Constraint, Engine, FinishReason, SamplingParams
from test_structured_lifecycle import assert_no_matcher_alive

PROMPT = list(range(10, 31))


@pytest.fixture(scope="module")
def prefill():
    child = PrefillChild(PointStore(), settings={"secret": SECRET})
    try:
        yield child.ready()
    finally:
        child.kill()


@pytest.mark.asyncio
async def test_remote_prefill_samples_the_first_token_under_the_grammar(prefill):
    """The first token ('Z', which the model does not pick freely) comes from the remote prefill; the
    outputs match; an invalid grammar is refused here before any job is sent; both sides are whole."""
    constraint = Constraint.regex("Z[a-z]{12}")
    async with Engine(remote_config(prefill.address, secret=SECRET)) as engine:
        free = await engine.complete(PROMPT, SamplingParams(max_new_tokens=2))
        outs = [await engine.complete(PROMPT, SamplingParams(max_new_tokens=20, constraint=constraint, **sampled))
                for sampled in ({}, {"temperature": 1.0, "seed": 11})]
        choice = await engine.complete([3, 4, 5], SamplingParams(max_new_tokens=8,
                                                                 constraint=Constraint.choice(["left", "right"])))
    assert free.token_ids[0] != ord("Z")
    for out in outs:
        assert out.finish_reason is FinishReason.STOP and re.fullmatch("Z[a-z]{12}", out.text), out.text
    assert choice.text in ("left", "right")
    assert_no_matcher_alive(engine)
    report = await anyio.to_thread.run_sync(prefill.wait_idle)
    assert_child_whole(report)
    assert report["pools"]["grammar_matchers"]["capacity"] > 0
