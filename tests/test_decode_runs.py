"""Decode runs (`EngineConfig.decode_steps`): several decode steps of a batch back to back.

The output is plain decoding's, token for token: greedy ids and logprobs, seeded
samples, n > 1, an MoE checkpoint (its routing record), a constrained request
beside free ones (its run stops after one step), lengths that do not divide the
run. A plugin hook holding one unit per token the KV covers records every call:
on every finish path (length, a stop token inside a run, a stop string, abort
while a run runs, a failed step inside a run, a deadline, retraction under page
pressure, client disconnect, shutdown) each request acquires and releases once
per admission, runs extended the slots through the machine, and every pool is
whole once idle. A run's one upload gives each step the tensors `decode_inputs`
would build for it. A submission, or a transfer that lands, while a run runs on
the step thread ends the run after one step. Streamed through a real server, the text is plain decoding's
and `/metrics` counts the runs. Bad settings are refused before anything is built.
"""

from __future__ import annotations

import json

import anyio
import pytest
import torch

import engine.model.runner as runner_module
import parity_models as pm
from engine import Constraint, Engine, EngineConfig, HiSparseConfig, InvalidConfig, RequestState, SamplingParams
from engine.model.batch import ScheduledSeq
from engine.model.decode_inputs import decode_inputs
from engine.model.run_inputs import RunInputs
from engine.model.step_upload import StepUpload
from engine.speculative import SpeculativeConfig
from engine.testing import FaultInjector
from helpers import (DEADLINE, StepGate, assert_pools_whole, calls_by_request, collect, crowd_paths, finish_path_faults,
                     run_all, small_config, stream_outcome)
from test_speculative_paths import ShortUnits, TokenUnits
from states import FinishReason

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42], list(range(60, 81)), [3, 3, 3, 3, 3, 3]]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 2 + [5, 6, 7]


async def _outputs(config: EngineConfig, prompts, params_list) -> tuple[list, Engine]:
    async with Engine(config) as engine:
        outs: list = [None] * len(prompts)

        async def one(i: int) -> None:
            outs[i] = await engine.complete(prompts[i], params_list[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return outs, engine


class TestSameOutput:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("steps", [2, 4, 7])
    async def test_greedy_ids_and_logprobs(self, steps):
        """Lengths that do not divide the run, logprobs on some rows: the same tokens and logprobs."""
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=lp)
                  for n, lp in [(23, None), (9, 2), (30, None), (17, 1)]]
        plain, _ = await _outputs(small_config(), PROMPTS, params)
        ran, engine = await _outputs(small_config(decode_steps=steps), PROMPTS, params)
        assert [o.token_ids for o in ran] == [o.token_ids for o in plain]
        for a, b in zip(ran, plain):
            assert [None if x is None else (x.token_id, round(x.logprob, 4)) for x in a.logprobs or []] == \
                [None if x is None else (x.token_id, round(x.logprob, 4)) for x in b.logprobs or []]
        stats = engine.stats
        assert stats.decode_runs > 0 and stats.decode_run_steps > stats.decode_runs
        assert stats.decode_run_steps <= stats.decode_runs * steps

    @pytest.mark.asyncio
    async def test_logprobs_on_every_row(self):
        """Every row asks for logprobs (the sampler needs no fields: the run's one upload serves every
        step): each token's logprob and alternatives, streamed, are plain decoding's."""
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2) for n in (13, 22)]

        async def streamed(config: EngineConfig) -> tuple[list, Engine]:
            async with Engine(config) as engine:
                got: list[list] = [[], []]

                async def one(i: int) -> None:
                    async for out in engine.generate(PROMPTS[i], params[i]):
                        got[i].extend((x.token_id, round(x.logprob, 4), [(t, round(v, 4)) for t, v in x.top])
                                      for x in out.logprobs or ())

                async with anyio.create_task_group() as tg:
                    for i in range(2):
                        tg.start_soon(one, i)
            return got, engine

        plain, _ = await streamed(small_config())
        ran, engine = await streamed(small_config(decode_steps=5))
        assert ran == plain and [len(g) for g in ran] == [13, 22]
        assert engine.stats.decode_run_steps > engine.stats.decode_runs > 0

    @pytest.mark.asyncio
    async def test_rows_stopping_inside_a_run(self):
        """Rows that stop on a token inside a run drop out of its later steps; the others keep their
        own tokens (each later step's output is read by the row's place in the run's batch)."""
        async with Engine(small_config()) as engine:
            ref = (await engine.complete(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))).token_ids
        params = [SamplingParams(max_new_tokens=30, stop_token_ids=[ref[6]]),
                  SamplingParams(max_new_tokens=40, ignore_eos=True),
                  SamplingParams(max_new_tokens=30, stop_token_ids=[ref[9]]),
                  SamplingParams(max_new_tokens=40, ignore_eos=True)]
        ran, engine = await _outputs(small_config(decode_steps=4, prefix_cache=False), [PROMPT] * 4, params)
        assert [o.token_ids for o in ran] == [ref[:7], ref, ref[:10], ref]
        assert [o.finish_reason for o in ran] == [FinishReason.STOP, FinishReason.LENGTH] * 2
        assert engine.stats.decode_runs > 0

    @pytest.mark.asyncio
    async def test_seeded_sampling_and_n(self):
        """Seeded draws are keyed by output position, so a run draws plain decoding's tokens; n = 2 too."""
        params = [SamplingParams(max_new_tokens=21, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True, n=n)
                  for s, (t, k, p, n) in enumerate([(1.0, 0, 1.0, 1), (0.6, 0, 0.9, 2), (0.3, 5, 1.0, 1),
                                                    (1.0, 3, 1.0, 2)])]
        async def sample(config: EngineConfig) -> tuple[list[dict[int, list[int]]], Engine]:
            async with Engine(config) as engine:
                finals = []
                for prompt, p in zip(PROMPTS, params):
                    outs = [o async for o in engine.generate(prompt, p)]
                    finals.append({o.index: o.token_ids for o in outs if o.finished})
            return finals, engine

        plain, _ = await sample(small_config())
        ran, engine = await sample(small_config(decode_steps=4))
        assert [len(f) for f in ran] == [1, 2, 1, 2]
        assert ran == plain and engine.stats.decode_runs > 0

    @pytest.mark.asyncio
    @pytest.mark.parametrize("family", ["qwen3_moe", "mistral"])
    async def test_checkpoints(self, tmp_path, family):
        """An MoE checkpoint (its step observer sees each step's routing for the rows still running), and
        one with a sliding window of 8 that the runs' contexts pass (each step attends its own window)."""
        pm.write_checkpoint(tmp_path, family, seed=0)
        prompts = [p[0:1] + p for p in pm.ID_PROMPTS]
        config = dict(model=str(tmp_path), max_context=128)
        plain = await _run(small_config(**config), prompts)
        async with Engine(small_config(decode_steps=3, **config)) as engine:
            routed: list[bool] = []
            engine.loop.step_observers.append(lambda rows, out: out.routing and routed.append(
                sum(s.num_tokens for s in rows) == out.routing[0].shape[0]))
            ran = await run_all(engine, prompts, pm.MAX_NEW)
        assert ran == plain and engine.stats.decode_runs > 0
        assert all(routed) and (bool(routed) if family == "qwen3_moe" else not routed)

    @pytest.mark.asyncio
    async def test_a_constrained_row_stops_the_run(self):
        """A grammar needs each token applied before its next mask: that batch runs plain steps, and
        the run's extra slots go back."""
        constrained = SamplingParams(max_new_tokens=6, constraint=Constraint.regex("[0-9]{6}"))
        free = SamplingParams(max_new_tokens=24, ignore_eos=True)
        hook = TokenUnits()
        plain, _ = await _outputs(small_config(), ["digits: ", PROMPTS[0]], [constrained, free])
        ran, engine = await _outputs(small_config(decode_steps=4, resources=[hook]), ["digits: ", PROMPTS[0]],
                                     [constrained, free])
        assert [o.token_ids for o in ran] == [o.token_ids for o in plain]
        assert bytes(ran[0].token_ids).decode().isdigit()
        assert engine.stats.decode_runs > 0  # the free request ran alone once the constrained one ended
        assert any(what == "rollback" for _, what in hook.events)
        assert hook.units.free == hook.units.capacity


class _ComparedRunInputs(RunInputs):
    """`RunInputs` whose every step is checked against what `decode_inputs` builds for it."""

    checked: list[int] = []
    runner = None

    @classmethod
    def build(cls, seqs, steps, **kwargs):
        built = super().build(seqs, steps, **kwargs)
        if built is not None:
            built.seqs = list(seqs)  # type: ignore[attr-defined]
        return built

    def step(self, ahead, ids=None):
        got = super().step(ahead, ids)
        runner, seqs = self.runner, [ScheduledSeq(s.request, s.start + ahead, 1, True) for s in self.seqs]
        factory = runner.attention_factory
        want = decode_inputs(seqs, None, upload=StepUpload(runner.device), table=runner.slots.req_to_token,
                             host_table=runner._host_table, kv=runner.kv, slot_of=runner.slot_of,
                             layer_windows=factory.layer_windows, kernel=factory.decode_kernel,
                             next_ids=None if ids is None else ids.tolist())
        for a, b in ((got[0], want[0]), (got[1], want[1])) + tuple(
                (getattr(got[2], name), getattr(want[2], name)) for name in ("_out_locs", "_windows")) + tuple(
                (getattr(got[2]._decode, name), getattr(want[2]._decode, name))
                for name in ("columns", "query_pos", "kv_lens", "equal_len", "width", "q_len")):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert got[3] is None and want[3] is None
        self.checked.append(ahead)
        return got

    __slots__ = ("seqs",)


@pytest.mark.asyncio
@pytest.mark.parametrize("host", [True, False], ids=["host-table", "device-gather"])
async def test_run_inputs_equal_each_steps_own(monkeypatch, host):
    """Every step of a run (rows of several lengths, across page boundaries): the views of the run's one
    upload equal the ids, positions, new-token locations, page table and plan `decode_inputs` builds."""
    monkeypatch.setattr(runner_module, "RunInputs", _ComparedRunInputs)
    monkeypatch.setattr(_ComparedRunInputs, "checked", [])
    prompts = [list(range(3, 3 + n)) for n in (5, 8, 13)]
    async with Engine(small_config(decode_steps=6)) as engine:
        runner = engine.parts.runner
        monkeypatch.setattr(_ComparedRunInputs, "runner", runner)
        if not host:
            runner._host_table = None  # the branch a device-resident token table takes
        ids = await run_all(engine, prompts, 17)
    checked = _ComparedRunInputs.checked
    assert checked.count(0) >= 2 and max(checked) == 5
    assert ids == await _run(small_config(), prompts, 17)


async def _run(config: EngineConfig, prompts, max_new: int = pm.MAX_NEW) -> list[list[int]]:
    async with Engine(config) as engine:
        return await run_all(engine, prompts, max_new)


@pytest.mark.asyncio
async def test_every_finish_path_gives_every_slot_back():
    """Each path: one acquire and one release per admission, runs extended, pools whole."""
    async with Engine(small_config()) as plain_engine:
        plain_ids = (await plain_engine.complete(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))).token_ids
    holder: dict = {}
    hook = TokenUnits()
    # the prefill is step 1, then runs of 4 (steps 2-5, 6-9): step 7 is inside a run
    faults = finish_path_faults(holder, abort="abort-run", error="error", at=7)
    config = small_config(decode_steps=4, resources=[hook], num_kv_pages=26, max_context=80, prefix_cache=False)
    engine = holder["engine"] = Engine(config, faults=faults)
    reasons: dict = {}
    ids: dict = {}
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)

    async def run(rid: str, params: SamplingParams, disconnect_after: int | None = None, **kwargs) -> None:
        await stream_outcome(engine, PROMPT, params, rid, reasons, disconnect_after=disconnect_after, ids=ids, **kwargs)

    with anyio.fail_after(120):
        async with engine:
            reasons["length"] = (await engine.complete(PROMPT, SamplingParams(max_new_tokens=13, ignore_eos=True),
                                                       request_id="length")).finish_reason
            await run("error", long)
            await run("abort-run", long)
            await run("deadline", long, deadline=0.3)
            text = engine.tokenizer.decode(plain_ids[5:7])
            await run("stop-string", SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[text]))
            await crowd_paths(run, long, plain_ids[6])
            await engine.wait_idle(20)
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=60, ignore_eos=True), request_id="shutdown")
            await stream.__anext__()
        reasons["shutdown"] = (await collect(stream))[-1].finish_reason
    assert ids["stop"] == plain_ids[: plain_ids.index(plain_ids[6]) + 1]
    for rid in ("retracted", "pressure", "deadline", "abort-run"):  # a prefix of plain decoding's ids
        got = ids[rid][:30]
        assert got == plain_ids[: len(got)], rid
    got = ids["stop-string"]
    assert 5 <= len(got) <= 7 and got == plain_ids[: len(got)]
    assert reasons == {"length": FinishReason.LENGTH, "error": FinishReason.ERROR, "abort-run": FinishReason.ABORT,
                       "stop": FinishReason.STOP, "stop-string": FinishReason.STOP, "retracted": FinishReason.LENGTH,
                       "pressure": FinishReason.LENGTH, "shutdown": FinishReason.SHUTDOWN,
                       "deadline": FinishReason.DEADLINE}
    assert engine.stats.retractions > 0 and engine.stats.decode_runs > 0
    calls = calls_by_request(hook.events)
    assert set(calls) == set(reasons) | {"disconnect"}
    for rid, counted in calls.items():
        assert counted["acquire"] == counted["release"] >= 1, (rid, counted)
    assert sum(c["extend"] for c in calls.values()) > 0
    assert hook.units.free == hook.units.capacity
    assert_pools_whole(engine)


@pytest.mark.asyncio
@pytest.mark.parametrize("raises", [False, True], ids=["short", "faulty"])
async def test_no_room_for_a_run_decodes_plainly(raises):
    """A per-token pool short of room for a run (or a hook whose `extend` raises) costs the run, never
    the request: plain steps, the same tokens, nobody retracted, and what grew is given back."""
    async with Engine(small_config()) as plain_engine:
        plain = (await plain_engine.complete(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True))).token_ids
    hook = ShortUnits(raises)
    async with Engine(small_config(decode_steps=4, resources=[hook])) as engine:
        out = await engine.complete(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert out.token_ids == plain and out.finish_reason is FinishReason.LENGTH
    assert engine.stats.decode_run_steps == 0 and engine.stats.retractions == 0
    assert any(what == "extend" for _, what in hook.events) and any(what == "rollback" for _, what in hook.events)
    assert hook.units.free == hook.units.capacity


@pytest.mark.asyncio
async def test_a_submission_ends_a_run_after_one_step():
    """A run on the step thread asks the loop before each later step: a request submitted while the run's
    third step is held is prefilled right after that step, not after the 13 steps left of the run."""
    gate = StepGate(match=lambda ids: "a" in ids)
    batches: list[list[str]] = []
    async with Engine(small_config(decode_steps=16), faults=FaultInjector(stall_step=gate)) as engine:
        engine.loop.step_observers.append(lambda rows, out: batches.append([s.request.request_id for s in rows]))
        gate.allow(3)  # A's prefill and its run's first two steps; the run's third is held
        first = engine.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True), request_id="a")
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, first)
            await gate.wait_held(3)
            second = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id="b")
            gate.open()
            outputs = await collect(second)
        assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert batches[:4] == [["a"]] * 4  # the prefill, then the run's three steps that ran
    assert "b" in batches[4]  # its prefill came next
    assert engine.stats.decode_runs > 0


@pytest.mark.asyncio
async def test_a_landed_transfer_ends_a_run():
    """The decode role: a request whose KV lands while another's run runs on the step thread joins the
    batch after the step in which it landed (the fence's wake ends the run), not after the whole run;
    alone, a request's runs are not cut short by anything else that goes on."""
    gate = StepGate(match=lambda ids: "a" in ids)
    batches: list[list[str]] = []
    async with Engine(small_config(decode_steps=16, disaggregation="decode"),
                      faults=FaultInjector(stall_step=gate)) as engine:
        engine.loop.step_observers.append(lambda rows, out: batches.append([s.request.request_id for s in rows]))
        gate.allow(3)  # A's run's first three steps; its fourth is held
        first = engine.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True), request_id="a")
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, first)
            await gate.wait_held(3)
            second = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id="b")
            gate.allow(1)  # the held step: B's submission ends the run after it; B is admitted, A runs again
            await gate.wait_held(4)  # A's next run's first step is held
            with anyio.fail_after(DEADLINE):
                while engine.requests_by_state().get(RequestState.TRANSFERRING) != 1 \
                        or not engine.parts.prefill_client.idle:  # B's KV has landed meanwhile
                    await anyio.sleep(0.005)
            gate.open()
            outputs = await collect(second)
        assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert batches[:4] == [["a"]] * 4  # the run's four steps: the prefill was the prefill role's
    first_b = next(i for i, rows in enumerate(batches) if "b" in rows)
    assert first_b == 5, batches[: first_b + 1]  # the held step, then B's first decode step beside A
    runs_alone = engine.stats.decode_run_steps
    assert runs_alone >= 16  # A's runs once B was done ran whole


@pytest.mark.parametrize("overrides", [dict(decode_steps=0), dict(decode_steps=65),
                                       dict(decode_steps=2, speculative=SpeculativeConfig(num_tokens=2)),
                                       dict(decode_steps=2, hisparse=HiSparseConfig(top_k=16, device_buffer_size=64))])
def test_bad_settings_are_refused(overrides):
    with pytest.raises(InvalidConfig, match="decode_steps"):
        small_config(**overrides)


@pytest.mark.asyncio
async def test_streamed_over_http_with_counters():
    """Through a real server: /v1/completions streamed with decode runs gives plain decoding's text (its
    tokens arrive in bursts, every one of them), and /metrics counts the runs and their steps."""
    from prometheus_client.parser import text_string_to_metric_families

    from http_helpers import serving

    body = {"model": "tiny", "prompt": "the runs", "max_tokens": 21, "temperature": 0, "stream": True,
            "ignore_eos": True}

    async def stream(**overrides) -> tuple[str, str, Engine]:
        async with serving(**overrides) as (engine, client):
            text = ""
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            metrics = (await client.get("/metrics")).text
        return text, metrics, engine

    plain, _, _ = await stream()
    ran, metrics, engine = await stream(decode_steps=4)
    assert ran == plain and len(ran) > 0
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    stats = engine.stats
    assert stats.decode_runs > 0 and stats.decode_run_steps > stats.decode_runs
    assert samples["kvlife:decode_runs_total"] == stats.decode_runs
    assert samples["kvlife:decode_run_steps_total"] == stats.decode_run_steps
