"""The finish-path matrix of a prefill-role runtime: every way a prefill request can end
(sent; cancelled while queued, while prefilling, during its last chunk; its send
failed; its step failed; a copy that lands late; shutdown with requests queued and
prefilling), with HiSparse on and off in the config (the prefill role runs without
it) and with a dense and an MoE model.

The runtime is the one the decode role runs in process (`build_local_prefill`),
fed with real `TransferJob`s whose KV lands in a real set of KV buffers (the
decode side's memory). As for the decode-role matrix: each request reaches
RELEASED exactly once, the recording plugin's every lease is given back once,
every job is answered, the runtime's own idle leak check ran clean, and every
pool is whole at the end.
"""

from __future__ import annotations

import itertools
from collections import Counter

import anyio
import pytest
import torch

from engine import Engine, SamplingParams
from engine.disagg.decode.destination import PagedDestination
from engine.disagg.decode.kv_transfer_hook import FirstToken, TransferCancelled, TransferJob
from engine.disagg.decode.transfer import TransferFailed
from engine.model.loading import load_model
from engine.runtime.assembly import build_local_prefill, resolve_device
from engine.runtime.prefill_runtime import PrefillRuntime
from engine.testing import FaultInjector
from helpers import DEADLINE, StepGate, small_config
from hisparse import HiSparseConfig
from recording_plugin import Recorders
from resources import ManualFence
from resources.kv_buffers import KVBuffers
from states import FinishReason, RequestState

S = RequestState
MATRIX = list(itertools.product([False, True], ["tiny", "tiny-moe"]))
PROMPT = list(range(10, 31))  # 21 tokens: two chunks of 16
LONG = list(range(40, 90))  # 50 tokens: four chunks
FRESH = list(range(100, 121))  # 21 tokens nobody else uses: never in the prefix cache, always two chunks
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _config(hisparse: bool, model: str, recorders: Recorders, **fields):
    hs = HiSparseConfig(top_k=16, device_buffer_size=24, recent_window=4) if hisparse else None
    return small_config(model=model, disaggregation="decode", hisparse=hs, max_context=192, max_prefill_tokens=16,
                        resources=(recorders,), **fields)


class DecodeMemory:
    """The decode side's KV buffers: each job lands at locations of its own."""

    def __init__(self, runtime: PrefillRuntime) -> None:
        mc = runtime.parts.model_config
        self.kv = KVBuffers(num_layers=mc.num_layers, num_pages=64, page_size=4, num_kv_heads=mc.num_kv_heads,
                            head_dim=mc.head_dim, dtype=runtime.parts.kv_buffers.k[0].dtype,
                            device=runtime.parts.device)
        self._next = 4  # location 0..3: the padding page

    def job(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY, images=()) -> TransferJob:
        locs = torch.arange(self._next, self._next + len(prompt), device=self.kv.k[0].device)
        self._next += len(prompt)
        fence = ManualFence("kv_transfer", {"kv"}, timeout=30.0, armed=False)
        return TransferJob(rid, list(prompt), [], params, list(images), locs, fence, 30.0,
                           destination=PagedDestination(self.kv, locs))


class Watch:
    """Per prefill request: RELEASED count, the state it finished from and why; tokens per forward."""

    def __init__(self, runtime: PrefillRuntime) -> None:
        self.released: Counter = Counter()
        self.finished: dict[str, tuple[str, FinishReason | None]] = {}
        self.forward_tokens = 0
        runtime.machine.transition_observers.append(self._on_transition)
        runtime.loop.step_observers.append(self._on_step)

    def _on_transition(self, request, src, dst) -> None:
        rid = request.request_id.removeprefix("prefill:")
        if dst is S.RELEASED:
            self.released[rid] += 1
        elif dst is S.FINISHED:
            self.finished[rid] = (src.name, request.finish_reason)

    def _on_step(self, batch, output) -> None:
        self.forward_tokens += sum(s.num_tokens for s in batch)


async def _answered(job: TransferJob) -> tuple[str, object]:
    with anyio.fail_after(DEADLINE):
        while job.outcome is None or not job.fence.done():
            await anyio.sleep(0.002)
    return job.outcome


async def _in_queue(runtime: PrefillRuntime, rid: str) -> None:
    """Wait until the job's request was handed to the runtime (submitted, not started yet)."""
    with anyio.fail_after(DEADLINE):
        while not any(r.request_id == f"prefill:{rid}" for r in runtime.loop.requests()):
            await anyio.sleep(0.002)


async def _reference(model: str, prompt: list[int]) -> int:
    async with Engine(small_config(model=model)) as single:
        return (await single.complete(prompt, SamplingParams(max_new_tokens=1))).token_ids[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("hisparse,model", MATRIX, ids=[f"{'hs' if h else 'dense'}-{m}" for h, m in MATRIX])
async def test_every_prefill_finish_path_releases_everything(hisparse, model):
    """Each prefill finish path reaches RELEASED once, answers its job, and leaves every pool whole."""
    recorders = Recorders()
    gate = StepGate(match=lambda ids: any("hold-a" in i or "hold-shutdown" in i for i in ids))
    gate.set_open(True)
    last_gate = StepGate(match=lambda ids: any("hold-last" in i for i in ids))  # closed: one chunk per permit

    def stall(ids) -> None:
        gate(ids)
        last_gate(ids)

    faults = FaultInjector(stall_step=stall, fail_step=lambda ids: any(i.endswith("error") for i in ids),
                           fail_transfer=lambda rid: rid == "send-failed")
    config = _config(hisparse, model, recorders)
    device = resolve_device(config)
    runtime = build_local_prefill(config, device=device, bundle=load_model(config, device), faults=faults)
    memory, watch = DecodeMemory(runtime), Watch(runtime)
    jobs: dict[str, TransferJob] = {}

    def submit(rid: str, prompt: list[int] = PROMPT, **kwargs) -> TransferJob:
        jobs[rid] = memory.job(rid, prompt, **kwargs)
        runtime.submit(jobs[rid])
        return jobs[rid]

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            await tg.start(runtime.run)
            sent = submit("sent", params=SamplingParams(max_new_tokens=4, logprobs=2))
            status, first = await _answered(sent)
            await _answered(submit("send-failed"))
            await _answered(submit("error", LONG))  # alone: a failed step fails its whole batch

            # cancelled while queued: the runtime is inside another job's step
            gate.set_open(False)
            submit("hold-a", LONG)
            await gate.wait_entered()
            queued = submit("cancel-queued")
            await _in_queue(runtime, "cancel-queued")
            runtime.cancel(queued)
            assert queued.outcome is not None and isinstance(queued.outcome[1], TransferCancelled)  # at once
            # cancelled while prefilling (its second chunk is held), and during its last chunk
            runtime.cancel(jobs["hold-a"])
            gate.set_open(True)  # its held chunk ends, then the cancel applies
            last_gate.allow(1)  # hold-last's first chunk passes, its second (last) is held
            last = submit("hold-last", FRESH)
            with anyio.fail_after(DEADLINE):
                while not (last_gate.passed == 1 and last_gate.waiting == 1):
                    await anyio.sleep(0.002)
            runtime.cancel(last)  # during its last chunk
            last_gate.set_open(True)
            for rid in ("hold-a", "hold-last"):
                assert isinstance((await _answered(jobs[rid]))[1], TransferCancelled)
            await runtime.loop.wait_idle(DEADLINE)
            with anyio.fail_after(DEADLINE):  # idle: the runtime's own leak check runs
                while not runtime.loop.checked_idle:
                    await anyio.sleep(0.002)
            assert runtime.loop.stats.leak_checks > 0 and runtime.loop.stats.leak_check_failures == 0

            # shutdown with a request prefilling (held) and one queued behind it
            gate.set_open(False)
            submit("hold-shutdown", LONG)
            await gate.wait_entered()
            submit("shutdown-queued")
            await _in_queue(runtime, "shutdown-queued")
            gate.open_later(0.05)
            with anyio.CancelScope(shield=True):
                await runtime.close()
            tg.cancel_scope.cancel()

    assert status == "ok" and isinstance(first, FirstToken) and first.token == await _reference(model, PROMPT)
    assert first.logprob is not None and first.logprob.token_id == first.token and len(first.logprob.top) == 2
    assert _landed(memory, runtime, sent)  # bit-exact in the decode's memory
    outcomes = {rid: job.outcome for rid, job in jobs.items()}
    assert all(o is not None and (o[0] == "ok") == (rid == "sent") for rid, o in outcomes.items()), {
        rid: o for rid, o in outcomes.items() if o is None or (o[0] == "ok") != (rid == "sent")}
    assert isinstance(outcomes["send-failed"][1], TransferFailed) and isinstance(outcomes["error"][1], TransferFailed)
    assert isinstance(outcomes["hold-shutdown"][1], TransferCancelled)
    expected = {"sent": ("PREBUILT", FinishReason.LENGTH), "send-failed": ("PREBUILT", FinishReason.LENGTH),
                "error": ("PREFILLING", FinishReason.ERROR), "cancel-queued": ("QUEUED", FinishReason.ABORT),
                "hold-a": ("PREFILLING", FinishReason.ABORT), "hold-last": ("PREBUILT", FinishReason.LENGTH),
                "hold-shutdown": ("PREFILLING", FinishReason.SHUTDOWN),
                "shutdown-queued": ("QUEUED", FinishReason.SHUTDOWN)}
    assert watch.finished == expected
    assert set(watch.released) == set(expected) and all(n == 1 for n in watch.released.values()), watch.released
    recorders.assert_balanced()
    assert_runtime_whole(runtime)
    if model == "tiny-moe":
        mc = runtime.parts.model_config
        assert int(runtime.parts.expert_distribution.counts.sum()) == (
            watch.forward_tokens * mc.num_layers * mc.num_experts_per_tok)


def _landed(memory: DecodeMemory, runtime: PrefillRuntime, job: TransferJob) -> bool:
    """The decode's memory at the job's locations equals the prefill's KV of its whole prompt pages."""
    kv_pool, src = runtime.parts.kv_pool, runtime.parts.kv_buffers
    pages, _ = kv_pool.radix.match(job.prompt_token_ids)
    assert pages, "the prompt's pages are in the prefill's prefix cache"
    n = len(pages) * kv_pool.page_size
    locs = (torch.tensor(pages).unsqueeze(1) * kv_pool.page_size + torch.arange(kv_pool.page_size)).reshape(-1)
    dst = job.dst_locs[:n]
    return all(torch.equal(src.k[i][locs], memory.kv.k[i][dst]) and torch.equal(src.v[i][locs], memory.kv.v[i][dst])
               for i in range(src.num_layers))


def assert_runtime_whole(runtime: PrefillRuntime) -> None:
    """The prefill runtime idle, no table keeping anything, every pool adding up with nothing held."""
    assert runtime.idle and not runtime.loop.requests()
    sizes = {name: size for name, size in runtime.loop.table_sizes().items() if size}
    assert not sizes and not len(runtime.inbox) and not runtime.jobs_in_flight, sizes
    report = runtime.check_memory()
    for name, stats in report.pools.items():
        assert stats.adds_up and stats.held == 0, (name, stats)
