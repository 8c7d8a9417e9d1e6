"""The direct path of a link (engine.disagg.link.messages): the KV received straight into
the decode's pages and sent straight from the prefill's, one message per layer, K or V
and page run. In one process over a real gloo pair (the scripted prefill of
test_disagg_link), then across processes against the staged path and the single engine."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest
import torch

from disagg_helpers import SECRET, PrefillChild, assert_child_whole, client, remote_config
from engine import Engine
from engine.disagg.decode.destination import HostRowsDestination, PagedDestination
from engine.disagg.decode.kv_transfer_hook import FirstToken
from engine.disagg.decode.remote_client import RemotePrefillClient
from engine.disagg.link.messages import chunk_pieces, cuts, run_starts, staged_views
from engine.disagg.link.settings import LinkSettings
from engine.disagg.link.transport import LinkError
from engine.disagg.link.wire import OK, PROTOCOL_VERSION, compatibility_record
from hisparse import HiSparseConfig
from helpers import small_config
import test_disagg_link as link_tests  # NOTE: as a module, so its tests are not collected here
from test_disagg_link import LAYOUT, TOKENS, _kv, _settings, _submit, _wait, transport, link_pair  # noqa: F401 - the fixtures
from test_disagg_remote import GREEDY, IMAGE, PROMPTS, SEEDED, _outputs, _page_kv, points  # noqa: F401 - the fixture

#: pages 5, 2, 3 of 4 tokens: two runs of locations, [20, 24) and [8, 16)
SPLIT = torch.cat([torch.arange(20, 24), torch.arange(8, 16)])


def _pieces(prefill, lj, index: int, kv: torch.Tensor, runs, which=slice(None)) -> None:
    """Send messages `which` of chunk `index` of `lj` (its KV `kv`), as both sides plan them."""
    chunk = lj.plan[index]
    pieces = chunk_pieces(LAYOUT, chunk, cuts(runs, lj.spec.runs))
    for view in staged_views(LAYOUT, chunk, kv.contiguous().view(torch.uint8).reshape(-1), pieces)[which]:
        prefill.pair.wait(prefill.pair.post_send_data(view.contiguous()), 5.0)


def _count_takes(staging) -> list[int]:
    """Record the sizes the link takes from staging (the real pool still serves them)."""
    taken: list[int] = []
    take = staging.take

    def counted(owner, nbytes, **kw):
        taken.append(nbytes)
        return take(owner, nbytes, **kw)

    staging.take = counted
    return taken


async def _wait_async(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await anyio.sleep(0.01)


def _landed(buffers, lj, chunks, locs) -> bool:
    return all(torch.equal(buffers.k[c.first_layer + i][locs[c.start: c.start + c.count]], kv[i, 0])
               and torch.equal(buffers.v[c.first_layer + i][locs[c.start: c.start + c.count]], kv[i, 1])
               for c, kv in zip(lj.plan, chunks) for i in range(c.num_layers))


class TestDirectLanding:
    @pytest.mark.parametrize("link_pair", [{}, {"max_chunk_bytes": 8 * LAYOUT.bytes_per_token_layer}],
                             indirect=True, ids=["layer-chunks", "token-chunks"])
    @pytest.mark.parametrize("prefill_runs", [None, [6], [2, 9]], ids=["prefill-staged", "one-cut", "two-cuts"])
    def test_pages_in_runs_land_bit_exact_without_staging(self, link_pair, prefill_runs):
        """Pages in two runs, the prefill's runs cut elsewhere (or it stages), chunks of whole layers or of 8
        tokens (a page run of 4 shorter than a message, a run across two chunks): every message lands
        straight in the pages, bit-exact, nothing is staged, and the outcome comes before the fence."""
        link, prefill, buffers, stats, staging = link_pair
        taken = _count_takes(staging)
        lj = _submit(link, buffers, "runs", locs=SPLIT, direct=True)
        _, tag, spec = prefill.recv_frame()
        assert spec.runs == run_starts(SPLIT.numpy()) == [4]
        chunks = _kv(lj.plan)
        prefill.answer(tag, OK, 42, runs=prefill_runs)
        for index, kv in enumerate(chunks):
            _pieces(prefill, lj, index, kv, prefill_runs)
        _wait(lj.job.fence.done)
        assert lj.job.outcome == ("ok", FirstToken(42)) and lj.job.fence.outcome_first
        assert _landed(buffers, lj, chunks, SPLIT) and taken == [] and staging.held == 0
        assert stats.snapshot()["bytes"] == lj.nbytes
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[SPLIT] = False
        assert all(buffers.k[i][untouched].abs().sum() == 0 for i in range(2))  # nothing outside the pages

    def test_the_decode_decides_by_memory_and_run_length(self):
        """Pages in memory the data group reaches, in long enough runs, are received directly; HiSparse's
        host rows always go through staging, as do runs shorter than `direct_min_run_bytes`."""
        from resources.kv_buffers import KVBuffers
        buffers = KVBuffers(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8,
                            dtype=torch.float32, device="cpu")

        def runs(destination, **settings):
            probe = RemotePrefillClient.__new__(RemotePrefillClient)
            probe.settings, probe.layout = LinkSettings(**settings), LAYOUT
            return probe._direct_runs(destination)

        assert runs(PagedDestination(buffers, SPLIT), direct_min_run_bytes=0) == [4]
        assert runs(PagedDestination(buffers, SPLIT), direct_min_run_bytes=7 * 64) is None  # 7 tokens of K
        rows = HostRowsDestination(None, torch.arange(TOKENS), lambda k: k, torch.device("cpu"))
        assert runs(rows, direct_min_run_bytes=0) is None


class TestGivingUpMidReceive:
    @pytest.mark.parametrize("link_pair", [{"max_chunk_bytes": 8 * LAYOUT.bytes_per_token_layer}], indirect=True)
    def test_cancel_mid_direct_receive(self, link_pair):
        """Cancelled while a chunk is being received into the pages: the fence waits for the receives
        already posted, and nothing posted after the decision writes the pages (staged and dropped)."""
        link, prefill, buffers, _, staging = link_pair
        lj = _submit(link, buffers, "cancelled", direct=True)
        _, tag, _ = prefill.recv_frame()
        chunks = _kv(lj.plan)  # layer 0 in chunks 0 and 1, layer 1 in chunks 2 and 3
        assert [(c.first_layer, c.start) for c in lj.plan] == [(0, 0), (0, 8), (1, 0), (1, 8)]
        prefill.answer(tag)
        _pieces(prefill, lj, 0, chunks[0], None, slice(0, 1))  # chunk 0's K only
        _wait(lambda: torch.equal(buffers.k[0][16:24], chunks[0][0, 0]))
        assert lj.end(None, "cancelled", "test", block=False)
        link.cancel(lj)
        time.sleep(0.05)
        assert lj.writing() and not lj.job.fence.done()  # chunk 0's V may still land
        _pieces(prefill, lj, 0, chunks[0], None, slice(1, None))
        for index in (1, 2, 3):
            _pieces(prefill, lj, index, chunks[index], None)
        prefill.ping()
        _wait(lambda: lj.job.fence.done() and not link.jobs() and staging.held == 0)
        assert isinstance(lj.job.outcome[1], Exception) and link.up
        assert torch.equal(buffers.v[0][16:24], chunks[0][0, 1])  # the write in progress completed
        assert buffers.k[1].abs().sum() == 0 and buffers.v[1].abs().sum() == 0  # posted after: never written

    @pytest.mark.parametrize("link_pair", [{"max_chunk_bytes": 8 * LAYOUT.bytes_per_token_layer}], indirect=True)
    def test_stopped_mid_direct_receive(self, link_pair):
        """The prefill stops in the middle of a chunk received into the pages: the chunk's wait ends the link
        within its bound, the fence completes only then, and what the prefill sends later lands nowhere."""
        link, prefill, buffers, stats, staging = link_pair
        lj = _submit(link, buffers, "stopped", direct=True)
        _, tag, _ = prefill.recv_frame()
        chunks = _kv(lj.plan)
        prefill.answer(tag)
        _pieces(prefill, lj, 0, chunks[0], None, slice(0, 1))
        elapsed = _wait(lj.job.fence.done)
        assert elapsed < link.settings.chunk_timeout(lj.plan[0].nbytes) + 1.0
        assert lj.job.outcome[1].cause == "timeout" and not link.up and not lj.writing()
        assert stats.snapshot()["failures"] == {"timeout": 1} and staging.held == 0
        before = [t.clone() for t in (*buffers.k, *buffers.v)]
        try:
            _pieces(prefill, lj, 0, chunks[0], None, slice(1, None))
            _pieces(prefill, lj, 1, chunks[1], None)
        except LinkError:
            pass  # the decode closed the pair
        time.sleep(0.2)
        assert all(torch.equal(a, b) for a, b in zip(before, (*buffers.k, *buffers.v)))


    @pytest.mark.parametrize("link_pair", [{"max_chunk_bytes": 8 * LAYOUT.bytes_per_token_layer}], indirect=True)
    def test_a_link_down_mid_direct_receive_moves_the_job_once_its_receives_end(self, link_pair):
        """The link goes down while a chunk is being received into the pages: the job is handed over open,
        `writing()` holds it back until the receives posted before have ended, and nothing posted after
        writes the pages."""
        link, prefill, buffers, stats, _ = link_pair
        moved: list = []
        link.failover = lambda lj, error: moved.append((lj, error))
        lj = _submit(link, buffers, "moving", direct=True)
        _, tag, _ = prefill.recv_frame()
        chunks = _kv(lj.plan)
        prefill.answer(tag)
        _pieces(prefill, lj, 0, chunks[0], None, slice(0, 1))
        _wait(lambda: torch.equal(buffers.k[0][16:24], chunks[0][0, 0]))
        link.down(LinkError("peer_closed", "test"), block=False)
        assert [m[0].job.request_id for m in moved] == ["moving"]
        assert lj.writing() and lj.job.outcome is None and not lj.job.fence.done()
        _pieces(prefill, lj, 0, chunks[0], None, slice(1, None))
        _pieces(prefill, lj, 1, chunks[1], None)
        _wait(lambda: not lj.writing())
        assert lj.job.outcome is None and not lj.done
        assert lj.successor(time.monotonic() + 1).destination is lj.destination
        assert buffers.k[1].abs().sum() == 0 and stats.snapshot()["failures"] == {}


class TestProtocolVersion:
    def test_a_protocol_3_peer_is_refused_by_name(self):
        """The run starts in the RESULT header changed every header (protocol 4): a peer on protocol 3 is
        refused at the handshake, the field named, and never gets a job."""
        record = compatibility_record(model_identity="tiny:x", layout=LAYOUT, page_size=4, backend="gloo")
        assert record["protocol"] == PROTOCOL_VERSION == 4
        result, accepted, server = link_tests.TestBootstrap()._handshake(_settings(), _settings(),
                                                                         {**record, "protocol": 3}, record)
        assert result["error"].cause == "incompatible" and "protocol 3 here, 4 there" in str(result["error"])
        assert not accepted and server.refused == {"incompatible": 1}


# ------------------------------------------------------------ across processes
DIRECT = {"direct_min_run_bytes": 0}


@pytest.fixture(scope="module")
def direct_prefill(points):  # noqa: F811 - the fixture imported above
    child = PrefillChild(points, settings={"secret": SECRET, **DIRECT})
    try:
        yield child.ready()
    finally:
        child.kill()


class TestAcrossProcesses:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("offer, used", [("auto", "socket"), ("gloo", "gloo")])
    async def test_direct_outputs_and_pages_equal_the_staged_and_single(self, direct_prefill, offer, used):
        """Both sides direct (pages in runs of 4 tokens), the chunks over the socket transport (both sides
        offer it) or gloo (the decode does not): greedy, seeded and image outputs equal the single engine's,
        the KV in the pages is bit-exact, and the decode staged nothing."""
        single, single_kv = await _outputs(small_config())
        async with Engine(remote_config(direct_prefill.address, secret=SECRET, transport=offer, **DIRECT)) as engine:
            await _wait_async(lambda: client(engine).stats.links_up() == 1)
            assert [s["transport"] for s in client(engine).stats.snapshot()["links"].values()] == [used]
            taken = _count_takes(client(engine).staging)
            direct = [(await engine.complete(p, GREEDY if i % 2 == 0 else SEEDED)).token_ids
                      for i, p in enumerate(PROMPTS)]
            direct_kv = [_page_kv(engine, p) for p in PROMPTS]
            direct.append((await engine.complete([1, 2, 3], GREEDY, mm_inputs=[IMAGE])).token_ids)
        assert direct == single and taken == []
        for got, want in zip(direct_kv, single_kv):
            assert got.numel() > 0 and torch.equal(got, want)
        assert_child_whole(await anyio.to_thread.run_sync(direct_prefill.wait_idle))

    @pytest.mark.asyncio
    async def test_hisparse_decode_stages_from_a_direct_prefill(self, direct_prefill):
        """A HiSparse decode receives into staging (its host rows are not pages) from a prefill that sends
        from its pages: health checks and a greedy request pass, both sides whole."""
        from engine.serve.server import running_server

        hisparse = HiSparseConfig(top_k=16, device_buffer_size=24, recent_window=4)
        async with Engine(small_config(hisparse=hisparse)) as single:
            want = (await single.complete(PROMPTS[2], GREEDY)).token_ids
        config = remote_config(direct_prefill.address, secret=SECRET, hisparse=hisparse, **DIRECT)
        async with Engine(config) as engine:
            taken = _count_takes(client(engine).staging)
            async with running_server(engine) as url, httpx.AsyncClient(base_url=url) as http:
                for _ in range(3):
                    assert (await http.get("/health_generate")).status_code == 200
            got = (await engine.complete(PROMPTS[2], GREEDY)).token_ids
            await engine.wait_idle(2)
            report = engine.check_memory()
        assert got == want and taken  # through staging
        assert all(s.held == 0 and s.adds_up for s in report.pools.values()), report
        assert_child_whole(await anyio.to_thread.run_sync(direct_prefill.wait_idle))

