"""A link keeps the wire busy between jobs, and a prefill server's link threads never wait on
its event loop (docs/disaggregation.md, "Wire"): the decode posts the next header's receive
before a job's last chunk is waited for (by its writing thread), the prefill posts the next job's RESULT and first chunk
before waiting for the last chunk of the job before, and `PrefillServer.call` queues calls
from other threads in order without blocking them. A real gloo pair (the scripted prefill of
test_disagg_link), and a real prefill server with a real decode engine, in one process."""

from __future__ import annotations

import asyncio
import datetime
import threading
import time

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.distributed as dist

from disagg_helpers import client, remote_config
from engine import Engine, SamplingParams
from engine.disagg import PrefillServer, PrefillServerConfig
from engine.disagg.link.transport import Pair
from engine.disagg.link.wire import OK, chunk_plan
from engine.prefill_server import soon_on_loop
from helpers import small_config
from test_disagg_link import TOKENS, _kv, _submit, _wait, transport, link_pair  # noqa: F401 - the fixtures

pytestmark = pytest.mark.anyio


class _Recorded:
    """The posts and waits of the decode's receiving thread (`events`) and of its writing thread (`writes`) on
    its pair, each in order (the real pair does them)."""

    def __init__(self, pair) -> None:
        self.events: list[str] = []
        self.writes: list[str] = []
        for name in ("post_recv_ctl", "post_each", "wait_ctl", "wait_all"):
            setattr(self, name, self._recording(name, getattr(pair, name)))
        self._pair = pair

    def _recording(self, name, fn):
        def recorded(*args, **kwargs):
            thread = threading.current_thread().name
            if thread.startswith("kvlife-recv"):
                self.events.append(name)
            elif thread.startswith("kvlife-write"):
                self.writes.append(name)
            return fn(*args, **kwargs)
        return recorded

    def __getattr__(self, name):
        return getattr(self._pair, name)


def test_the_decode_posts_the_next_header_before_waiting_for_the_last_chunk(link_pair):
    """Two jobs of two chunks each land bit-exact; between them the decode's receiving thread posted the next
    header's receive right after the last chunk's receives, and left the wait for that chunk to the writing
    thread (so it takes the next header, and posts the next job's receives, while the last chunk arrives)."""
    link, prefill, buffers, _, staging = link_pair
    recorded = _Recorded(link.pair)
    link.pair = recorded
    jobs = [_submit(link, buffers, f"r{i}", start=4 + 4 * i) for i in range(2)]
    assert all(len(lj.plan) == 2 for lj in jobs)
    for lj in jobs:
        _, tag, _ = prefill.recv_frame()
        assert tag == lj.tag
    for lj in jobs:
        chunks = _kv(lj.plan)
        prefill.answer(lj.tag, OK, 5)
        for index, kv in enumerate(chunks):
            prefill.chunk(lj, index, kv)
        _wait(lj.job.fence.done)
        assert lj.job.outcome[0] == "ok"
    events = [e for e in recorded.events if e != "wait_ctl"]
    if events[:1] == ["post_recv_ctl"]:  # the thread's first header receive, when it started after the swap
        events = events[1:]
    # per job: chunk 0's receives posted, chunk 1's, the next header's, then the wait for chunk 0; chunk 1's
    # wait is the writing thread's
    assert events == ["post_each", "post_each", "post_recv_ctl", "wait_all"] * 2, events
    assert recorded.writes == ["wait_all"] * 2, recorded.writes
    assert staging.held == 0


@pytest.mark.parametrize("direct", [True, False])
def test_a_job_lands_on_the_writing_thread(link_pair, direct):
    """Received straight into its pages or staged, a job is ended by the writing thread (once its last chunk
    has arrived, and staged chunks are copied in), never by the receiving thread. Either way it lands
    bit-exact."""
    link, prefill, buffers, _, staging = link_pair
    lj = _submit(link, buffers, "r", direct=direct)
    ended_by: list[str] = []
    complete = lj.job.fence.complete

    def recorded() -> None:
        ended_by.append(threading.current_thread().name)
        complete()

    lj.job.fence.complete = recorded
    prefill.recv_frame()
    chunks = _kv(lj.plan)
    runs = [] if direct else None
    prefill.answer(lj.tag, OK, 5, runs=runs)
    for index, kv in enumerate(chunks):
        prefill.chunk(lj, index, kv, runs=runs)
    _wait(lj.job.fence.done)
    assert lj.job.outcome[0] == "ok"
    assert ended_by and ended_by[0].startswith("kvlife-write"), ended_by
    locs = torch.arange(16, 16 + TOKENS)
    for chunk, kv in zip(lj.plan, chunks):
        for i in range(chunk.num_layers):
            assert torch.equal(buffers.k[chunk.first_layer + i][locs], kv[i, 0])
            assert torch.equal(buffers.v[chunk.first_layer + i][locs], kv[i, 1])
    assert staging.held == 0


async def test_the_prefill_posts_the_next_job_before_the_last_chunk_is_waited_for():
    """A prefill server in this process, its test points on the answering thread: the second job's first chunk
    is posted while the first job is not finished yet (its last chunk not waited for), and both land."""
    config = small_config(model="null")
    seen: dict[str, int] = {}
    server_box: list[PrefillServer] = []

    def points(point: str, rid: str, index: int) -> None:
        server = server_box[0]
        if point == "sending" and rid == "a" and index == 1:  # job b is ready before a's last chunk is posted
            deadline = time.monotonic() + 10
            while not any(sj.ready for sj in list(server.by_worker_id.values()) if sj.worker_id.startswith("b@")):
                assert time.monotonic() < deadline, "job b never got ready"
                time.sleep(0.001)
        if point == "sending" and index == 0:
            seen[rid] = server.stats.snapshot()["jobs"].get("ok", 0)  # jobs finished when this one starts

    async with PrefillServer(config, PrefillServerConfig(bootstrap_port=0), test_points=points) as server:
        server_box.append(server)
        decode = remote_config(f"127.0.0.1:{server.bootstrap_port}", max_chunk_bytes=32 << 10,
                               direct_min_run_bytes=1, fence_timeout=60.0, model="null")
        async with Engine(decode) as engine:
            await client(engine).wait_links()
            plan = chunk_plan(client(engine).layout, 40, 32 << 10)
            assert len(plan) >= 2
            params = SamplingParams(max_new_tokens=1, ignore_eos=True)
            outs: dict[str, object] = {}

            async def one(rid: str) -> None:
                outs[rid] = await engine.complete(list(range(1, 41)), params, request_id=rid)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "a")
                await anyio.sleep(0.05)
                tg.start_soon(one, "b")
            assert {rid: out.finish_reason.name for rid, out in outs.items()} == {"a": "LENGTH", "b": "LENGTH"}
        with anyio.fail_after(10):
            while not server.idle:
                await anyio.sleep(0.01)
        server.check_memory()
    assert seen == {"a": 0, "b": 0}, seen


async def test_calls_from_a_link_thread_never_wait_for_the_loop():
    """`PrefillServer.call` from another thread returns while the event loop is blocked; the calls then run on
    the loop, in order; on the loop's own thread a call runs at once."""
    async with PrefillServer(small_config(model="null"), PrefillServerConfig(bootstrap_port=0)) as server:
        ran: list[tuple[int, int]] = []
        returned = threading.Event()

        def link_thread() -> None:
            for i in range(50):
                server.call(lambda i=i: ran.append((i, threading.get_ident())))
            returned.set()

        thread = threading.Thread(target=link_thread)
        thread.start()
        assert returned.wait(10), "call() waited for the event loop"  # NOTE: the loop's thread is blocked here
        assert ran == []
        with anyio.fail_after(10):
            while len(ran) < 50:
                await anyio.sleep(0.001)
        thread.join()
        assert [i for i, _ in ran] == list(range(50))
        assert {t for _, t in ran} == {threading.get_ident()}
        server.call(lambda: ran.append((-1, 0)))
        assert ran[-1] == (-1, 0)

        # a call queued while a drain runs waits for the next one: what the drain woke runs first
        order: list[str] = []
        loop = asyncio.get_running_loop()

        def first() -> None:
            order.append("first")
            loop.call_soon(order.append, "woken")  # e.g. the runtime's task, woken by a submitted job
            late = threading.Thread(target=server.call, args=(order.append, "late"))
            late.start()
            late.join()

        queued = threading.Thread(target=lambda: [server.call(first), server.call(order.append, "second")])
        queued.start()
        queued.join()
        with anyio.fail_after(10):
            while len(order) < 4:
                await anyio.sleep(0.001)
        assert order == ["first", "second", "woken", "late"], order


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_soon_on_loop_under_each_async_library(backend):
    """The non-blocking schedule works under asyncio and trio, and refuses once the loop has ended."""
    ran: list[int] = []
    loop_thread: list[int] = []

    async def main():
        loop_thread.append(threading.get_ident())
        token = anyio.lowlevel.current_token()
        thread = threading.Thread(target=soon_on_loop, args=(token, lambda: ran.append(threading.get_ident())))
        thread.start()
        thread.join()
        with anyio.fail_after(5):
            while not ran:
                await anyio.sleep(0.001)
        return token

    token = anyio.run(main, backend=backend)
    assert ran == loop_thread
    with pytest.raises(RuntimeError):
        soon_on_loop(token, lambda: None)
    with pytest.raises(RuntimeError):
        soon_on_loop(None, lambda: None)


class _Waits:
    """A posted work whose waits are recorded (the real work does them)."""

    def __init__(self, work, index: int, log: list[int]) -> None:
        self.work, self.index, self.log = work, index, log

    def wait(self, timeout):
        self.log.append(self.index)
        return self.work.wait(timeout)


def test_a_gloo_chunk_is_waited_for_by_the_last_message_of_each_group():
    """Over gloo, `Pair.wait_all` waits only for the last control and the last data message (one socket per
    group, written and read in order: when the last has landed, every one before it has); once it returns,
    every message has landed."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    pairs: dict[int, Pair] = {}

    def build(rank: int) -> None:
        client_store = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
        pairs[rank] = Pair(client_store, "w/", rank=rank, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout=10.0)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctl_sent = [torch.full((8,), float(-i - 1)) for i in range(2)]
    ctl_got = [torch.zeros(8) for _ in range(2)]
    sent = [torch.full((1 << 18,), float(i + 1)) for i in range(3)]
    got = [torch.zeros(1 << 18) for _ in range(3)]
    order: list[int] = []
    receives = [_Waits(pairs[1].post_recv_ctl(t), i, order) for i, t in enumerate(ctl_got)]
    receives += [_Waits(pairs[1].post_recv_data(t), 2 + i, order) for i, t in enumerate(got)]
    sends = [pairs[0].post_send_ctl(t) for t in ctl_sent] + [pairs[0].post_send_data(t) for t in sent]
    pairs[1].wait_all(receives, 5.0, ctl=2)
    assert sorted(order) == [1, 4]  # the last control message and the last data message
    assert all(torch.equal(a, b) for a, b in zip(sent + ctl_sent, got + ctl_got))
    pairs[0].wait_all(sends, 5.0, ctl=2)


async def test_the_bootstrap_store_is_polled_less_once_quiet(monkeypatch):
    """Each bootstrap poll is a round trip to the store: a quiet prefill polls every IDLE_POLL, not every TICK;
    a decode that connects then still links (its handshake polled every TICK) and its requests complete."""
    from engine import prefill_server
    from engine.disagg.link.bootstrap import BootstrapServer

    monkeypatch.setattr(prefill_server, "QUIET", 0.2)
    polls: list[float] = []
    real = BootstrapServer.poll

    def counted(self):
        polls.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(BootstrapServer, "poll", counted)
    async with PrefillServer(small_config(model="null"), PrefillServerConfig(bootstrap_port=0)) as server:
        await anyio.sleep(0.5)  # past QUIET
        start = len(polls)
        await anyio.sleep(1.0)
        quiet = len(polls) - start
        assert 1 <= quiet <= 1.0 / prefill_server.IDLE_POLL + 3, quiet  # every TICK would be ~50
        decode = remote_config(f"127.0.0.1:{server.bootstrap_port}", fence_timeout=60.0, model="null")
        async with Engine(decode) as engine:
            await client(engine).wait_links(timeout=10)
            out = await engine.complete(list(range(1, 21)), SamplingParams(max_new_tokens=2, ignore_eos=True))
            assert out.finish_reason.name == "LENGTH" and len(out.token_ids) == 2
        with anyio.fail_after(10):
            while not server.idle:
                await anyio.sleep(0.01)
        server.check_memory()
