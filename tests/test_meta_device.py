"""The step path on torch's `meta` device, in CI without a GPU.

A meta tensor, like a CUDA one, refuses to be mixed with host tensors in an
op and has no data for the host to read (`.tolist()`, `.item()`, `bool()`,
`.cpu()` raise). Engines here hold every tensor of theirs on `meta` (weights,
KV buffers, the token table, HiSparse's device buffers and index keys): a
prefill chunk, decode steps, MoE layers, HiSparse's sparse steps and the
in-process decode role's transfer destination all run, and any host read or
CPU/device mix on their path fails the request (the test then sees ERROR).

The reads the design allows are the only ones that pass, because they are
replaced here: the step's one read-back (`resources.device_io.read_back`, in
the runner), HiSparse's one selection read-back per layer (in
`hisparse.attention`), and device -> host copies (`copy_to_host`: HiSparse's
host backups, one per layer). Each is counted.
"""

from __future__ import annotations

import pytest
import torch

import engine.model.runner as runner_module
import hisparse.attention as sparse_attention
import hisparse.copies as copies_module
import resources.device_io as device_io
from engine import Engine, FinishReason, SamplingParams
from engine.runtime import assembly
from hisparse import HiSparseConfig
from helpers import small_config

META = torch.device("meta")
LAYERS = 4  # the tiny models'
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


class Reads:
    """The allowed host reads, counted: fake host values shaped like the real ones."""

    def __init__(self) -> None:
        self.step: list[int] = []  # tensors per runner read-back
        self.selection = 0  # HiSparse selection read-backs
        self.copies = 0  # device -> host copies

    def fake(self, parts):
        out = []
        for p in parts:
            assert p.device == META, "a read-back of a tensor that is not on the device"
            # arange along the last dim: distinct valid token ids, expert ids and positions
            last = p.shape[-1] if p.dim() else 1
            values = torch.arange(last).expand(p.shape).clone() if p.dim() else torch.tensor(0)
            out.append(values.to(p.dtype))
        return out

    def runner(self, parts):
        self.step.append(len(parts))
        return self.fake(parts)

    def hisparse(self, parts):
        self.selection += 1
        return self.fake(parts)

    def copy(self, dst, src):
        assert src.device == META and dst.device.type == "cpu"
        self.copies += 1


@pytest.fixture
def on_meta(monkeypatch):
    """Engines built in this test hold their tensors on `meta`; the allowed reads are counted."""
    reads = Reads()
    monkeypatch.setattr(assembly, "_device", lambda config: META)
    monkeypatch.setattr(runner_module, "read_back", reads.runner)
    monkeypatch.setattr(sparse_attention, "read_back", reads.hisparse)
    monkeypatch.setattr(device_io, "copy_to_host", reads.copy)
    monkeypatch.setattr(copies_module, "copy_to_host", reads.copy)
    return reads


async def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list:
    steps: list[tuple[int, int]] = []  # (rows, tokens sampled) per step
    engine.loop.step_observers.append(lambda batch, out: steps.append((len(batch), len(out.tokens))))
    outs = []
    for prompt in prompts:
        outs.append(await engine.complete(prompt, params))
    return outs, steps


def _assert_finished(outs) -> None:
    reasons = [(o.finish_reason, o.error) for o in outs]
    assert all(reason is FinishReason.LENGTH for reason, _ in reasons), reasons
    assert all(len(o.token_ids) == PARAMS.max_new_tokens for o in outs)


class TestMetaDevice:
    @pytest.mark.asyncio
    async def test_dense_prefill_chunks_and_decode_steps(self, on_meta):
        """Chunked prefill (a 40-token prompt in 16-token chunks) and decode steps of a dense model run on
        meta, with exactly one read-back per step that samples and none in a chunk that does not."""
        async with Engine(small_config(max_prefill_tokens=16)) as engine:
            assert engine.parts.kv_buffers.k[0].device == META and engine.parts.runner.device == META
            outs, steps = await _run(engine, [list(range(1, 41)), [5, 6, 7]])
        _assert_finished(outs)
        sampling = [s for s in steps if s[1]]
        assert len(on_meta.step) == len(sampling) and all(n == 1 for n in on_meta.step)
        assert any(tokens == 0 for _, tokens in steps)  # prefill chunks that sample nothing read nothing
        assert on_meta.selection == 0 and on_meta.copies == 0

    @pytest.mark.asyncio
    async def test_sampling_and_logprobs_read_back_once(self, on_meta):
        """Seeded top-k/top-p sampling with logprobs: still one read-back per step (tokens + logprobs)."""
        params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, top_k=8, top_p=0.9, seed=1,
                                logprobs=2)
        async with Engine(small_config()) as engine:
            outs, steps = await _run(engine, [[3, 4, 5, 6]], params)
        assert outs[0].finish_reason is FinishReason.LENGTH
        assert on_meta.step == [4] * len(steps)  # tokens, chosen logprob, top values, top ids: one copy

    @pytest.mark.asyncio
    async def test_moe_steps_read_routing_back_with_the_tokens(self, on_meta):
        """MoE layers run without a host sync; each step reads its routing back with its tokens."""
        async with Engine(small_config(model="tiny-moe")) as engine:
            outs, steps = await _run(engine, [list(range(1, 20)), [9, 8, 7]])
            counts = engine.expert_distribution()
        _assert_finished(outs)
        assert on_meta.step == [2] * len(steps)  # tokens and the stacked routing
        assert int(counts.sum()) > 0  # the records were folded from the read-back routing

    @pytest.mark.asyncio
    async def test_hisparse_sparse_steps(self, on_meta):
        """HiSparse staging and sparse decode steps: one selection read-back per layer of a step with
        scored rows, one host backup copy per layer, plus the step's own read-back."""
        config = HiSparseConfig(top_k=8, device_buffer_size=12, recent_window=2, index_dim=16)
        async with Engine(small_config(hisparse=config)) as engine:
            assert engine.parts.runner.device == META
            outs, steps = await _run(engine, [list(range(1, 30))])
        _assert_finished(outs)
        decode_steps = PARAMS.max_new_tokens - 1
        assert on_meta.selection == LAYERS * decode_steps  # every decode row is scored (29 > top_k)
        assert on_meta.step == [1] * len(steps)
        assert on_meta.copies >= LAYERS * decode_steps  # staging copies + one backup per layer and step

    @pytest.mark.asyncio
    async def test_in_process_decode_role_and_its_transfer_destination(self, on_meta):
        """The decode role: the in-process prefill worker's forwards, the loopback transfer into the
        decode engine's pages, and with HiSparse the landing in host rows, all on meta."""
        async with Engine(small_config(disaggregation="decode")) as engine:
            outs, _ = await _run(engine, [list(range(1, 25)), [4, 4, 4]])
        _assert_finished(outs)
        hisparse = HiSparseConfig(top_k=8, device_buffer_size=12, recent_window=2, index_dim=16)
        async with Engine(small_config(disaggregation="decode", hisparse=hisparse)) as engine:
            outs, _ = await _run(engine, [list(range(1, 25))])
        _assert_finished(outs)
        assert on_meta.copies > 0  # the landing wrote host rows through copy_to_host
