"""HiSparse attention oracles: dense-equal output when top_k covers the
context; otherwise each layer's sparse attention equals attention computed
directly from the full (host) KV over the same selected tokens, which are the
top-k by index score; and a request's device slots stay bounded at 4k tokens."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.runtime.assembly import build_parts
from resources.ledger import check_memory
from resources.request_slots import RequestSlotHook
from hisparse import DEVICE_SLOTS, HiSparseConfig
from hisparse.attention import SparseDecodeAttention, _Row
from states import FinishReason, Request, RequestState
from helpers import hisparse_state, run_all, small_config

S = RequestState
PROMPTS = [list(range(1, 30)), [5, 17, 42, 99, 3, 8, 120, 77, 31], [(7 * i) % 250 for i in range(70)]]


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per query head, in float64, from explicit K/V rows."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    logits = torch.einsum("hd,nhd->hn", q.double(), k) / q.shape[-1] ** 0.5
    return torch.einsum("hn,nhd->hd", logits.softmax(-1), v).float()


class TestDenseEquivalence:
    @pytest.mark.asyncio
    async def test_full_top_k_equals_dense_engine(self):
        """With top_k >= every context, greedy output is the dense engine's, mixed batches included."""
        async with Engine(small_config()) as dense:
            expected = await run_all(dense, PROMPTS, 20)
        config = HiSparseConfig(top_k=96, device_buffer_size=96, recent_window=4, index_dim=8)
        mixed = []
        async with Engine(small_config(hisparse=config)) as engine:
            engine.loop.step_observers.append(lambda batch, out: mixed.append(
                {s.request.state for s in batch} >= {S.PREFILLING, S.DECODING}))
            got = await run_all(engine, PROMPTS, 20)
        assert got == expected
        assert any(mixed), "no step mixed prefill rows with sparse decode rows"


class TestSparseOracle:
    @pytest.mark.asyncio
    async def test_each_layer_equals_direct_attention_over_selected(self):
        """Each layer's output is direct attention over its selection: the recent window plus the top index scores."""
        config = HiSparseConfig(top_k=8, device_buffer_size=12, recent_window=2, index_dim=16)
        async with Engine(small_config(hisparse=config)) as engine:
            state = hisparse_state(engine)
            state.trace = []
            snapshots = {}

            def snapshot(request, src, dst):
                if dst is S.FINISHED and "hisparse_host" in request.handles:
                    record = request.handles["hisparse_host"].payload
                    rows = record.locs[: record.on_host]
                    snapshots[request.request_id] = [
                        (state.host.kv[i][rows, 0].clone(), state.host.kv[i][rows, 1].clone(),
                         state.host.index[i][rows].clone()) for i in range(state.num_layers)]

            engine.parts.machine.transition_observers.append(snapshot)
            await run_all(engine, [PROMPTS[0], PROMPTS[2]], 12)
        assert state.swapped_in > 0 and len(state.trace) == 2 * 11 * state.num_layers
        projection = state.projection
        for entry in state.trace:
            keys, values, index = snapshots[entry["request_id"]][entry["layer"]]
            p, selected = entry["position"], entry["selected"]
            rows = torch.cat((selected, torch.tensor([p])))
            torch.testing.assert_close(entry["out"], _reference(entry["q"], keys[rows], values[rows]),
                                       atol=1e-4, rtol=1e-4)
            scores = index[:p] @ projection.queries(entry["q"][None])[0]
            recent = set(range(p - 2, p))
            rest = torch.tensor(sorted(set(range(p)) - recent))
            best = rest[torch.topk(scores[rest], 6).indices].tolist()
            assert set(selected.tolist()) == recent | set(best)
            torch.testing.assert_close(index[:p], projection.keys(keys[:p]))


class TestDeviceBound:
    def test_4k_context_holds_64_plus_one_slots(self):
        """At a 4k context a 64-slot buffer holds 65 device slots every step; attention equals the direct oracle."""
        config = HiSparseConfig(top_k=32, device_buffer_size=64, recent_window=4, index_dim=16,
                                host_pool_tokens=4400)
        parts = build_parts(small_config(model="null", page_size=16, num_kv_pages=280, max_running=2,
                                         max_context=4200, hisparse=config))
        state, machine = hisparse_state(parts), parts.machine
        state.trace = []
        prompt_len = 4096
        request = Request("long", [1] * prompt_len, SamplingParams(max_new_tokens=16))
        machine.start(request)
        machine.advance(request, S.PREFILLING)
        locs = parts.kv_pool.slots.req_to_token[RequestSlotHook.slot(request), :prompt_len]
        gen = torch.Generator().manual_seed(0)
        shape = (prompt_len, *parts.kv_buffers.k[0].shape[1:])
        for layer in range(state.num_layers):
            parts.kv_buffers.k[layer][locs] = torch.randn(shape, generator=gen)
            parts.kv_buffers.v[layer][locs] = torch.randn(shape, generator=gen)
        request.kv_len = prompt_len
        request.output_token_ids.append(1)
        for dst in (S.PREBUILT, S.STAGING, S.DECODING):
            machine.advance(request, dst)
        heads, head_dim = parts.model_config.num_heads, parts.model_config.head_dim
        kv_heads = parts.model_config.num_kv_heads
        for _ in range(8):
            p = request.kv_len
            assert parts.machine.grow(request, p + 1)
            backend = SparseDecodeAttention(state, [request], [p])
            for layer in range(state.num_layers):
                q = torch.randn(1, heads, head_dim, generator=gen)
                k, v = torch.randn(1, kv_heads, head_dim, generator=gen), torch.randn(1, kv_heads, head_dim,
                                                                                       generator=gen)
                out = backend.attend(layer, q, k, v)
                host_rows = request.handles["hisparse_host"].payload.locs
                rows = host_rows[torch.cat((state.trace[-1]["selected"], torch.tensor([p])))]
                torch.testing.assert_close(out[0], _reference(q[0], state.host.kv[layer][rows, 0],
                                                              state.host.kv[layer][rows, 1]), atol=1e-4, rtol=1e-4)
                assert parts.ledger.holding(DEVICE_SLOTS, request) == 65
            request.kv_len = p + 1
            request.output_token_ids.append(1)
        assert state.swapped_in >= 32 * state.num_layers
        row = _Row(request, request.kv_len, state.host.page_size)
        assert row.context_ranges is not None and len(row.context_ranges) <= 2
        query = torch.randn(state.projection.dim, generator=gen)
        in_place = backend._scores(1, row, query)
        row.context_ranges = None  # the fragmented-pool path: gather the context's index keys page-wise
        torch.testing.assert_close(backend._scores(1, row, query), in_place)
        assert state.device_bytes(request)["kv_buffer"] == 65 * state.device_pool.bytes_per_slot
        machine.finish(request, FinishReason.LENGTH)
        assert machine.try_release(request)
        report = check_memory(parts.pools, parts.ledger, idle=True)
        assert all(stats.held == 0 for stats in report.pools.values())
