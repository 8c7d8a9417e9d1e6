"""A request's grammar is a resource: every finish path with a constrained request ends with its
matcher released (pools whole, no matcher alive), in the single and the decode role, dense and
HiSparse; retraction keeps the matcher in step; the decode role's first token obeys the grammar."""

from __future__ import annotations

import itertools
import re

import anyio
import pytest

from engine import Constraint, Engine, FinishReason, SamplingParams
from engine.testing import FaultInjector
from helpers import abort_on_entry, collect, run_all, small_config
from hisparse import HiSparseConfig
from states import RequestState

S = RequestState
WORD = Constraint.regex("Z[a-z]{30}")
MATRIX = list(itertools.product(["none", "decode"], [False, True]))
PROMPT = list(range(10, 31))


def _config(role: str, hisparse: bool, **overrides):
    hs = HiSparseConfig(top_k=16, device_buffer_size=24, recent_window=4) if hisparse else None
    return small_config(disaggregation=role, hisparse=hs, max_context=192, max_prefill_tokens=16, **overrides)


def assert_no_matcher_alive(engine: Engine) -> None:
    """The grammar pools of the engine (and of its in-process prefill) hold nothing and count no live matcher."""
    pools = {name: s for name, s in engine.check_memory().pools.items() if name.endswith("grammar_matchers")}
    assert pools and all(s.held == 0 and s.free == s.capacity for s in pools.values()), pools


def _constrained(max_new_tokens: int = 40, **fields) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, constraint=WORD, **fields)


async def _drive(engine: Engine, role: str, hisparse: bool) -> dict[str, FinishReason]:
    reasons: dict[str, FinishReason] = {}

    async def run(rid: str, params: SamplingParams, disconnect_after: int | None = None, tokens=PROMPT) -> None:
        async with engine.generate(tokens, params, request_id=rid) as stream:
            async for out in stream:
                if disconnect_after is not None and len(out.token_ids) >= disconnect_after:
                    return
                if out.finished:
                    reasons[rid] = out.finish_reason
                    if out.finish_reason is FinishReason.STOP:
                        assert re.fullmatch("Z[a-z]{30}", out.text), out.text

    compiling = engine.generate(PROMPT, SamplingParams(constraint=Constraint.regex("[0-9]{4}")), request_id="abort-compiling")
    await engine.abort("abort-compiling")  # held while its grammar compiles: finished before it holds anything
    reasons["abort-compiling"] = (await collect(compiling))[-1].finish_reason
    await run("stop", _constrained())  # compiles WORD; the grammar completes
    await run("error", _constrained())  # alone: the injected step failure finishes its batch
    queued = engine.generate(PROMPT, _constrained(), request_id="abort-queued")
    await engine.abort("abort-queued")
    abort_on_entry(engine, "abort-decoding", S.DECODING)
    if hisparse:
        abort_on_entry(engine, "abort-staging", S.STAGING)
    abort_on_entry(engine, "abort-prefilling" if role == "none" else "abort-transferring",
                   S.PREFILLING if role == "none" else S.TRANSFERRING)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "length", _constrained(5))
        tg.start_soon(run, "length-1", _constrained(1))
        tg.start_soon(run, "abort-decoding", _constrained())
        if hisparse:
            tg.start_soon(run, "abort-staging", _constrained(), None, list(range(80, 101)))
        tg.start_soon(run, "disconnect", _constrained(), 3)
        tg.start_soon(run, "abort-prefilling" if role == "none" else "abort-transferring", _constrained(), None,
                      list(range(40, 75)))
        reasons["abort-queued"] = (await collect(queued))[-1].finish_reason
    await engine.wait_idle(20)
    return reasons


@pytest.mark.asyncio
@pytest.mark.parametrize("role,hisparse", MATRIX, ids=[f"{r}-{'hs' if h else 'dense'}" for r, h in MATRIX])
async def test_every_finish_path_releases_the_matcher(role, hisparse):
    """Each path ends as expected, every pool is whole and no matcher is alive, on both sides of the role."""
    engine = Engine(_config(role, hisparse), faults=FaultInjector(fail_step=lambda ids: "error" in ids))
    with anyio.fail_after(120):
        async with engine:
            reasons = await _drive(engine, role, hisparse)
            shutdown = engine.generate(PROMPT, _constrained(), request_id="shutdown")
            await shutdown.__anext__()
        reasons["shutdown"] = (await collect(shutdown))[-1].finish_reason
    aborted = "abort-prefilling" if role == "none" else "abort-transferring"
    assert reasons == ({"abort-staging": FinishReason.ABORT} if hisparse else {}) | {"abort-compiling": FinishReason.ABORT, "stop": FinishReason.STOP, "error": FinishReason.ERROR,
                       "abort-queued": FinishReason.ABORT, "length": FinishReason.LENGTH,
                       "length-1": FinishReason.LENGTH, "abort-decoding": FinishReason.ABORT,
                       aborted: FinishReason.ABORT, "shutdown": FinishReason.SHUTDOWN}
    assert engine.structured_stats.grammars.constrained >= 7
    assert_no_matcher_alive(engine)


@pytest.mark.asyncio
async def test_retraction_keeps_the_matcher_in_step():
    """Under page pressure constrained requests are retracted and requeued; their outputs equal an
    unpressured run's and match the grammar (the matcher stayed where the kept output ends)."""
    grammar = Constraint.regex("[a-z]{20}[0-9]{20}")
    prompts = [[(7 * i + j) % 250 for i in range(24)] for j in range(4)]

    async def outputs(engine: Engine) -> list[str]:
        params = SamplingParams(max_new_tokens=40, constraint=grammar)
        async with anyio.create_task_group() as tg:
            got: list = [None] * len(prompts)
            for i, p in enumerate(prompts):
                async def one(i=i, p=p) -> None:
                    got[i] = await engine.complete(p, params)
                tg.start_soon(one)
        return got

    async with Engine(small_config()) as calm:
        expected = await outputs(calm)
    async with Engine(small_config(num_kv_pages=40, max_context=128)) as engine:
        got = await outputs(engine)
        assert engine.stats.retractions > 0
    assert [o.text for o in got] == [o.text for o in expected]
    assert all(o.finish_reason is FinishReason.STOP and re.fullmatch("[a-z]{20}[0-9]{20}", o.text) for o in got)
    assert_no_matcher_alive(engine)


@pytest.mark.asyncio
async def test_decode_role_first_token_obeys_the_grammar():
    """In-process decode role: the prefill samples the first token under the grammar ('Z', which the
    model does not pick unconstrained), and the decode side's matcher takes it from there."""
    async with Engine(_config("decode", False)) as engine:
        free = await engine.complete(PROMPT, SamplingParams(max_new_tokens=4))
        out = await engine.complete(PROMPT, _constrained())
    assert free.token_ids[0] != ord("Z")
    assert out.token_ids[0] == ord("Z") and re.fullmatch("Z[a-z]{30}", out.text)
    assert_no_matcher_alive(engine)


@pytest.mark.asyncio
async def test_n_sequences_each_hold_a_matcher():
    """n = 3: one matcher per sequence, each output matches on its own, all released."""
    held = []
    async with Engine(small_config()) as engine:
        engine.parts.machine.transition_observers.append(
            lambda r, src, dst: held.append(r.request_id) if dst is S.DECODING and "grammar" in r.handles else None)
        params = SamplingParams(max_new_tokens=40, n=3, temperature=1.0, seed=5, constraint=WORD)
        finals = [o for o in await collect(engine.generate(PROMPT, params, request_id="fork")) if o.finished]
    assert sorted(held) == ["fork/0", "fork/1", "fork/2"]
    assert len({o.text for o in finals}) == 3 and all(re.fullmatch("Z[a-z]{30}", o.text) for o in finals)
    assert_no_matcher_alive(engine)


@pytest.mark.asyncio
async def test_unconstrained_requests_are_untouched():
    """Requests without a constraint hold no matcher and decode exactly as before."""
    async with Engine(small_config()) as engine:
        engine.parts.machine.transition_observers.append(
            lambda r, src, dst: pytest.fail("a matcher without a constraint") if "grammar" in r.handles else None)
        before = await run_all(engine, [PROMPT], 8)
    async with Engine(small_config()) as again:
        assert await run_all(again, [PROMPT], 8) == before


@pytest.mark.asyncio
async def test_the_constraint_starts_after_its_marker():
    """With `starts_after`, the output is free until the marker (a piece of the model's own free
    output here: three printable characters it writes), then obeys the grammar from the next token."""
    prompts = [[i, (7 * i) % 256, (13 * i) % 256] for i in range(128)]
    async with Engine(small_config(max_running=64)) as engine:
        free = await run_all(engine, prompts, 6)
        found = next(((p, out) for p, out in zip(prompts, free) if all(32 <= t < 127 for t in out[3:6])
                      and bytes(out[3:6]).decode() not in bytes(t for t in out[:5] if t < 256).decode(errors="replace")),
                     None)
        assert found is not None, "no prompt whose free output has three printable characters at 3..5"
        prompt, head = found
        marker = bytes(head[3:6]).decode()
        params = SamplingParams(max_new_tokens=30, constraint=Constraint.regex("[0-9]{4}", starts_after=marker))
        out = await engine.complete(prompt, params)
    assert out.token_ids[:6] == head and out.finish_reason is FinishReason.STOP
    assert re.fullmatch("[0-9]{4}", engine.tokenizer.decode(out.token_ids[6:]))
    assert_no_matcher_alive(engine)
