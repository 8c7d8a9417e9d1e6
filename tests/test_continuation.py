"""Token-level continuation (issue 21): a request cut after k tokens on one engine and continued on
another (prompt ids, the k tokens, the remaining budget) ends with the uninterrupted request's ids,
greedy and seeded (a seeded token is drawn from (seed, output position), so the stream resumes)."""

from __future__ import annotations

import anyio
import pytest

from engine import Engine, InvalidRequest, SamplingParams
from helpers import DEADLINE, collect, small_config

PROMPT = [5, 17, 42, 99, 3, 8, 120, 64, 33]
TOTAL = 20


async def _cut(engine: Engine, params: SamplingParams, k: int) -> list[int]:
    """The first k tokens a client received before it went away (the request is aborted)."""
    got: list[int] = []
    stream = engine.generate(PROMPT, params)
    async with stream:
        async for output in stream:
            got += output.new_token_ids
            if len(got) >= k:
                break
    return got[:k]


@pytest.mark.anyio
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=1234)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 6, 13])
async def test_continued_on_a_second_engine_equals_the_uninterrupted_request(sampling, k):
    """Cut after k tokens on engine A, continued on engine B: the same ids and text as uninterrupted."""
    params = SamplingParams(max_new_tokens=TOTAL, ignore_eos=True, **sampling)
    with anyio.fail_after(DEADLINE):
        async with Engine(small_config()) as first, Engine(small_config()) as second:
            whole = await first.complete(PROMPT, params)
            cut = await _cut(first, params, k)
            outputs = await collect(second.generate(PROMPT, SamplingParams(max_new_tokens=TOTAL - k, ignore_eos=True,
                                                                           **sampling), resume_output_ids=cut))
    final = outputs[-1]
    assert cut == whole.token_ids[:k]
    assert final.token_ids == whole.token_ids and final.text == whole.text
    assert sum(len(o.new_token_ids) for o in outputs) == TOTAL - k  # only what the second engine made is new
    new_text = "".join(o.new_text for o in outputs)  # what follows the resumed text (a character may span the cut)
    assert whole.text.endswith(new_text) and len(new_text) <= len(whole.text)


@pytest.mark.anyio
async def test_continuation_hits_the_prefix_cache():
    """Continuing where the prompt is cached computes only what is not (counted by the cache hit)."""
    params = SamplingParams(max_new_tokens=TOTAL, ignore_eos=True)
    async with Engine(small_config()) as engine:
        whole = await engine.complete(PROMPT, params)
        resumed = await engine.complete(PROMPT, SamplingParams(max_new_tokens=TOTAL - 10, ignore_eos=True),
                                        resume_output_ids=whole.token_ids[:10])
    assert resumed.token_ids == whole.token_ids
    assert resumed.num_cached_tokens >= 16  # the whole pages of prompt + 10 tokens, from the first run


class TestRefused:
    @pytest.mark.anyio
    @pytest.mark.parametrize("ids,params,field", [
        ([5, 10**9], SamplingParams(), "resume_output_ids"),
        ("abc", SamplingParams(), "resume_output_ids"),
        ([1, 2], SamplingParams(n=2), "SamplingParams.n"),
        ([1] * 240, SamplingParams(max_new_tokens=16), "prompt + resume_output_ids + max_new_tokens"),
    ])
    async def test_bad_continuations_name_the_field(self, ids, params, field):
        """Out-of-vocabulary ids, n > 1, or a total beyond max_context: InvalidRequest before anything runs."""
        async with Engine(small_config()) as engine:
            with pytest.raises(InvalidRequest) as info:
                engine.generate(PROMPT, params, resume_output_ids=ids)
            assert engine.stats.submitted == 0
        assert info.value.field == field
