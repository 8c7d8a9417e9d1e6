"""The short path of plain decode steps (`engine.model.decode_inputs`) builds what the general
path builds: the same tensors for one step, on either side of a page boundary, with the token
table on the host and on the device's side of the branch; and an engine running it gives the
same tokens and logprobs as one that never takes it, while its batch changes under it (rows
finish, new requests join mid-run, sampled and logprob rows mix with greedy ones, n > 1
publishes its prompt pages); every pool whole after."""

from __future__ import annotations

import anyio
import pytest
import torch

import engine.model.runner as runner_module
from engine import Engine, RequestState, SamplingParams
from engine.model.attention import PagedAttention
from engine.model.batch import ScheduledSeq
from engine.model.decode_inputs import decode_inputs
from helpers import collect, small_config


class _Spy:
    """Counts the steps the short path took (it is the function the runner calls)."""

    def __init__(self) -> None:
        self.taken = 0

    def __call__(self, *args, **kwargs):
        result = decode_inputs(*args, **kwargs)
        self.taken += result is not None
        return result


WORKLOAD = [  # (prompt, params, submitted once the first request has this many outputs)
    (list(range(3, 20)), SamplingParams(max_new_tokens=23, ignore_eos=True), 0),
    (list(range(40, 45)), SamplingParams(max_new_tokens=9, ignore_eos=True), 0),
    (list(range(50, 61)), SamplingParams(max_new_tokens=14, temperature=0.9, top_k=12, seed=7, ignore_eos=True), 0),
    (list(range(70, 78)), SamplingParams(max_new_tokens=12, logprobs=2, ignore_eos=True), 4),
    (list(range(80, 93)), SamplingParams(max_new_tokens=10, n=2, temperature=1.0, seed=3, ignore_eos=True), 6),
    (list(range(5, 9)), SamplingParams(max_new_tokens=6, ignore_eos=True), 11),
]


async def _run(short: bool, monkeypatch) -> tuple[list, int]:
    spy = _Spy()
    monkeypatch.setattr(runner_module, "decode_inputs", spy)
    async with Engine(small_config(prefix_cache=True)) as engine:
        engine.parts.runner.short_decode = short
        results: list = [None] * len(WORKLOAD)
        first_outputs = 0
        started = anyio.Event()

        async def one(i: int) -> None:
            nonlocal first_outputs
            prompt, params, _ = WORKLOAD[i]
            outputs = []
            async for output in engine.generate(prompt, params):
                outputs.append(output)
                if i == 0:
                    first_outputs += 1
                    started.set()
            results[i] = [(o.index, o.token_ids, o.logprobs) for o in outputs if o.finished]

        async with anyio.create_task_group() as tg:
            for i, (_, _, after) in enumerate(WORKLOAD):
                while first_outputs < after:
                    await anyio.sleep(0)
                tg.start_soon(one, i)
        await engine.wait_idle(30)
        assert not engine.loop.requests()
    return results, spy.taken


class TestEngineAgrees:
    @pytest.mark.asyncio
    async def test_same_tokens_and_logprobs_with_and_without_the_short_path(self, monkeypatch):
        expected, taken_off = await _run(False, monkeypatch)
        got, taken_on = await _run(True, monkeypatch)
        assert taken_off == 0
        assert taken_on >= 10  # the plain decode steps took it (the others mix in prefill chunks)
        assert got == expected
        assert all(r for r in got)


def _decode_batch(engine: Engine) -> list[ScheduledSeq]:
    """A decode step of every running request, as the scheduler builds it."""
    requests = [r for r in engine.loop.requests() if r.state is RequestState.DECODING]
    return [ScheduledSeq(r, r.kv_len, 1, True) for r in requests]


class TestSameTensors:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("host", [True, False], ids=["host-table", "device-gather"])
    async def test_inputs_equal_the_general_paths(self, host):
        """Paused mid-decode at several lengths (either side of page boundaries), the short path's
        ids, positions, new-token locations, page table, query positions and plan equal those of
        `prepare` and `PagedAttention`."""
        async with Engine(small_config(max_running=4)) as engine:
            runner = engine.parts.runner
            prompts = [list(range(3, 3 + n)) for n in (5, 8, 13)]
            streams = [engine.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                       for p, n in zip(prompts, (16, 7, 9))]
            checked: list[int] = []  # the rows of each step checked
            async with anyio.create_task_group() as tg:
                async def watch():
                    async for _ in streams[0]:
                        seqs = _decode_batch(engine)
                        if not seqs:
                            continue
                        table = runner.slots.req_to_token
                        short = decode_inputs(seqs, None, upload=runner.upload, table=table,
                                              host_table=table.numpy() if host else None, kv=runner.kv,
                                              slot_of=runner.slot_of, layer_windows=(None, 3))
                        assert short is not None
                        ids, positions, attention, fields = short
                        got = (ids.clone(), positions.clone(), attention._out_locs.clone(),
                               attention._decode.columns.clone(), attention._decode.query_pos.clone(),
                               attention._decode.kv_lens.clone(), attention._decode.equal_len, attention._windows)
                        inputs = runner.prepare(seqs)
                        general = PagedAttention(runner.kv, inputs.meta, (None, 3))
                        want = (inputs.ids, inputs.positions, general._out_locs, general._decode.columns,
                                general._decode.query_pos, general._decode.kv_lens, general._decode.equal_len,
                                general._windows)
                        for a, b in zip(got, want):
                            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                        assert fields is None and general._prefill is None and attention._prefill is None
                        checked.append(len(seqs))

                tg.start_soon(watch)
                for stream in streams[1:]:
                    tg.start_soon(collect, stream)
            assert checked.count(1) >= 3 and sum(n > 1 for n in checked) >= 3  # one row, and several
            await engine.wait_idle(30)

    def test_not_a_plain_decode_step(self):
        """A prefill chunk, a draft row or a row that does not sample takes the general path."""
        class _R:
            prompt_token_ids = [1, 2, 3]
            output_token_ids: list[int] = []

        request = _R()
        for seq in (ScheduledSeq(request, 0, 3, True), ScheduledSeq(request, 2, 1, False),
                    ScheduledSeq(request, 2, 2, True, draft=(5,))):
            assert decode_inputs([seq], None, upload=None, table=None, host_table=None, kv=None,
                                 slot_of=lambda r: 0, layer_windows=()) is None
        row = ScheduledSeq(request, 2, 1, True)
        assert decode_inputs([row], None, upload=None, table=None, host_table=None, kv=None,
                             slot_of=lambda r: None, layer_windows=()) is None
