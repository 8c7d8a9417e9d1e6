"""A decode engine (this process) with a remote prefill server (a child process):
outputs and KV equal the single engine's, and the paths that do not kill the
prefill: a reported failure, an abort while TRANSFERRING, a refused peer, the
decode leaving mid-transfer, and the seed's HiSparse health-check scenario.
Dead peers: test_disagg_dead_peers.py; many prefills and decodes:
test_disagg_failover.py."""

from __future__ import annotations

import math
import time

import anyio
import httpx
import pytest
import structlog
import torch

from disagg_helpers import SECRET, PointStore, PrefillChild, assert_child_whole, client, remote_config
from engine import Engine, SamplingParams
from helpers import small_config
from hisparse import HiSparseConfig
from states import FinishReason

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_k=20, seed=7)
PROMPTS = [[9, 8, 7, 6, 5, 4, 3], list(range(100, 141)), list(range(20, 90)), list(range(150, 183))]
IMAGE = torch.full((16, 8, 3), 77, dtype=torch.uint8)


@pytest.fixture(scope="module")
def points():
    return PointStore()


@pytest.fixture(scope="module")
def prefill(points):
    child = PrefillChild(points, settings={"secret": SECRET})
    try:
        yield child.ready()
    finally:
        child.kill()


def _page_kv(engine, prompt: list[int]) -> torch.Tensor:
    """K and V of every layer at the prompt's cached whole pages."""
    kv_pool, buffers = engine.parts.kv_pool, engine.parts.kv_buffers
    pages, _ = kv_pool.radix.match(prompt)
    locs = (torch.tensor(pages).unsqueeze(1) * kv_pool.page_size + torch.arange(kv_pool.page_size)).reshape(-1)
    return torch.stack([torch.stack((buffers.k[i][locs], buffers.v[i][locs])) for i in range(len(buffers.k))])


async def _outputs(config) -> tuple[list[list[int]], list[torch.Tensor]]:
    async with Engine(config) as engine:
        outs = [(await engine.complete(p, GREEDY if i % 2 == 0 else SEEDED)).token_ids for i, p in enumerate(PROMPTS)]
        kv = [_page_kv(engine, p) for p in PROMPTS]
        image = await engine.complete([1, 2, 3], GREEDY, mm_inputs=[IMAGE])
    return outs + [image.token_ids], kv


def _decode(prefill, **overrides):
    return Engine(remote_config(prefill.address, secret=SECRET, **overrides))


class TestOutputs:
    @pytest.mark.asyncio
    async def test_remote_prefill_matches_single_engine(self, prefill):
        """Greedy, seeded and image-prompt outputs equal the single engine's; the received KV is bit-exact
        in the pages."""
        single, single_kv = await _outputs(small_config())
        remote, remote_kv = await _outputs(remote_config(prefill.address, secret=SECRET))
        assert remote == single
        for got, want in zip(remote_kv, single_kv):
            assert got.numel() > 0 and torch.equal(got, want)
        assert_child_whole(await anyio.to_thread.run_sync(prefill.wait_idle))

    @pytest.mark.asyncio
    async def test_sequences_and_logprobs_equal_the_single_engines(self, prefill):
        """Issue 18 items 1 and 2 across processes: sequence i of n = 3 equals a request seeded seed + i, and
        every token has its one logprob entry, the first one's travelling in the RESULT frame (the prefill's
        prefix cache may hold the prompt already: equal within float32 rounding)."""
        seeded = dict(max_new_tokens=6, temperature=1.0, top_k=20, seed=3, ignore_eos=True)
        greedy = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2)
        async with Engine(small_config()) as single:
            want_lp = [e for o in await _collect(single.generate(PROMPTS[1], greedy)) for e in o.logprobs or ()]
        async with _decode(prefill) as engine:
            singles = [(await engine.complete(PROMPTS[1], SamplingParams(**{**seeded, "seed": 3 + i}))).token_ids
                       for i in range(3)]
            together = {o.index: o.token_ids for o in await _collect(
                engine.generate(PROMPTS[1], SamplingParams(**seeded, n=3))) if o.finished}
            got_lp = [e for o in await _collect(engine.generate(PROMPTS[1], greedy)) for e in o.logprobs or ()]
        assert together == dict(enumerate(singles)) and len({tuple(s) for s in singles}) > 1
        assert len(got_lp) == len(want_lp) == 4 and [e.token_id for e in got_lp] == [e.token_id for e in want_lp]
        assert all(math.isclose(g.logprob, w.logprob, rel_tol=1e-4, abs_tol=1e-5) and len(g.top) == 2
                   for g, w in zip(got_lp, want_lp))
        assert_child_whole(await anyio.to_thread.run_sync(prefill.wait_idle))

    @pytest.mark.asyncio
    async def test_prefill_http_routes(self, prefill):
        """The prefill answers /health, /metrics (pools, leak checks, transfer metrics) and /debug/memory."""
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{prefill.http}") as http:
            health = await http.get("/health")
            metrics = (await http.get("/metrics")).text
            memory = (await http.get("/debug/memory")).json()
        assert health.status_code == 200 and health.json()["role"] == "prefill"
        for name in ("kvlife:pool_held{", "kvlife:leak_checks_total", "kvlife:transfer_bytes_total",
                     'kvlife:transfer_jobs_total{model_name="tiny",outcome="ok"}', "kvlife:transfer_link_up{"):
            assert name in metrics
        assert {"kv_pages", "request_slots", "transfer.staging"} <= set(memory["pools"])


class TestFailures:
    @pytest.mark.asyncio
    async def test_reported_failure(self, prefill, points):
        """The prefill reports a failed transfer: TRANSFER_FAILED at once, nothing cached, both sides whole."""
        points.set("fail/doomed")
        async with _decode(prefill) as engine:
            started = time.monotonic()
            final = await engine.complete(PROMPTS[1], GREEDY, request_id="doomed")
            elapsed = time.monotonic() - started
            await engine.wait_idle(2)
            pools = engine.check_memory().pools
            failures = client(engine).stats.snapshot()["failures"]
        assert final.finish_reason is FinishReason.TRANSFER_FAILED and final.token_ids == []
        assert "failed" in final.error and elapsed < 1.0
        assert pools["kv_pages"].evictable == 0 and failures == {"prefill_failed": 1}
        assert_child_whole(await anyio.to_thread.run_sync(prefill.wait_idle))

    @pytest.mark.asyncio
    async def test_abort_while_transferring(self, prefill, points):
        """An abort while the prefill computes: ABORT at once, the prefill is told and releases its request."""
        points.set("hold-compute/aborted")
        async with _decode(prefill) as engine:
            stream = engine.generate(PROMPTS[2], GREEDY, request_id="aborted")
            await anyio.to_thread.run_sync(points.wait, "computing/aborted")
            waiting = engine.memory_report().as_dict()["owners"][f"transfer.jobs[{prefill.address}]"]
            assert [o["request_id"] for o in waiting] == ["aborted"]  # /debug/memory names it
            started = time.monotonic()
            assert await engine.abort("aborted")
            outputs = [o async for o in stream]
            await engine.wait_idle(2)
            elapsed = time.monotonic() - started
            stats = client(engine).stats.snapshot()
        points.set("go/aborted")  # the prefill's step ends; it finds the job cancelled
        report = await anyio.to_thread.run_sync(prefill.wait_idle)
        assert outputs[-1].finish_reason is FinishReason.ABORT and elapsed < 1.0
        assert stats["jobs"]["cancelled"] == 1 and report["transfer"]["jobs"]["cancelled"] >= 1  # it was told
        assert_child_whole(report)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("mismatch, cause, why", [
        ({"secret": "not-the-secret"}, "auth", ""),
        ({"page_size": 8}, "incompatible", "page_size 8 here, 4 there"),
        ({"kv_cache_dtype": "bfloat16"}, "incompatible", "dtype 'bfloat16' here, 'float32' there")],
        ids=["secret", "record", "kv-dtype"])
    async def test_refused_peer_never_gets_a_job(self, prefill, points, mismatch, cause, why):
        """A wrong secret or a mismatched compatibility record (a page size, or the KV cache's dtype: the
        pages' bytes mean other values) is refused at connect time, with a clear error; no job is ever
        sent, and with every peer refusing, a request fails TRANSFER_FAILED at once."""
        rid = f"refused-{cause}-{len(why)}"
        with structlog.testing.capture_logs() as logs:
            async with Engine(remote_config(prefill.address, **{"secret": SECRET, **mismatch})) as engine:
                started = time.monotonic()
                final = await engine.complete(PROMPTS[0], GREEDY, request_id=rid)
                elapsed = time.monotonic() - started
                refused = client(engine).stats.snapshot()["refused"]
        assert final.finish_reason is FinishReason.TRANSFER_FAILED and elapsed < 1.0 and "refused" in final.error
        assert refused.get(cause, 0) >= 1 and not points.has(f"job/{rid}")
        errors = [e for e in logs if e["event"] == "transfer.refused"]
        assert errors and why in errors[0]["error"]
        report = await anyio.to_thread.run_sync(prefill.debug)
        assert report["transfer"]["refused"].get(cause, 0) >= 1
        assert_child_whole(report)

    @pytest.mark.asyncio
    async def test_decode_leaves_mid_transfer(self, prefill, points):
        """The decode shuts down between two chunks: its request ends SHUTDOWN with the pages freed; the
        prefill's send then fails, and it releases everything."""
        points.set("hold-send/leaving/1")
        config = dict(max_chunk_bytes=64 << 10, fence_timeout=30.0)
        async with _decode(prefill, **config) as engine:
            stream = engine.generate(PROMPTS[2], GREEDY, request_id="leaving")
            await anyio.to_thread.run_sync(points.wait, "sending/leaving/1")
            started = time.monotonic()
        elapsed = time.monotonic() - started
        outputs = [o async for o in stream]
        points.set("go/leaving")
        report = await anyio.to_thread.run_sync(prefill.wait_idle)
        assert outputs[-1].finish_reason is FinishReason.SHUTDOWN and elapsed < 3.0
        assert_child_whole(report)


async def _collect(stream) -> list:
    return [o async for o in stream]


class TestSeedScenario:
    @pytest.mark.asyncio
    async def test_hisparse_decode_health_checks_across_processes(self, prefill):
        """The SGLang leak, across processes: HiSparse decode + remote prefill + /health_generate."""
        from engine.serve.server import running_server

        hisparse = HiSparseConfig(top_k=16, device_buffer_size=24, recent_window=4)
        async with _decode(prefill, hisparse=hisparse) as engine:
            async with running_server(engine) as url, httpx.AsyncClient(base_url=url) as http:
                for _ in range(10):
                    assert (await http.get("/health_generate")).status_code == 200
                    await engine.wait_idle(2)
                    report = engine.check_memory()
                    assert all(s.held == 0 and s.adds_up for s in report.pools.values()), report
            finishes = engine.stats.finishes[("health_check", "LENGTH")]
        assert finishes == 10 and any(name.startswith("hisparse") for name in report.pools)
        assert_child_whole(await anyio.to_thread.run_sync(prefill.wait_idle))
