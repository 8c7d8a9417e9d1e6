"""Issue 5's matrix: {single, decode role} x {HiSparse off, on} x {no images,
images} x {tiny, tiny-moe}, each engine driven through every finish path
(the prefill role's own matrix is tests/test_prefill_role.py).

Per engine: every request reaches RELEASED exactly once, a recording plugin
hook (on the decode engine and on its in-process prefill runtime) got every
lease it gave back exactly once, every pool is whole at idle (conftest checks
it too), multimodal references are back to zero, and the expert
distribution's total equals routed tokens x MoE layers x top-k over every
forward that ran (decode engine and prefill runtime).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter

import anyio
import pytest
import torch

from engine import Engine, SamplingParams
from engine.testing import FaultInjector
from helpers import abort_on_entry, collect, small_config, stream_outcome
from hisparse import HiSparseConfig
from recording_plugin import Recorders
from states import FinishReason, RequestState

S = RequestState
MATRIX = list(itertools.product(["none", "decode"], [False, True], [False, True], ["tiny", "tiny-moe"]))
IMAGE = torch.arange(16 * 16 * 3, dtype=torch.int64).remainder(251).to(torch.uint8).view(16, 16, 3)


def _config(role: str, hisparse: bool, model: str, recorders: Recorders):
    hs = HiSparseConfig(top_k=16, device_buffer_size=24, recent_window=4) if hisparse else None
    return small_config(model=model, disaggregation=role, hisparse=hs, max_context=192, max_prefill_tokens=16,
                        resources=(recorders,))


class _Watch:
    """Per request id, on both sides of the role: RELEASED count and the state it finished from; tokens per forward."""

    def __init__(self, engine: Engine) -> None:
        self.released: Counter = Counter()
        self.finished_from: dict[str, str] = {}
        self.forward_tokens = 0
        self._watch(engine.parts.machine, engine.loop.step_observers)
        prefill = engine.parts.prefill_client
        if prefill is not None:
            self._watch(prefill.machine, prefill.loop.step_observers)

    def _watch(self, machine, step_observers) -> None:
        machine.transition_observers.append(self._on_transition)
        step_observers.append(self._on_step)

    def _on_transition(self, request, src, dst) -> None:
        if dst is S.RELEASED:
            self.released[request.request_id] += 1
        elif dst is S.FINISHED:
            self.finished_from[request.request_id] = src.name

    def _on_step(self, batch, output) -> None:
        self.forward_tokens += sum(s.num_tokens for s in batch)


async def _drive_every_path(engine: Engine, role: str, images: list) -> dict[str, FinishReason]:
    prompt = list(range(10, 31))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    reasons: dict[str, FinishReason] = {}

    async def run(rid: str, p=params, disconnect_after: int | None = None, tokens=prompt) -> None:
        await stream_outcome(engine, tokens, p, rid, reasons, disconnect_after=disconnect_after, mm_inputs=images)

    free = await engine.complete(prompt, params, request_id="free-run", mm_inputs=images)
    reasons["free-run"] = free.finish_reason
    await run("error")  # alone: a failed step finishes its whole batch with ERROR
    stop_params = SamplingParams(max_new_tokens=6, stop_token_ids=[free.token_ids[2]])
    queued = engine.generate(prompt, params, request_id="abort-queued", mm_inputs=images)
    await engine.abort("abort-queued")  # applied right after the inbox is drained: QUEUED
    abort_on_entry(engine, "abort-decoding", S.DECODING)
    if role == "none":
        abort_on_entry(engine, "abort-prefilling", S.PREFILLING)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "stop", stop_params)
        tg.start_soon(run, "length-1", SamplingParams(max_new_tokens=1))
        tg.start_soon(run, "abort-decoding", SamplingParams(max_new_tokens=40, ignore_eos=True))
        tg.start_soon(run, "disconnect", SamplingParams(max_new_tokens=40, ignore_eos=True), 2)
        # a prompt of its own: not in the prefix cache, so its prefill takes several chunks
        tg.start_soon(run, "transfer-failed" if role == "decode" else "abort-prefilling", params, None,
                      list(range(40, 61)))
        tg.start_soon(run, "abort-transferring" if role == "decode" else "length-6")
        reasons["abort-queued"] = (await collect(queued))[-1].finish_reason
        assert await engine.health_check(timeout=20)
    await engine.wait_idle(20)
    return reasons


@pytest.mark.asyncio
@pytest.mark.parametrize("role,hisparse,with_images,model", MATRIX,
                         ids=[f"{r}-{'hs' if h else 'dense'}-{'img' if i else 'text'}-{m}" for r, h, i, m in MATRIX])
async def test_every_finish_path_releases_everything(role, hisparse, with_images, model):
    """Each finish path reaches RELEASED once; pools whole; no image refs; MoE totals match forwards."""
    holder: dict = {}

    def abort_while_transferring(request_id: str) -> bool:
        if request_id == "abort-transferring":  # called during the send: the request is TRANSFERRING
            holder["engine"].loop.abort(request_id)
            # the send goes on once the loop has applied the abort: else the copy may land first (a race)
            deadline = time.monotonic() + 30
            while "abort-transferring" not in holder["watch"].finished_from and time.monotonic() < deadline:
                time.sleep(0.002)
        return request_id == "transfer-failed"

    faults = FaultInjector(fail_step=lambda ids: "error" in ids, fail_transfer=abort_while_transferring)
    recorders = Recorders()
    engine = holder["engine"] = Engine(_config(role, hisparse, model, recorders), faults=faults)
    watch = holder["watch"] = _Watch(engine)
    images = [IMAGE] if with_images else []
    with anyio.fail_after(120):
        async with engine:
            reasons = await _drive_every_path(engine, role, images)
            shutdown_stream = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True),
                                              request_id="shutdown")
            await shutdown_stream.__anext__()
        reasons["shutdown"] = (await collect(shutdown_stream))[-1].finish_reason
    expected = {"free-run": FinishReason.LENGTH, "stop": FinishReason.STOP, "length-1": FinishReason.LENGTH,
                "abort-queued": FinishReason.ABORT, "abort-decoding": FinishReason.ABORT,
                "error": FinishReason.ERROR, "shutdown": FinishReason.SHUTDOWN}
    expected.update({"transfer-failed": FinishReason.TRANSFER_FAILED, "abort-transferring": FinishReason.ABORT}
                    if role == "decode" else {"abort-prefilling": FinishReason.ABORT, "length-6": FinishReason.LENGTH})
    assert {k: reasons.get(k) for k in expected} == expected
    where = {"abort-queued": "QUEUED", "length-1": "PREBUILT", "abort-decoding": "DECODING",
             "error": "DECODING" if role == "decode" else "PREFILLING"}
    where.update({"abort-transferring": "TRANSFERRING", "transfer-failed": "TRANSFERRING"} if role == "decode" else
                 {"abort-prefilling": "PREFILLING"})
    assert {k: watch.finished_from.get(k) for k in where} == where
    decode_side = {rid: n for rid, n in watch.released.items() if not rid.startswith("prefill:")}
    assert all(n == 1 for n in watch.released.values()), watch.released
    assert set(expected) | {"disconnect"} <= set(decode_side)
    recorders.assert_balanced()
    assert len(recorders.hooks) == (2 if role == "decode" else 1)  # the in-process prefill has its own
    report = engine.check_memory()
    assert report.idle
    for name, stats in report.pools.items():
        if "mm_embeddings" in name:
            assert stats.held == 0 and not report.owners[name]
    if model == "tiny-moe":
        config = engine.model_config
        assert int(engine.expert_distribution().sum()) == (
            watch.forward_tokens * config.num_layers * config.num_experts_per_tok)
