"""The decode role: a prefill worker with its own pools, a real KV transfer,
transfer failures and stuck copies, and the health-check scenario that
leaked in SGLang."""

from __future__ import annotations

import anyio
import pytest
import torch

from engine import Engine, SamplingParams
from engine.testing import FaultInjector
from engine.disagg.decode.kv_transfer_hook import KVTransferHook
from helpers import DEADLINE, collect, live_request, run_all, small_config
from hisparse import HiSparseConfig
from states import FinishReason, RequestState

PROMPTS = [[9, 8, 7, 6, 5, 4, 3], list(range(100, 141))]
IMAGE = torch.full((16, 8, 3), 77, dtype=torch.uint8)


def _copy_sent(engine: Engine, request_id: str) -> bool:
    """Whether the request's KV copy was sent (its job has an outcome), or the request is past TRANSFERRING."""
    request = live_request(engine, request_id)
    if request is None or request.state is not RequestState.TRANSFERRING:
        return request is None or request.state is not RequestState.QUEUED
    return KVTransferHook.job(request).outcome is not None


async def _greedy(config, images=None) -> list[list[int]]:
    """Greedy continuations of PROMPTS, batched, in a fresh engine of this config."""
    async with Engine(config) as engine:
        return await run_all(engine, PROMPTS, 10, mm_inputs=images)


class TestOutputs:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
    async def test_decode_role_matches_single_engine(self, with_image):
        """Disaggregated greedy output equals single-engine output, with and without images."""
        images = [IMAGE] if with_image else None
        single = await _greedy(small_config(), images)
        decode = await _greedy(small_config(disaggregation="decode"), images)
        assert decode == single

    @pytest.mark.asyncio
    async def test_final_output_carries_timings(self):
        """Every final output carries queue time, time to first token and completion time."""
        async with Engine(small_config(disaggregation="decode")) as engine:
            final = await engine.complete(PROMPTS[0], SamplingParams(max_new_tokens=3))
        assert final.queue_time is not None and final.queue_time >= 0
        assert 0 <= final.time_to_first_token <= final.completion_time


class TestTransferFailures:
    @pytest.mark.asyncio
    async def test_failed_transfer_is_not_cached(self):
        """TRANSFER_FAILED: the incomplete KV never enters the prefix cache; both sides release all."""
        faults = FaultInjector(fail_transfer=lambda rid: rid == "doomed")
        async with Engine(small_config(disaggregation="decode"), faults=faults) as engine:
            final = await engine.complete(PROMPTS[1], SamplingParams(max_new_tokens=4), request_id="doomed")
            await engine.wait_idle(10)
            pools = engine.check_memory().pools
        assert final.finish_reason is FinishReason.TRANSFER_FAILED and final.token_ids == []
        assert pools["kv_pages"].evictable == 0  # nothing cached on the decode side
        assert pools["prefill.kv_pages"].held == 0

    @pytest.mark.asyncio
    async def test_stuck_copy_quarantines_instead_of_freeing(self):
        """A copy that never lands: the aborted request's pages are quarantined, never reused, and named."""
        faults = FaultInjector(stuck_fences={"kv_transfer"})
        config = small_config(disaggregation="decode", fence_timeout=0.3)
        async with Engine(config, faults=faults) as engine:
            stream = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=4), request_id="stuck")
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, stream)
                with anyio.fail_after(DEADLINE):
                    while not _copy_sent(engine, "stuck"):
                        await anyio.sleep(0.005)
                tg.cancel_scope.cancel()  # the copy never lands: cancelling the consumer aborts the request
            await engine.wait_idle(5)
            report = engine.check_memory()
        decode_pages = report.pools["kv_pages"]
        assert decode_pages.quarantined == decode_pages.held > 0
        assert report.pools["prefill.kv_pages"].quarantined > 0
        assert any(o.quarantined and o.request_id == "stuck" for o in report.owners["kv_pages"])

    @pytest.mark.asyncio
    async def test_a_late_copy_is_reaped_on_both_sides_with_no_new_request(self):
        """Issue 18 item 9: once the stuck copy lands after all, the quarantined pages of both sides come
        back while the engine stays idle (no new request passes through the prefill)."""
        faults = FaultInjector(stuck_fences={"kv_transfer"})
        config = small_config(disaggregation="decode", fence_timeout=0.2)
        async with Engine(config, faults=faults) as engine:
            final = await engine.complete(PROMPTS[1], SamplingParams(max_new_tokens=4), request_id="late")
            await engine.wait_idle(DEADLINE)
            with anyio.fail_after(DEADLINE):  # both sides' fences miss their deadline: quarantined
                while not all(engine.memory_report().pools[p].quarantined for p in ("kv_pages", "prefill.kv_pages")):
                    await anyio.sleep(0.01)
            faults.unstick()  # the late copy lands; nothing else happens
            with anyio.fail_after(5):
                while any(s.quarantined for s in engine.memory_report().pools.values()):
                    await anyio.sleep(0.01)
            report = engine.check_memory()
        assert final.finish_reason is FinishReason.TRANSFER_FAILED
        assert all(s.held == 0 for s in report.pools.values()), report.as_dict()


class TestSeedScenario:
    @pytest.mark.asyncio
    async def test_hisparse_decode_server_health_checks_do_not_leak(self):
        """The SGLang leak: decode role + HiSparse + repeated health checks -> every pool whole."""
        config = small_config(disaggregation="decode",
                              hisparse=HiSparseConfig(top_k=16, device_buffer_size=24, recent_window=4))
        async with Engine(config) as engine:
            for _ in range(20):
                assert await engine.health_check(timeout=10)
                await engine.wait_idle(10)
                report = engine.check_memory()
                assert all(s.held == 0 and s.adds_up for s in report.pools.values()), report
            finishes = engine.stats.finishes[("health_check", "LENGTH")]
        assert finishes == 20
        assert any(name.startswith("hisparse") for name in report.pools)
