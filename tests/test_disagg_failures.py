"""A prefill process that dies or stops, with a decode engine in this process:
killed while computing (and restarted on the same address: picked up as a new
epoch), killed between chunks and mid-chunk, stopped past the deadline and
resumed (nothing lands late). Each ends with TRANSFER_FAILED in a bounded time,
the decode's pools whole (conftest's check) and the surviving prefill whole."""

from __future__ import annotations

import contextlib
import signal
import time

import anyio
import pytest

from disagg_helpers import STARTUP, assert_child_whole, client, remote_config
from disagg_helpers import points, spawn  # noqa: F401 - fixtures
from engine import Engine, SamplingParams
from helpers import small_config
from states import FinishReason

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPT = list(range(30, 100))  # 70 tokens
#: several chunks per job: 16 KiB per layer of 70 tokens -> 5 chunks per layer
CHUNKED = dict(max_chunk_bytes=16 << 10, chunk_slack=0.2, fence_timeout=30.0)
#: one 32 MiB chunk, for a kill a few ms after the send starts (the null model: no compute, same shapes)
BIG = dict(model="null", page_size=16, num_kv_pages=600, max_context=8208, max_prefill_tokens=8192)
BIG_PROMPT = [7] * 8192


async def _reference(prompt, **engine) -> list[int]:
    async with Engine(small_config(**engine)) as single:
        return (await single.complete(prompt, GREEDY)).token_ids


#: the link's two ways: through staging, and from the prefill's pages into the decode's
PATHS = [{}, {"direct_min_run_bytes": 0}]


@contextlib.asynccontextmanager
async def _held_before_chunk_1(spawn, points, rid: str, direct: dict):
    """A prefill child and a decode engine (both `direct` or not) whose job `rid` is held before its second
    chunk (the first one landed, the second's receives posted): (child, engine, the request's stream)."""
    child = spawn(settings=direct)
    points.set(f"hold-send/{rid}/1")
    async with Engine(remote_config(child.address, **CHUNKED, **direct)) as engine:
        stream = engine.generate(PROMPT, GREEDY, request_id=rid)
        await anyio.to_thread.run_sync(points.wait, f"sending/{rid}/1")
        yield child, engine, stream


async def _fail_after(engine, stream, act) -> tuple[FinishReason, float]:
    """Run `act()` (a kill or a stop), then the stream's finish reason and how long it took after `act`."""
    started = time.monotonic()
    act()
    outputs = [o async for o in stream]
    elapsed = time.monotonic() - started
    await engine.wait_idle(2)
    return outputs[-1].finish_reason, elapsed


class TestKilled:
    @pytest.mark.asyncio
    async def test_killed_while_computing_then_restarted(self, spawn, points):
        """SIGKILL while it computes: TRANSFER_FAILED at once. A new prefill on the same address is picked up
        (epoch 2) without restarting the decode, and serves the same output as the single engine."""
        first = spawn()
        points.set("hold-compute/k1")
        async with Engine(remote_config(first.address)) as engine:
            stream = engine.generate(PROMPT, GREEDY, request_id="k1")
            await anyio.to_thread.run_sync(points.wait, "computing/k1")
            reason, elapsed = await _fail_after(engine, stream, first.kill)
            assert reason is FinishReason.TRANSFER_FAILED and elapsed < 1.5
            second = spawn(settings={"bootstrap_port": first.bootstrap})
            await client(engine).wait_links(timeout=STARTUP)
            assert client(engine).links()[first.address]["epoch"] == 2
            final = await engine.complete(PROMPT, GREEDY)
        assert final.token_ids == await _reference(PROMPT)
        assert_child_whole(await anyio.to_thread.run_sync(second.wait_idle))

    @pytest.mark.asyncio
    @pytest.mark.parametrize("direct", PATHS, ids=["staged", "direct"])
    async def test_killed_between_chunks(self, spawn, points, direct):
        """SIGKILL after the first chunk, before the second: TRANSFER_FAILED within a chunk's bound; the same
        with the KV sent from the prefill's pages and received straight into the decode's (the second
        chunk's receives already posted into the pages when the prefill dies)."""
        async with _held_before_chunk_1(spawn, points, f"k2-{len(direct)}", direct) as (child, engine, stream):
            reason, elapsed = await _fail_after(engine, stream, child.kill)
            evictable = engine.check_memory().pools["kv_pages"].evictable
        assert reason is FinishReason.TRANSFER_FAILED and elapsed < 1.5
        assert evictable == 0  # the partly written pages never entered the prefix cache

    @pytest.mark.asyncio
    async def test_killed_mid_chunk(self, spawn, points):
        """SIGKILL a few ms into sending one 32 MiB chunk: caught at the latest by the chunk's timeout."""
        child = spawn(engine=BIG)
        async with Engine(remote_config(child.address, max_chunk_bytes=48 << 20, **BIG)) as engine:
            stream = engine.generate(BIG_PROMPT, GREEDY, request_id="k3")
            await anyio.to_thread.run_sync(points.wait, "sending/k3/0")
            reason, elapsed = await _fail_after(engine, stream, child.kill)
            bound = client(engine).settings.chunk_timeout(32 << 20)
        assert reason is FinishReason.TRANSFER_FAILED and elapsed < bound + 1.0


class TestStopped:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("direct", PATHS, ids=["staged", "direct"])
    async def test_stopped_past_the_deadline_then_resumed(self, spawn, points, direct):
        """SIGSTOP between chunks: TRANSFER_FAILED once the chunk's wait runs out. After SIGCONT the prefill's
        late send lands nothing (the decode's KV buffers are unchanged, also when its receives were posted
        straight into the pages), the decode links to it again, and both sides end whole."""
        rid = f"k4-{len(direct)}"
        async with _held_before_chunk_1(spawn, points, rid, direct) as (child, engine, stream):
            reason, elapsed = await _fail_after(engine, stream, lambda: child.signal(signal.SIGSTOP))
            assert reason is FinishReason.TRANSFER_FAILED and elapsed < 2.0
            buffers = engine.parts.kv_buffers
            before = [t.clone() for t in (*buffers.k, *buffers.v)]
            points.set(f"go/{rid}")
            child.signal(signal.SIGCONT)
            report = await anyio.to_thread.run_sync(child.wait_idle)  # its late send failed; it released
            assert all(t.equal(b) for t, b in zip((*buffers.k, *buffers.v), before))
            await client(engine).wait_links(timeout=5)
            final = await engine.complete(PROMPT, GREEDY)
        assert final.token_ids == await _reference(PROMPT) and client(engine).links()[child.address]["epoch"] == 2
        assert_child_whole(report)
