"""The link's pieces without processes: job frames, chunk plans, the compatibility
record, proofs, the settings' checks, the staging pool and the metrics collector."""

from __future__ import annotations

import threading

import attrs
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from disagg_helpers import remote_config
from engine import Engine, EngineConfig, SamplingParams
from engine.disagg.link.observability import TransferStats
from engine.serve.transfer_metrics import TransferCollector
from engine.disagg.link.settings import SECRET_ENV, PrefillServerConfig, RemotePrefill
from engine.disagg.link.staging import StagingFull, StagingPool
from resources.paging import size_class
from engine.disagg.link.wire import (JobSpec, KVLayout, ProtocolError, chunk_plan, decode_job, encode_job, params_to_dict,
                                proof, proof_ok, record_mismatch)
from engine.errors import InvalidConfig

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)  # 1 KiB per token and layer


class TestJobFrames:
    def test_round_trip(self):
        """Every field of a job survives the frame, images included."""
        image = torch.randint(0, 255, (16, 8, 3), dtype=torch.uint8)
        params = params_to_dict(SamplingParams(max_new_tokens=5, temperature=0.5, seed=3, stop_token_ids=[7]))
        spec = JobSpec("r-1", [5, 6, 7, 300], params, [7], [image], budget=1.5, max_chunk_bytes=4096)
        back = decode_job(encode_job(spec))
        assert (back.request_id, back.token_ids, back.output_token_ids, back.budget, back.max_chunk_bytes) == (
            "r-1", [5, 6, 7, 300], [7], 1.5, 4096)
        assert SamplingParams(**back.params) == SamplingParams(**params)
        assert len(back.images) == 1 and torch.equal(back.images[0], image)

    def test_token_section_is_int64_as_before(self):
        """The frame's token section is the ids as torch's int64 bytes (protocol 4's layout: a peer of the
        same version reads it), large ids and 0 included."""
        ids = [0, 1, 255, 256, 2**31 + 5, 2**62]
        frame = encode_job(JobSpec("r-2", ids, {}))
        assert torch.equal(frame[: 8 * len(ids)], torch.tensor(ids, dtype=torch.int64).view(torch.uint8))
        assert decode_job(frame).token_ids == ids

    def test_token_ids_outside_the_vocabulary_are_protocol_errors(self):
        """Given the prefill's vocabulary, a frame whose token ids leave [0, vocab) is refused (on the link's
        thread, before the event loop sees it); the bounds themselves pass."""
        assert decode_job(encode_job(JobSpec("r-3", [0, 5, 99], {})), vocab_size=100).token_ids == [0, 5, 99]
        for bad in ([0, 100], [-1, 3]):
            with pytest.raises(ProtocolError, match=r"token ids must be in \[0, 100\)"):
                decode_job(encode_job(JobSpec("r-3", bad, {})), vocab_size=100)
        assert decode_job(encode_job(JobSpec("r-3", [0, 100], {}))).token_ids == [0, 100]  # unchecked without it

    @pytest.mark.parametrize("frame", [torch.zeros(3, dtype=torch.uint8), torch.full((40,), 255, dtype=torch.uint8)],
                             ids=["short", "garbage"])
    def test_malformed_frames_are_protocol_errors(self, frame):
        """A malformed frame raises ProtocolError (the prefill answers FAILED), never anything else."""
        with pytest.raises(ProtocolError):
            decode_job(frame)


class TestChunkPlan:
    def test_whole_layers_when_they_fit(self):
        """Small jobs send whole layers per chunk, as few chunks as the limit allows."""
        plan = chunk_plan(LAYOUT, 100, 250 << 10)  # 100 KiB per layer: two layers per chunk
        assert [(c.first_layer, c.num_layers, c.count) for c in plan] == [(0, 2, 100), (2, 2, 100)]

    def test_token_runs_when_a_layer_does_not_fit(self):
        """A layer larger than the limit is split into token runs; the chunks cover every byte once."""
        plan = chunk_plan(LAYOUT, 100, 40 << 10)  # 40 tokens per chunk
        assert [(c.first_layer, c.start, c.count) for c in plan[:3]] == [(0, 0, 40), (0, 40, 40), (0, 80, 20)]
        assert sum(c.nbytes for c in plan) == 100 * 4 * LAYOUT.bytes_per_token_layer
        assert all(c.nbytes <= 40 << 10 for c in plan)


class TestHandshakePieces:
    def test_record_mismatch_names_each_field(self):
        """A mismatch says which fields differ and both values."""
        mine = {"page_size": 16, "dtype": "float32", "model": "tiny:1"}
        assert record_mismatch(mine, dict(mine)) is None
        why = record_mismatch(mine, {**mine, "page_size": 4, "dtype": "bfloat16"})
        assert why == "dtype 'float32' here, 'bfloat16' there; page_size 16 here, 4 there"

    def test_proofs(self):
        """A proof verifies only under the same secret and parts; without a secret only '' does."""
        good = proof("s3cret-value", "hello", "c", 1, "n")
        assert proof_ok("s3cret-value", good, "hello", "c", 1, "n")
        assert not proof_ok("other-secret", good, "hello", "c", 1, "n")
        assert not proof_ok("s3cret-value", good, "hello", "c", 2, "n")
        assert proof_ok(None, "", "x") and not proof_ok(None, good, "x")


class TestSettings:
    @pytest.mark.parametrize("fields, field", [
        ({"peers": ["10.0.0.5:31001"]}, "RemotePrefill.peers"),
        ({"peers": ["127.0.0.1:31001"], "host": "10.0.0.2"}, "RemotePrefill.host"),
        ({"peers": ["127.0.0.1"]}, "RemotePrefill.peers"),
        ({"peers": []}, "RemotePrefill.peers"),
        ({"peers": ["127.0.0.1:1", "127.0.0.1:1"]}, "RemotePrefill.peers"),
        ({"peers": ["127.0.0.1:1"], "keepalive": 0}, "RemotePrefill.keepalive"),
        ({"peers": ["127.0.0.1:1"], "backend": "mpi"}, "RemotePrefill.backend"),
    ], ids=["remote-peer-without-secret", "remote-host-without-secret", "no-port", "empty", "duplicate",
            "keepalive", "backend"])
    def test_bad_settings_name_the_field(self, fields, field, monkeypatch):
        """Bad settings raise InvalidConfig naming the field; without a secret only loopback is allowed."""
        monkeypatch.delenv(SECRET_ENV, raising=False)
        with pytest.raises(InvalidConfig) as info:
            RemotePrefill(**fields)
        assert info.value.field == field

    def test_secret_from_the_environment_and_never_shown(self, monkeypatch):
        """The secret comes from KVLIFE_DISAGG_SECRET when not given, allows remote peers, and no repr shows it."""
        monkeypatch.setenv(SECRET_ENV, "from-the-environment")
        settings = RemotePrefill(peers=["10.0.0.5:31001"], host="10.0.0.2")
        assert settings.secret == "from-the-environment"
        assert "from-the-environment" not in repr(settings) and "from-the-environment" not in repr(
            PrefillServerConfig(host="0.0.0.0"))

    def test_fence_timeout_must_cover_the_transfer(self):
        """fence_timeout is checked against the link's bounds: before loading (the config) and after (the
        engine, for a max_context transfer), each naming the field and the limit."""
        remote = RemotePrefill(peers=["127.0.0.1:1"], first_timeout=20.0)
        with pytest.raises(InvalidConfig) as info:
            EngineConfig(disaggregation="decode", remote_prefill=remote, fence_timeout=10.0)
        assert info.value.field == "EngineConfig.fence_timeout" and info.value.limit.startswith(">= 21 s")
        with pytest.raises(InvalidConfig) as info:
            Engine(remote_config("127.0.0.1:1", max_chunk_bytes=16 << 10, fence_timeout=5.0))
        assert info.value.field == "EngineConfig.fence_timeout" and "256-token transfer" in info.value.limit
        with pytest.raises(InvalidConfig) as info:
            EngineConfig(remote_prefill=remote)
        assert info.value.field == "EngineConfig.remote_prefill"


class TestStagingPool:
    def test_take_give_and_push_back(self):
        """Bytes are accounted per owner (what was allocated: the size class); a full pool blocks, then
        refuses; giving back wakes a waiter; a buffer given back is reused for its class, unless a failed
        receive was posted into it."""
        pool = StagingPool("transfer.staging", 4096, torch.device("cpu"), keep_bytes=4096)
        buf = pool.take("a", 3000, timeout=0.1)
        usage = pool.stats()
        assert buf.numel() == 3000 and pool.held == usage.shared == size_class(3000, 4096) == 3072
        assert usage.free + usage.shared == 4096
        with pytest.raises(StagingFull):
            pool.take("b", 2000, timeout=0.05)
        threading.Timer(0.05, pool.give, args=("a", buf)).start()
        other = pool.take("b", 2000, timeout=5.0)  # the kept 3072-byte buffer made room
        assert [(o.request_id, o.amount) for o in pool.shared_owners()] == [("b", 2048)]
        with pytest.raises(RuntimeError):
            pool.give("c", other)
        pool.give("b", other)
        again = pool.take("c", 1900, timeout=0.1)  # another size of the same class
        assert again.numel() == 1900 and again.data_ptr() == other.data_ptr()  # reused
        pool.give("c", again, reuse=False)
        assert pool.take("d", 2000, timeout=0.1).data_ptr() != other.data_ptr()  # a failed receive's: never
        assert pool.held == 2048
        with pytest.raises(RuntimeError, match="did not lend"):
            pool.give("d", torch.empty(2000, dtype=torch.uint8))

    def test_kept_memory_is_bounded(self):
        """Jobs of ever-changing sizes: what the pool keeps for reuse never passes `keep_bytes`, so resident
        memory is what is lent plus that bound (it was the whole capacity, one buffer per exact size)."""
        pool = StagingPool("transfer.staging", 1 << 20, torch.device("cpu"), keep_bytes=64 << 10)
        for n in range(1000, 40000, 997):
            bufs = [pool.take(f"r{n}-{i}", n + i, timeout=0.1) for i in range(3)]
            for i, buf in enumerate(bufs):
                pool.give(f"r{n}-{i}", buf)
            assert pool.held == 0 and pool.kept_bytes <= 64 << 10
        assert pool.stats().free == 1 << 20

    @pytest.mark.parametrize("nbytes", [1, 9, 1000, 3000, 4097, 1 << 20, (1 << 20) + 1, 123_456_789])
    def test_size_classes_waste_at_most_a_quarter(self, nbytes):
        size = size_class(nbytes, 1 << 40)
        assert nbytes <= size <= nbytes * 1.25 and size_class(size, 1 << 40) == size
        assert size_class(nbytes, nbytes) == nbytes  # never past the capacity


class TestMetrics:
    def test_collector_exposes_the_transfer_metrics(self):
        """Bytes, jobs by outcome, failures by cause, latency histograms and link states are in /metrics."""
        stats = TransferStats("decode")
        stats.link_up("127.0.0.1:1", 2, "b")
        stats.job_ok(4096, 0.002, 0.02)
        stats.job_failed("timeout")
        stats.link_down("127.0.0.1:1", "timeout")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(TransferCollector(stats))
        text = generate_latest(registry).decode()
        for line in ('kvlife:transfer_bytes_total 4096.0', 'kvlife:transfer_failures_total{cause="timeout"} 1.0',
                     'kvlife:transfer_link_up{peer="127.0.0.1:1"} 0.0', 'kvlife:transfer_seconds_count 1.0',
                     'kvlife:transfer_link_changes_total{change="down",peer="127.0.0.1:1"} 1.0',
                     'kvlife:transfer_link_epoch{peer="127.0.0.1:1"} 2.0'):
            assert line in text


class TestDestinations:
    def test_host_rows_land_as_staging_would_put_them(self):
        """HiSparse host rows get (K, V) side by side and index keys from K, exactly as `stage` writes them."""
        from engine.disagg.decode.destination import HostRowsDestination
        from hisparse.pools import HostKVPool
        from hisparse.selection import IndexProjection

        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        cpu = torch.device("cpu")
        projection = IndexProjection(num_heads=4, num_kv_heads=2, head_dim=8, index_dim=4, device=cpu,
                                     dtype=torch.float32)
        host = HostKVPool(num_tokens=64, page_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                          index_dim=projection.dim, dtype=torch.float32, device=cpu)
        rows = torch.tensor([20, 21, 22, 23, 8, 9])
        dest = HostRowsDestination(host, rows, projection.keys, cpu)
        plan = chunk_plan(layout, 6, 1 << 20)
        kv = torch.randn(layout.chunk_shape(plan[0]))
        dest.write(plan[0], kv)
        for layer in range(2):
            assert torch.equal(host.kv[layer][rows], torch.stack((kv[layer, 0], kv[layer, 1]), dim=1))
            assert torch.equal(host.index[layer][rows], projection.keys(kv[layer, 0]))
        assert host.kv[0][0:8].abs().sum() == 0  # nothing else written


@pytest.mark.anyio
async def test_prefill_answers_a_job_outside_its_vocabulary_failed(monkeypatch):
    """A real prefill server and decode engine in this process; the decode's job frame for one request is
    altered to carry a token id past the vocabulary (the fault): that request ends TRANSFER_FAILED naming
    the range, the prefill never runs it and is whole, and the next request over the same link lands."""
    import anyio

    from disagg_helpers import client
    from engine.disagg import PrefillServer
    from engine.disagg.decode import decode_link
    from helpers import small_config

    real = decode_link.encode_job

    def altered(spec: JobSpec) -> torch.Tensor:
        if spec.request_id == "bad":
            spec = attrs.evolve(spec, token_ids=[*spec.token_ids[:-1], 1 << 20])
        return real(spec)

    monkeypatch.setattr(decode_link, "encode_job", altered)
    async with PrefillServer(small_config(model="null"), PrefillServerConfig(bootstrap_port=0)) as server:
        vocab = server.parts.model_config.vocab_size
        config = remote_config(f"127.0.0.1:{server.bootstrap_port}", fence_timeout=60.0, model="null")
        async with Engine(config) as engine:
            await client(engine).wait_links()
            params = SamplingParams(max_new_tokens=2, ignore_eos=True)
            bad = await engine.complete(list(range(1, 41)), params, request_id="bad")
            good = await engine.complete(list(range(1, 41)), params, request_id="good")
            await engine.wait_idle(5)
            engine.check_memory()
        assert bad.finish_reason.name == "TRANSFER_FAILED" and bad.token_ids == []
        assert f"token ids must be in [0, {vocab})" in (bad.error or "")
        assert good.finish_reason.name == "LENGTH" and len(good.token_ids) == 2
        with anyio.fail_after(10):
            while not server.idle:
                await anyio.sleep(0.01)
        server.check_memory()
        assert server.runtime.loop.stats.submitted == 1  # only "good" reached the prefill's runtime
