"""The transport and protocol in one process: a real gloo pair between a decode
link (engine.disagg.decode.decode_link) and a scripted prefill driven by the test,
and the bootstrap handshake (secret, compatibility record)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from disagg_helpers import socket_threads  # NOTE: also sets GLOO_SOCKET_IFNAME=lo
from engine.disagg.link import bootstrap
from engine import SamplingParams
from engine.disagg.decode.decode_link import DecodeLink
from engine.disagg.decode.link_job import LinkJob
from engine.disagg.decode.kv_transfer_hook import FirstToken, TransferCancelled, TransferJob
from engine.disagg.decode.destination import PagedDestination
from engine.disagg.link.observability import TransferStats
from engine.disagg.link.settings import LinkSettings
from engine.disagg.link.staging import StagingPool
from engine.disagg.link.transport import LinkError, Pair
from engine.disagg.link.messages import chunk_pieces, cuts, staged_views
from engine.disagg.link.wire import (BYE, CANCEL, FAILED, HEADER_LEN, JOB, OK, PING, RESULT, JobSpec, KVLayout, chunk_plan,
                                decode_job, empty_header, header, job_index, result_frames)
from resources import ManualFence
from resources.kv_buffers import KVBuffers
from structlog.testing import capture_logs

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 128 B per token and layer
TOKENS = 12


class _Fence(ManualFence):
    """Records whether the job's outcome was set before the fence completed."""

    def __init__(self) -> None:
        super().__init__("kv_transfer", {"kv"}, timeout=30)
        self.job = None
        self.outcome_first: bool | None = None

    def complete(self) -> None:
        self.outcome_first = self.job.outcome is not None
        super().complete()


def _job(rid: str) -> TransferJob:
    fence = _Fence()
    job = TransferJob(rid, list(range(TOKENS)), [], SamplingParams(), [], torch.arange(TOKENS), fence, 30.0)
    fence.job = job
    return job


class ScriptedPrefill:
    """Rank 0 of the pair, sending and receiving exactly what the test says."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.batches: list[int] = []  # how many jobs each JOB message carried
        self._jobs: list[tuple[int, int, JobSpec | None]] = []  # received in a batch, not returned yet

    def recv_frame(self) -> tuple[int, int, JobSpec | None]:
        """The next message: (JOB, its tag, its spec) for each job of a JOB message in turn, else (op, tag,
        None)."""
        if self._jobs:
            return self._jobs.pop(0)
        hdr = empty_header()
        self.pair.recv_ctl(hdr, 5.0)
        op, tag = hdr[:2].tolist()
        if op != JOB:
            return op, tag, None
        index = job_index(hdr.tolist(), 1 << 30)
        frame = torch.empty(sum(n for _, n in index), dtype=torch.uint8)
        self.pair.recv_ctl(frame, 5.0)
        offset = 0
        for tag, n in index:
            self._jobs.append((JOB, tag, decode_job(frame[offset: offset + n])))
            offset += n
        self.batches.append(len(index))
        return self._jobs.pop(0)

    def answer(self, tag: int, status: int = OK, first_token: int = 42, runs: list[int] | None = None) -> None:
        """RESULT; `runs`: the prefill's run starts (it sends from its pages), None: from staging."""
        for frame in result_frames(tag, status, first_token, b"", b"", runs):
            self.pair.send_ctl(frame, 5.0)

    def chunk(self, lj: LinkJob, index: int, kv: torch.Tensor, runs: list[int] | None = None) -> None:
        """Chunk `index` of `lj` holding `kv`, in the messages both sides plan (`runs` as in `answer`)."""
        chunk = lj.plan[index]
        pieces = chunk_pieces(LAYOUT, chunk, cuts(runs, lj.spec.runs))
        for view in staged_views(LAYOUT, chunk, kv.contiguous().view(torch.uint8).reshape(-1), pieces):
            self.pair.wait(self.pair.post_send_data(view.contiguous()), 5.0)

    def ping(self) -> None:
        self.pair.send_ctl(header(PING), 5.0)


def _settings(**fields) -> LinkSettings:
    return LinkSettings(**{"keepalive": 1.0, "first_timeout": 1.0, "chunk_slack": 0.3, "connect_timeout": 5.0,
                           "max_chunk_bytes": TOKENS * LAYOUT.bytes_per_token_layer, **fields})


@pytest.fixture(params=["gloo", "socket"])
def transport(request) -> str:
    """What carries the chunks: gloo's data group, or the socket transport (engine.disagg.link.socket_transport)."""
    return request.param


@pytest.fixture
def link_pair(request, transport):
    """(decode link, scripted prefill, the decode's KV buffers, stats, staging) over a fresh pair (gloo control,
    chunks over `transport`)."""
    settings = _settings(**getattr(request, "param", {}))
    native_before = socket_threads()
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    pairs: dict[int, Pair] = {}

    def build(rank: int) -> None:  # NOTE: one store client per side: a TCPStore serializes its own calls
        client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
        pairs[rank] = Pair(client, "t/", rank=rank, host="127.0.0.1", backend="gloo", device=torch.device("cpu"),
                           timeout=10.0, transport=transport)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    buffers = KVBuffers(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                        device="cpu")
    stats = TransferStats("decode")
    staging = StagingPool("transfer.staging", 1 << 20, torch.device("cpu"))
    link = DecodeLink(peer="scripted", epoch=1, boot="b", pair=pairs[1], settings=settings, layout=LAYOUT,
                      stats=stats, staging=staging)
    link.start()
    yield link, ScriptedPrefill(pairs[0]), buffers, stats, staging
    link.down(LinkError("shutdown", "test over"))
    try:  # the prefill's goodbye lets a receiving thread still waiting go at once
        if link.alive:
            pairs[0].send_ctl(header(BYE), 0.2)
    except LinkError:
        pass  # it returned meanwhile
    assert link.join(settings.liveness_timeout + settings.chunk_slack + 1)
    assert pairs[1].transport == transport
    pairs[0].leave()  # the scripted side has no link threads: it closes at once
    # once the link's threads have returned, nothing of the pair is left open: no native thread lingers
    _wait(lambda: socket_threads() == native_before)


def _submit(link: DecodeLink, buffers: KVBuffers, rid: str, *, deadline: float = 60.0, start: int = 4,
            locs: torch.Tensor | None = None, direct: bool = False) -> LinkJob:
    """A job landing at `locs` (default: TOKENS consecutive locations from page `start`); `direct`: its
    messages are received straight into the pages (as the client decides for long runs)."""
    locs = torch.arange(start * 4, start * 4 + TOKENS) if locs is None else locs
    dest = PagedDestination(buffers, locs)
    now = time.monotonic()
    spec = JobSpec(rid, list(range(TOKENS)), {}, max_chunk_bytes=link.settings.max_chunk_bytes,
                   runs=dest.run_starts() if direct else None)
    lj = LinkJob(_job(rid), dest, chunk_plan(LAYOUT, TOKENS, link.settings.max_chunk_bytes), spec, now,
                 now + deadline)
    assert link.submit(lj)
    return lj


def _hold_writes(lj: LinkJob) -> tuple[threading.Event, threading.Event]:
    """Make the job's writes wait: (entered: a write has begun, release: let it go on)."""
    entered, release = threading.Event(), threading.Event()
    write = lj.destination.write

    def held_write(chunk, kv):
        entered.set()
        release.wait(10)
        write(chunk, kv)

    lj.destination.write = held_write
    return entered, release


def _kv(plan) -> list[torch.Tensor]:
    return [torch.randn(LAYOUT.chunk_shape(c)) for c in plan]


def _wait(predicate, timeout: float = 5.0) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "condition not reached"
        time.sleep(0.002)
    return time.monotonic() - started


class TestLanding:
    def test_kv_lands_bit_exact_outcome_before_fence(self, link_pair):
        """Chunks land bit-exact at the job's locations; the outcome is set before the fence completes."""
        link, prefill, buffers, stats, staging = link_pair
        lj = _submit(link, buffers, "r1")
        op, tag, spec = prefill.recv_frame()
        assert op == JOB and spec.request_id == "r1" and spec.token_ids == list(range(TOKENS))
        chunks = _kv(lj.plan)
        prefill.answer(tag, OK, 42)
        for index, kv in enumerate(chunks):
            prefill.chunk(lj, index, kv)
        _wait(lj.job.fence.done)
        assert lj.job.outcome == ("ok", FirstToken(42)) and lj.job.fence.outcome_first
        locs = torch.arange(16, 16 + TOKENS)
        for chunk, kv in zip(lj.plan, chunks):
            for i in range(chunk.num_layers):
                assert torch.equal(buffers.k[chunk.first_layer + i][locs], kv[i, 0])
                assert torch.equal(buffers.v[chunk.first_layer + i][locs], kv[i, 1])
        assert stats.snapshot()["bytes"] == lj.nbytes and staging.held == 0

    def test_reported_failure_fails_only_that_job(self, link_pair):
        """FAILED fails its job; the link stays up and the next job lands."""
        link, prefill, buffers, stats, _ = link_pair
        first, second = _submit(link, buffers, "bad"), _submit(link, buffers, "good", start=8)
        _, tag1, _ = prefill.recv_frame()
        _, tag2, _ = prefill.recv_frame()
        prefill.answer(tag1, FAILED)
        prefill.answer(tag2, OK, 7)
        for index, kv in enumerate(_kv(second.plan)):
            prefill.chunk(second, index, kv)
        _wait(second.job.fence.done)
        assert first.job.outcome[0] == "failed" and first.job.outcome[1].cause == "prefill_failed"
        assert second.job.outcome == ("ok", FirstToken(7)) and link.up


class TestLinkFailures:
    def test_missing_chunk_times_out_and_fails_every_job(self, link_pair):
        """A prefill that stops mid-job (the header, no chunk): the chunk's wait ends the link within its
        bound, and every job on the link fails at once."""
        link, prefill, buffers, stats, staging = link_pair
        head, queued = _submit(link, buffers, "head"), _submit(link, buffers, "queued", start=8)
        _, tag, _ = prefill.recv_frame()
        prefill.recv_frame()
        started = time.monotonic()
        prefill.answer(tag, OK)
        elapsed = _wait(queued.job.fence.done)
        bound = link.settings.chunk_timeout(head.plan[0].nbytes) + 0.5
        assert elapsed < bound and not link.up
        assert head.job.outcome[1].cause == queued.job.outcome[1].cause == "timeout"
        assert stats.snapshot()["failures"] == {"timeout": 2} and time.monotonic() - started < bound
        _wait(lambda: staging.held == 0)  # the receiving thread gave its buffer back

    @pytest.mark.parametrize("link_pair", [{"keepalive": 0.1}], indirect=True)
    def test_silent_prefill_ends_the_link(self, link_pair):
        """No keepalive for liveness_timeout (a stopped or vanished peer): the link ends, its job fails."""
        link, prefill, buffers, _, _ = link_pair
        with capture_logs() as logs:
            lj = _submit(link, buffers, "r")
            prefill.recv_frame()  # the job arrives; then nothing, not even a keepalive
            elapsed = _wait(lj.job.fence.done)
        assert elapsed < link.settings.liveness_timeout + 0.5 and lj.job.outcome[1].cause == "timeout"
        down = [e for e in logs if e["event"] == "transfer.link_down"]
        assert down and down[0]["peer"] == "scripted" and down[0]["epoch"] == 1

    def test_out_of_order_result_is_a_protocol_error(self, link_pair):
        """A result for a job other than the oldest ends the link (cause protocol)."""
        link, prefill, buffers, _, _ = link_pair
        lj = _submit(link, buffers, "r")
        _, tag, _ = prefill.recv_frame()
        prefill.answer(tag + 5)
        _wait(lj.job.fence.done)
        assert lj.job.outcome[1].cause == "protocol" and not link.up


class TestGivingUp:
    def test_cancel_mid_transfer_stops_the_writes(self, link_pair):
        """A job ended between chunks: its fence is done at once; later chunks are drained, never written."""
        link, prefill, buffers, stats, staging = link_pair
        lj = _submit(link, buffers, "r")
        _, tag, _ = prefill.recv_frame()
        chunks = _kv(lj.plan)
        assert len(chunks) == 2
        prefill.answer(tag)
        prefill.chunk(lj, 0, chunks[0])
        _wait(lambda: buffers.k[0][16:28].abs().sum() > 0)  # the first chunk has landed
        assert lj.end(None, "cancelled", "test")
        link.cancel(lj)
        assert lj.job.fence.done()
        assert prefill.recv_frame()[:2] == (CANCEL, tag)
        prefill.chunk(lj, 1, chunks[1])
        prefill.ping()
        _wait(lambda: not link.jobs() and staging.held == 0)
        assert link.up and buffers.k[1].abs().sum() == 0  # chunk 1 (layer 1) never written

    def test_a_wedged_writer_keeps_the_fence_not_the_caller(self, link_pair):
        """Cancelling while the writing thread is stuck in a write returns at once (the event loop never
        waits on it) and leaves the fence open; the fence completes when that write returns, cancelled."""
        link, prefill, buffers, _, _ = link_pair
        lj = _submit(link, buffers, "wedged")
        entered, release = _hold_writes(lj)
        _, tag, _ = prefill.recv_frame()
        prefill.answer(tag)
        for index, kv in enumerate(_kv(lj.plan)):
            prefill.chunk(lj, index, kv)
        assert entered.wait(5)
        started = time.monotonic()
        assert lj.end(None, "cancelled", "test", block=False)
        assert time.monotonic() - started < 0.1 and not lj.job.fence.done()
        release.set()
        _wait(lj.job.fence.done)
        assert isinstance(lj.job.outcome[1], TransferCancelled) and buffers.k[1].abs().sum() == 0

    def test_overdue_answers(self, link_pair):
        """A job whose first answer is overdue behind a busy head is given up alone (and cancelled); an
        overdue oldest job ends the link."""
        link, prefill, buffers, stats, _ = link_pair
        head = _submit(link, buffers, "head", deadline=60.0)
        late = _submit(link, buffers, "late", deadline=0.0, start=8)
        link.expire(time.monotonic())
        assert late.job.outcome[1].cause == "budget" and not head.done and link.up
        assert [prefill.recv_frame()[0] for _ in range(3)] == [JOB, JOB, CANCEL]
        head.deadline = 0.0
        link.expire(time.monotonic())
        assert head.job.outcome[1].cause == "budget" and not link.up


class TestFailover:
    def test_a_link_that_goes_down_hands_its_jobs_over(self, link_pair):
        """A link going down hands each unfinished job to its failover, open (no outcome, fence pending):
        the old link never writes it again, `writing()` holds it back while a chunk of it is still being
        written, and its successor carries the same destination; a job already ended is not handed over."""
        link, prefill, buffers, stats, _ = link_pair
        moved: list[tuple[LinkJob, LinkError]] = []
        link.failover = lambda lj, error: moved.append((lj, error))
        lj, gone = _submit(link, buffers, "moving"), _submit(link, buffers, "gone", start=8)
        entered, release = _hold_writes(lj)
        _, tag, _ = prefill.recv_frame()
        prefill.recv_frame()
        assert gone.end(None, "cancelled", "test")
        prefill.answer(tag)
        prefill.chunk(lj, 0, _kv(lj.plan)[0])
        assert entered.wait(5)
        link.down(LinkError("peer_closed", "test"), block=False)
        assert [(m.job.request_id, e.cause) for m, e in moved] == [("moving", "peer_closed")]
        assert lj.writing() and lj.job.outcome is None and not lj.job.fence.done() and not link.submit(lj)
        release.set()
        _wait(lambda: not lj.writing())
        successor = lj.successor(time.monotonic() + 1)
        assert successor.destination is lj.destination and successor.attempt == 2 and successor.decision is None
        assert lj.job.outcome is None and not lj.done  # only the successor resolves it
        assert buffers.k[1].abs().sum() == 0 and stats.snapshot()["failures"] == {}


class TestBootstrap:
    RECORD = {"protocol": 1, "model": "tiny:x", "page_size": 4}

    def _handshake(self, server_settings, client_settings, client_record=None, server_record=None):
        server = bootstrap.BootstrapServer(server_settings, 0, server_record or self.RECORD, _Log())
        result: dict = {}

        def dial() -> None:
            try:
                result["ok"] = bootstrap.connect("127.0.0.1", server.port, client_settings,
                                                 client_record or self.RECORD)
            except LinkError as exc:
                result["error"] = exc

        thread = threading.Thread(target=dial)
        thread.start()
        accepted = []
        while thread.is_alive():
            accepted += server.poll()
            time.sleep(0.002)
        accepted += server.poll()
        return result, accepted, server

    def test_shared_secret_both_ways(self):
        """With the same secret both sides agree on the same pair prefix, and the secret is never sent."""
        result, accepted, server = self._handshake(_settings(secret="the-secret"), _settings(secret="the-secret"))
        assert result["ok"].prefix == accepted[0].prefix and server.refused == {}
        assert "the-secret" not in result["ok"].prefix

    @pytest.mark.parametrize("server_secret, client_secret", [("the-secret", "wrong-secret"), ("the-secret", None),
                                                              (None, "the-secret")],
                             ids=["wrong", "missing", "prefill-without"])
    def test_secret_mismatch_is_refused(self, server_secret, client_secret):
        """A wrong or missing secret is refused before anything else is exchanged (no record is sent)."""
        result, accepted, server = self._handshake(_settings(secret=server_secret), _settings(secret=client_secret))
        assert result["error"].cause == "auth" and not accepted
        if client_secret != "the-secret":
            assert server.refused == {"auth": 1}

    def test_incompatible_record_is_refused(self):
        """A record that differs is refused on both sides, naming the field."""
        other = {**self.RECORD, "page_size": 16}
        result, accepted, server = self._handshake(_settings(), _settings(), other)
        assert result["error"].cause == "incompatible" and "page_size 16 here, 4 there" in str(result["error"])
        assert not accepted and server.refused == {"incompatible": 1}


class _Log:
    def warning(self, *args, **kwargs) -> None:
        pass


def test_header_is_fixed_size():
    """Every header is int64[HEADER_LEN], whatever it carries."""
    assert header(RESULT, 1, 2, 3).shape == (HEADER_LEN,) and empty_header().dtype == torch.int64
