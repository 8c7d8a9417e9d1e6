"""Every path gives the same answer (issue 18, items 1 and 2).

Item 1: n > 1 equals n = 1 per sequence in every role (plain, no prefix cache,
decode, HiSparse, HiSparse + decode; the remote prefill's is in
test_disagg_remote.py), and a page nobody wrote never enters the prefix cache:
a HiSparse decode-role request takes no device KV page at all (its transfer
lands in host rows), so later requests sharing the prefix read what they would
have alone.

Item 2: exactly one logprob entry per output token on every path (plain,
decode role, HiSparse, chunked prefill, a full prefix hit, n > 1 followers,
after retraction and a re-transfer), equal across paths: bit-equal where the
computation is the same (the decode role receives the prefill's KV and its
first token's logprob bit-exact), within float32 rounding where the batch
shapes differ (a chunked or cached prefill sums in another order).
"""

from __future__ import annotations

import math

import anyio
import pytest

from engine import Engine, SamplingParams
from helpers import collect, small_config
from hisparse import HiSparseConfig
from states import RequestState

PROMPT = list(range(3, 30))  # 27 tokens: six whole pages of 4 and a tail of 3
HS = HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=2)
ROLES = {
    "plain": {},
    "no-prefix-cache": dict(prefix_cache=False),
    "decode": dict(disaggregation="decode"),
    "hisparse": dict(hisparse=HS),
    "hisparse-decode": dict(hisparse=HS, disaggregation="decode"),
}
SEEDED = dict(max_new_tokens=10, temperature=1.0, top_k=20, seed=5, ignore_eos=True)


def _by_index(outputs) -> dict[int, list[int]]:
    return {o.index: o.token_ids for o in outputs if o.finished}


class TestSequencesEqualSingles:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("role", sorted(ROLES))
    async def test_n_sequences_equal_n_single_requests(self, role):
        """Sequence i of n = 3 equals a request of its own seeded seed + i, in the same engine before and
        after (a later request sharing the prompt reads only pages someone wrote)."""
        held_device_kv: list[str] = []

        def watch(request, src, dst) -> None:
            if "kv" in request.handles and dst is RequestState.TRANSFERRING:
                held_device_kv.append(request.request_id)

        async with Engine(small_config(**ROLES[role])) as engine:
            engine.parts.machine.transition_observers.append(watch)
            before = [(await engine.complete(PROMPT, SamplingParams(**{**SEEDED, "seed": 5 + i}))).token_ids
                      for i in range(3)]
            together = _by_index(await collect(engine.generate(PROMPT, SamplingParams(**SEEDED, n=3))))
            after = [(await engine.complete(PROMPT, SamplingParams(**{**SEEDED, "seed": 5 + i}))).token_ids
                     for i in range(3)]
            greedy = await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=8, n=3, ignore_eos=True)))
            alone = (await engine.complete(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))).token_ids
        assert together == dict(enumerate(before)) and after == before
        assert len({tuple(t) for t in before}) > 1  # the seeds differ, so do the sequences
        assert all(tokens == alone for tokens in _by_index(greedy).values())
        if role == "hisparse-decode":  # its transfers land in host rows: no device KV page, ever
            assert held_device_kv == [] and engine.stats.transitions[("QUEUED", "TRANSFERRING")] > 0


def _entries(outputs) -> list:
    return [entry for out in outputs for entry in (out.logprobs or ())]


async def _logprobs(config, prompt=PROMPT, *, warm: bool = False, n: int = 1, **params):
    """(tokens, logprob entries) of each sequence of a logprobs=2 greedy request (a prompt-warming
    request first when `warm`: the next one is a full prefix hit)."""
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2, n=n, **params)
    async with Engine(config) as engine:
        if warm:
            await engine.complete(prompt, SamplingParams(max_new_tokens=1))
        outputs = await collect(engine.generate(prompt, sampling))
    return {i: ([t for o in outputs if o.index == i for t in o.new_token_ids],
                _entries([o for o in outputs if o.index == i])) for i in range(n)}


class TestOneLogprobPerToken:
    @pytest.mark.asyncio
    async def test_every_path_gives_one_entry_per_token_with_the_same_values(self):
        """Plain, decode role, HiSparse, chunked, full prefix hit, n > 1 followers, max_new_tokens=1."""
        plain = (await _logprobs(small_config()))[0]
        paths = {
            "decode": (await _logprobs(small_config(disaggregation="decode")))[0],
            "hisparse": (await _logprobs(small_config(hisparse=HiSparseConfig(top_k=40, device_buffer_size=48))))[0],
            "chunked": (await _logprobs(small_config(max_prefill_tokens=5)))[0],
            "prefix-hit": (await _logprobs(small_config(), warm=True))[0],
            **{f"n3-seq{i}": seq for i, seq in (await _logprobs(small_config(), n=3)).items()},
            **{f"decode-n3-seq{i}": seq for i, seq in
               (await _logprobs(small_config(disaggregation="decode"), n=3)).items()},
        }
        for name, (tokens, entries) in {"plain": plain, **paths}.items():
            assert len(entries) == len(tokens) == 6, name
            assert [e.token_id for e in entries] == tokens and all(len(e.top) == 2 for e in entries), name
            assert tokens == plain[0], name
            assert all(math.isclose(e.logprob, p.logprob, rel_tol=1e-4, abs_tol=1e-5)
                       for e, p in zip(entries, plain[1])), (name, entries, plain[1])
        assert [e.logprob for e in paths["decode"][1]] == [e.logprob for e in plain[1]]  # the same computation
        for role in ("none", "decode"):  # a first-token finish (max_new_tokens=1) still has its one entry
            async with Engine(small_config(disaggregation=role)) as engine:
                entries = _entries(await collect(engine.generate(PROMPT, SamplingParams(max_new_tokens=1,
                                                                                          logprobs=0))))
            assert len(entries) == 1 and entries[0].logprob == plain[1][0].logprob, role

    @pytest.mark.asyncio
    @pytest.mark.parametrize("role", ["none", "decode"])
    async def test_retraction_and_retransfer_lose_no_entry(self, role):
        """A pool too small for two requests retracts one (a decode-role request is transferred again):
        each still gets one entry per token, and the same values as in a roomy engine."""
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=0)
        async with Engine(small_config(disaggregation=role)) as roomy:
            want = _entries(await collect(roomy.generate(PROMPT[:8], params)))
        config = small_config(disaggregation=role, page_size=4, num_kv_pages=12, max_context=40)
        async with Engine(config) as tight:
            streams = [tight.generate(PROMPT[:8], params, request_id=f"s{i}") for i in range(2)]
            results = []
            async with anyio.create_task_group() as tg:
                async def one(stream) -> None:
                    results.append(await collect(stream))
                for stream in streams:
                    tg.start_soon(one, stream)
        assert tight.stats.retractions >= 1
        for outputs in results:
            entries, tokens = _entries(outputs), outputs[-1].token_ids
            assert len(entries) == len(tokens) == 24 and [e.token_id for e in entries] == tokens
            assert all(math.isclose(e.logprob, w.logprob, rel_tol=1e-4, abs_tol=1e-5) for e, w in zip(entries, want))
