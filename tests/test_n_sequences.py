"""n > 1: one prompt, n sequences in one stream; the prompt is computed once and its
pages are shared through the prefix cache (owned by the machine like any handle);
every finish path ends with every pool whole (conftest), shared pages included."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from engine import Engine, FinishReason, HiSparseConfig, SamplingParams
from engine.testing import FaultInjector
from helpers import DEADLINE, collect, small_config

PROMPT = list(range(3, 30))  # 27 tokens: six whole pages of 4 and a tail of 3


def _count_prefill(engine: Engine) -> Counter:
    computed: Counter = Counter()

    def observe(batch, output):
        for s in batch:
            if s.start < s.request.num_prompt_tokens:
                computed[s.request.request_id] += s.num_tokens

    engine.loop.step_observers.append(observe)
    return computed


def _by_index(outputs) -> dict[int, list]:
    seqs: dict[int, list] = {}
    for out in outputs:
        seqs.setdefault(out.index, []).append(out)
    return seqs


class TestSharedPrompt:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache-on", "cache-off"])
    @pytest.mark.parametrize("role", ["none", "decode"])
    async def test_the_prompt_is_computed_once(self, prefix_cache, role):
        """Sequence 0 computes the whole prompt; the others only the tail past its whole pages."""
        async with Engine(small_config(prefix_cache=prefix_cache, disaggregation=role)) as engine:
            computed = _count_prefill(engine)
            want = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
            computed.clear()
            outputs = await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=6, n=3, ignore_eos=True),
                                                    request_id="three"))
        seqs = _by_index(outputs)
        assert sorted(seqs) == [0, 1, 2]
        assert all(s[-1].finished and s[-1].token_ids == want.token_ids for s in seqs.values())
        assert all(out.request_id == "three" for out in outputs)
        if role == "none":
            assert computed["three/0"] == len(PROMPT) or (prefix_cache and computed["three/0"] <= 4)
        assert computed["three/1"] <= 4 and computed["three/2"] <= 4  # the tail, never the shared pages
        assert seqs[1][-1].num_cached_tokens == seqs[2][-1].num_cached_tokens == 24

    @pytest.mark.asyncio
    async def test_seeded_sequences_differ_and_each_is_reproducible(self):
        """Sequence i of a seeded n > 1 request draws with seed + i, so the sequences differ."""
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
        async with Engine(small_config()) as engine:
            outputs = await collect(engine.generate(PROMPT, SamplingParams(
                max_new_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)))
            alone = [await engine.complete(PROMPT, SamplingParams(
                max_new_tokens=12, temperature=1.0, seed=5 + i, ignore_eos=True)) for i in range(3)]
        finals = {i: s[-1].token_ids for i, s in _by_index(outputs).items()}
        assert finals == {i: a.token_ids for i, a in enumerate(alone)}
        assert len({tuple(t) for t in finals.values()}) > 1 and params.n == 1

    @pytest.mark.asyncio
    async def test_hisparse_sequences_share_the_prompt(self):
        """With HiSparse the shared prompt pages are staged to host per sequence; outputs equal n = 1."""
        config = small_config(hisparse=HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=2))
        async with Engine(config) as engine:
            want = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
            outputs = await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=6, n=3, ignore_eos=True)))
        assert all(s[-1].token_ids == want.token_ids for s in _by_index(outputs).values())


class TestFinishPaths:
    @pytest.mark.asyncio
    async def test_abort_finishes_every_sequence(self):
        """Aborting the request id finishes all n sequences with ABORT, wherever each is."""
        async with Engine(small_config(model="null")) as engine:
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=50, n=3, ignore_eos=True), request_id="a")
            await stream.__anext__()
            assert await engine.abort("a")
            outputs = await collect(stream)
        finals = [o for o in outputs if o.finished]
        assert len(finals) == 3 and {o.finish_reason for o in finals} == {FinishReason.ABORT}

    @pytest.mark.asyncio
    async def test_a_client_that_leaves_finishes_every_sequence(self):
        """Closing the stream aborts all n sequences, and nothing stays held."""
        async with Engine(small_config(model="null")) as engine:
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=50, n=3, ignore_eos=True), request_id="d")
            await stream.__anext__()
            await stream.aclose()
            await engine.wait_idle(DEADLINE)
        assert engine.stats.finishes[("normal", "ABORT")] == 3

    @pytest.mark.asyncio
    async def test_shutdown_finishes_every_sequence(self):
        """Leaving the engine finishes the n sequences with SHUTDOWN: n final outputs, then the end."""
        async with Engine(small_config(model="null")) as engine:
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=200, n=3, ignore_eos=True))
            await stream.__anext__()
        finals = [o for o in await collect(stream) if o.finished]
        assert len(finals) == 3 and {o.finish_reason for o in finals} == {FinishReason.SHUTDOWN}

    @pytest.mark.asyncio
    async def test_a_failed_leader_leaves_the_others_to_compute(self):
        """If sequence 0 fails before its prompt is shared, the others compute it themselves and finish."""
        faults = FaultInjector(fail_step=lambda ids: "f/0" in ids)
        async with Engine(small_config(model="null"), faults=faults) as engine:
            outputs = await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=4, n=3), request_id="f"))
        reasons = {o.index: o.finish_reason for o in outputs if o.finished}
        assert reasons[0] is FinishReason.ERROR and reasons[1] is reasons[2] is FinishReason.LENGTH

    @pytest.mark.asyncio
    async def test_stop_and_length_per_sequence(self):
        """Each sequence finishes on its own: a stop string and max_new_tokens apply per sequence."""
        async with Engine(small_config()) as engine:
            want = await engine.complete(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
            stop = want.text[2:4]
            with anyio.fail_after(DEADLINE):
                outputs = await collect(engine.generate(PROMPT, SamplingParams(
                    max_new_tokens=8, n=3, ignore_eos=True, stop=[stop] if stop else [])))
        finals = [o for o in outputs if o.finished]
        assert len(finals) == 3 and len({o.finish_reason for o in finals}) == 1
        if stop:
            assert all(o.finish_reason is FinishReason.STOP and stop not in o.text for o in finals)
