"""HiSparse's hooks through the request machine, without the loop: staging,
preload, retraction, fenced aborts, release order, growth."""

from __future__ import annotations

import time

import pytest
import structlog
import torch

from engine.runtime.assembly import build_parts
from engine.config import SamplingParams
from engine.testing import FaultInjector
from hisparse import DEVICE_SLOTS, HOST_PAGES, SLOT_MAPS, HiSparseConfig
from resources.kv_pool import KV_PAGES
from resources.ledger import check_memory
from resources.request_slots import REQUEST_SLOTS, RequestSlotHook
from states import FinishReason, Request, RequestState
from helpers import hisparse_state, small_config

S = RequestState


def _make_parts(faults=None, **overrides):
    fields = dict(model="null", hisparse=HiSparseConfig(top_k=4, device_buffer_size=8, recent_window=1,
                                                        index_dim=8))
    fields.update(overrides)
    return build_parts(small_config(**fields), faults=faults)


def _to_staging(parts, prompt_len: int, rid: str = "r", max_new_tokens: int = 8) -> Request:
    """Admit, 'prefill' random KV into the request's pages, sample a token, enter STAGING."""
    machine = parts.machine
    request = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new_tokens))
    machine.start(request)
    machine.advance(request, S.PREFILLING)
    locs = parts.kv_pool.slots.req_to_token[RequestSlotHook.slot(request), :prompt_len]
    for layer in range(parts.model_config.num_layers):
        parts.kv_buffers.k[layer][locs] = torch.randn(prompt_len, *parts.kv_buffers.k[layer].shape[1:])
        parts.kv_buffers.v[layer][locs] = torch.randn(prompt_len, *parts.kv_buffers.v[layer].shape[1:])
    request.kv_len = prompt_len
    request.output_token_ids.append(7)
    machine.advance(request, S.PREBUILT)
    machine.advance(request, S.STAGING)
    return request


def _held(parts) -> dict[str, int]:
    return {name: s.held for name, s in check_memory(parts.pools, parts.ledger, idle=False).pools.items()}


def _release(parts, request: Request, reason: FinishReason = FinishReason.ABORT) -> None:
    parts.machine.finish(request, reason)
    assert parts.machine.try_release(request)
    check_memory(parts.pools, parts.ledger, idle=True)


class TestStaging:
    def test_prompt_kv_lands_on_host_with_index_keys(self):
        """Entering STAGING copies every prompt token's K/V to its host rows and computes its index key."""
        parts = _make_parts()
        request = _to_staging(parts, 10)
        state = hisparse_state(parts)
        record = request.handles["hisparse_host"].payload
        kv_locs = parts.kv_pool.slots.req_to_token[RequestSlotHook.slot(request), :10]
        for layer in range(parts.model_config.num_layers):
            keys = parts.kv_buffers.k[layer][kv_locs]
            assert torch.equal(state.host.kv[layer][record.locs[:10], 0], keys)
            assert torch.equal(state.host.kv[layer][record.locs[:10], 1], parts.kv_buffers.v[layer][kv_locs])
            assert torch.allclose(state.host.index[layer][record.locs[:10]], state.projection.keys(keys))
        assert record.on_host == 10 and [f.name for f in request.fences] == ["host_backup"]
        _release(parts, request)

    def test_decoding_drops_kv_pages_and_preloads_short_contexts(self):
        """STAGING -> DECODING releases KV pages and slot; a context within the buffer is preloaded."""
        parts = _make_parts()
        request = _to_staging(parts, 6)
        kv_locs = parts.kv_pool.slots.req_to_token[RequestSlotHook.slot(request), :6].clone()
        expected = parts.kv_buffers.k[2][kv_locs].clone()
        parts.machine.advance(request, S.DECODING)
        assert "kv" not in request.handles and request.kv_len == 6
        held = _held(parts)
        assert held[REQUEST_SLOTS] == 0 and held[KV_PAGES] == 0
        buffer = request.handles["hisparse_device"].payload
        assert held[DEVICE_SLOTS] == buffer.slots.numel() == 9 and held[SLOT_MAPS] == 1
        table = request.handles["hisparse_map"].payload.table
        assert table[2, :6].tolist() == list(range(6)) and table[2, 6] == -1
        assert torch.equal(hisparse_state(parts).device_pool.kv[2][buffer.slots[:6], 0], expected)
        _release(parts, request, FinishReason.STOP)

    def test_long_context_starts_empty(self):
        """A context longer than the buffer is not preloaded: every map entry is -1."""
        parts = _make_parts()
        request = _to_staging(parts, 20)
        parts.machine.advance(request, S.DECODING)
        assert (request.handles["hisparse_map"].payload.table == -1).all()
        _release(parts, request)

    def test_buffer_shrinks_for_short_requests(self):
        """A request that can never fill device_buffer_size gets only what it can use, plus one."""
        parts = _make_parts()
        request = _to_staging(parts, 3, max_new_tokens=2)
        parts.machine.advance(request, S.DECODING)
        assert _held(parts)[DEVICE_SLOTS] == 3 + 2 - 1 + 1
        _release(parts, request)


class TestRetraction:
    @pytest.mark.parametrize("state", [S.STAGING, S.DECODING])
    def test_retraction_releases_host_device_and_maps(self, state):
        """RETRACTED from STAGING or DECODING holds nothing in any HiSparse pool, nor KV."""
        parts = _make_parts()
        request = _to_staging(parts, 12)
        if state is S.DECODING:
            parts.machine.advance(request, S.DECODING)
        parts.machine.advance(request, S.RETRACTED)
        assert set(request.handles) == {"timing"}
        assert all(amount == 0 for amount in _held(parts).values())
        parts.machine.advance(request, S.QUEUED)
        _release(parts, request)


class TestFencedAbort:
    def test_abort_in_staging_waits_for_the_copy(self):
        """An abort in STAGING keeps host and KV pages until the staging fence is done, then frees them."""
        parts = _make_parts(faults=FaultInjector(stuck_fences={"host_backup"}))
        request = _to_staging(parts, 10)
        parts.machine.finish(request, FinishReason.ABORT)
        assert not parts.machine.try_release(request)
        held = _held(parts)
        assert held[HOST_PAGES] > 0 and held[KV_PAGES] > 0
        request.fences[0].complete()
        assert parts.machine.try_release(request)
        report = check_memory(parts.pools, parts.ledger, idle=True)
        assert all(s.held == 0 and s.quarantined == 0 for s in report.pools.values())

    def test_stuck_copy_quarantines_at_the_deadline(self):
        """A staging copy that never finishes quarantines host and KV pages; the leak check names, not fails."""
        parts = _make_parts(faults=FaultInjector(stuck_fences={"host_backup"}), fence_timeout=0.01)
        request = _to_staging(parts, 10)
        parts.machine.finish(request, FinishReason.ABORT)
        time.sleep(0.02)
        assert parts.machine.try_release(request)
        report = check_memory(parts.pools, parts.ledger, idle=True)
        assert report.pools[HOST_PAGES].quarantined == 3 and report.pools[KV_PAGES].quarantined == 3
        assert [o.quarantined for o in report.owners[HOST_PAGES]] == [True]

    def test_stuck_staging_never_decodes(self):
        """A request whose staging fence is pending cannot leave its KV pages for DECODING."""
        from states import FencePending

        parts = _make_parts(faults=FaultInjector(stuck_fences={"host_backup"}))
        request = _to_staging(parts, 10)
        with pytest.raises(FencePending):
            parts.machine.advance(request, S.DECODING)
        assert request.state is S.STAGING and "hisparse_device" not in request.handles
        request.fences[0].complete()
        _release(parts, request)


class TestReleaseOrder:
    def test_hisparse_hooks_precede_kv(self):
        """The release order is device slots, host pages, slot maps, staging, then KV and its slot."""
        parts = _make_parts()
        assert [h.name for h in parts.machine.hooks][:6] == ["hisparse_device", "hisparse_host", "hisparse_map",
                                                              "hisparse_staging", "kv", "request_slot"]

    @pytest.mark.parametrize(("decode", "expected"), [
        (False, ["hisparse_staging", "hisparse_host", "kv", "request_slot", "timing"]),
        (True, ["hisparse_device", "hisparse_host", "hisparse_map", "timing"]),
    ])
    def test_finish_releases_in_order(self, decode, expected):
        """Reaching RELEASED from STAGING or DECODING releases exactly what is held, HiSparse first."""
        parts = _make_parts()
        request = _to_staging(parts, 10)
        if decode:
            parts.machine.advance(request, S.DECODING)
        with structlog.testing.capture_logs() as logs:
            _release(parts, request)
        assert [e["resource"] for e in logs if e["event"] == "resource.released"] == expected


class TestGrowth:
    def test_grow_adds_host_pages_and_prunes_fences(self):
        """The machine's grow covers the next token with host pages (the only growable hook held)."""
        parts = _make_parts()
        request = _to_staging(parts, 8)
        parts.machine.advance(request, S.DECODING)
        assert "kv" not in request.handles and parts.machine.grow(request, 9)
        assert parts.ledger.holding(HOST_PAGES, request) == 3
        assert _held(parts)[HOST_PAGES] == 3
        _release(parts, request)

    def test_grow_fails_whole_when_host_is_short(self):
        """A grow the host pool cannot cover returns False and takes nothing."""
        parts = _make_parts(hisparse=HiSparseConfig(top_k=4, device_buffer_size=8, host_pool_tokens=256))
        request = _to_staging(parts, 8)
        parts.machine.advance(request, S.DECODING)
        free = hisparse_state(parts).host.allocator.num_free
        assert not parts.machine.grow(request, 8 + 4 * free + 1)
        assert hisparse_state(parts).host.allocator.num_free == free
        assert parts.machine.grow(request, 8 + 4 * free)
        _release(parts, request)



class TestCopier:
    def test_run_copies_equal_a_scatter(self):
        """The CUDA path's per-run copies write the same host rows as one index_copy_."""
        from hisparse.copies import HostCopier

        copier = HostCopier(torch.device("cpu"), fence_timeout=1.0)
        rows = torch.tensor([5, 6, 7, 20, 21, 3, 9, 10])
        src = torch.randn(8, 2, 3)
        expected = torch.zeros(32, 2, 3).index_copy_(0, rows, src)
        copier.cuda = True  # exercise the run-splitting branch on host tensors
        got = torch.zeros(32, 2, 3)
        copier.to_host(got, rows, src)
        assert torch.equal(got, expected)
