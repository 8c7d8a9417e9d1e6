"""GET /metrics: vLLM's names with a `kvlife:` prefix, parsed with prometheus-client's parser,
checked against what the test did."""

from __future__ import annotations

import socket

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.testing import FaultInjector
from http_helpers import StepGate, serving, stream_events

PROMPT = [5, 17, 42, 99, 3, 8]
MODEL = {"model_name": "tiny"}
EXPECTED_TYPES = {
    "kvlife:prompt_tokens": "counter",
    "kvlife:generation_tokens": "counter",
    "kvlife:request_success": "counter",
    "kvlife:health_checks": "counter",
    "kvlife:prefix_cache_queries": "counter",
    "kvlife:prefix_cache_hits": "counter",
    "kvlife:num_preemptions": "counter",
    "kvlife:transitions": "counter",
    "kvlife:leak_check_failures": "counter",
    "kvlife:time_to_first_token_seconds": "histogram",
    "kvlife:inter_token_latency_seconds": "histogram",
    "kvlife:e2e_request_latency_seconds": "histogram",
    "kvlife:request_queue_time_seconds": "histogram",
    "kvlife:num_requests_running": "gauge",
    "kvlife:num_requests_waiting": "gauge",
    "kvlife:kv_cache_usage_ratio": "gauge",
    "kvlife:pool_held_pages": "gauge",
    "kvlife:pool_capacity_slots": "gauge",
    "kvlife:pool_free_bytes": "gauge",
}


async def _families(client) -> dict:
    response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def _samples(families) -> dict[tuple[str, tuple], float]:
    """Every sample: (sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}


def _value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({**MODEL, **labels}.items())))]


class TestNamesAndTypes:
    @pytest.mark.asyncio
    async def test_vllm_names_with_types_and_model_name(self):
        """Each expected family is there with its type, and every sample carries model_name."""
        async with serving() as (_, client):
            await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            families = await _families(client)
        assert {name: families[name].type for name in EXPECTED_TYPES if name in families} == EXPECTED_TYPES
        assert all(s.labels.get("model_name") == "tiny" for f in families.values() for s in f.samples)

    @pytest.mark.asyncio
    async def test_one_unit_per_pool_gauge(self):
        """Pool gauges are split by unit: the kv pool is only in *_pages, the slots only in *_slots."""
        async with serving() as (_, client):
            samples = _samples(await _families(client))
        pages = {dict(labels)["pool"] for name, labels in samples if name == "kvlife:pool_capacity_pages"}
        slots = {dict(labels)["pool"] for name, labels in samples if name == "kvlife:pool_capacity_slots"}
        assert pages == {"kv_pages"} and slots == {"request_slots"}


class TestCounters:
    @pytest.mark.asyncio
    async def test_counters_match_the_requests_made(self):
        """Tokens, finishes and transitions count exactly the requests made; health checks apart."""
        async with serving() as (engine, client):
            for _ in range(3):  # NOTE: ignore_eos: a sampled first EOS would end one early (a flake, not a failure)
                await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4,
                                                                                             "ignore_eos": True}})
            await stream_events(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                                            "ignore_eos": True})
            await client.get("/health_generate")
            await engine.wait_idle(5)
            samples = _samples(await _families(client))
            report = engine.memory_report()
        assert _value(samples, "kvlife:prompt_tokens_total") == 4 * len(PROMPT)
        assert _value(samples, "kvlife:generation_tokens_total") == 3 * 4 + 3
        assert _value(samples, "kvlife:request_success_total", finished_reason="length") == 4
        assert _value(samples, "kvlife:health_checks_total", finished_reason="length") == 1
        assert ("kvlife:request_success_total", tuple(sorted({**MODEL, "finished_reason": "abort"}.items()))) \
            not in samples
        assert _value(samples, "kvlife:time_to_first_token_seconds_count") == 4  # health checks are not traffic
        assert _value(samples, "kvlife:e2e_request_latency_seconds_count") == 4
        assert _value(samples, "kvlife:request_queue_time_seconds_count") == 4
        assert _value(samples, "kvlife:transitions_total", src="queued", dst="prefilling") == 5
        assert _value(samples, "kvlife:leak_check_failures_total") == 0
        assert _value(samples, "kvlife:num_requests_running") == 0 == _value(samples, "kvlife:num_requests_waiting")
        kv = report.pools["kv_pages"]
        assert _value(samples, "kvlife:pool_capacity_pages", pool="kv_pages") == kv.capacity
        assert _value(samples, "kvlife:pool_held_pages", pool="kv_pages") == 0
        assert _value(samples, "kvlife:kv_cache_usage_ratio") == 0

    @pytest.mark.asyncio
    async def test_prefix_cache_counters(self):
        """The same prompt twice: the second admission's cached tokens count as prefix-cache hits."""
        prompt = list(range(10, 30))
        async with serving() as (engine, client):
            for _ in range(2):
                await client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
            samples = _samples(await _families(client))
        assert _value(samples, "kvlife:prefix_cache_queries_total") == engine.stats.prefix_query_tokens > 0
        assert _value(samples, "kvlife:prefix_cache_hits_total") == engine.stats.prefix_hit_tokens > 0


class TestLatencyHistograms:
    @pytest.mark.asyncio
    async def test_histograms_count_every_token_once(self):
        """TTFT counts one sample per request and ITL one per later token, across scrapes."""
        async with serving() as (_, client):
            await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}})
            first = _samples(await _families(client))
            await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
            second = _samples(await _families(client))
        assert _value(first, "kvlife:time_to_first_token_seconds_count") == 1
        assert _value(first, "kvlife:inter_token_latency_seconds_count") == 4
        assert _value(second, "kvlife:time_to_first_token_seconds_count") == 2
        assert _value(second, "kvlife:inter_token_latency_seconds_count") == 4 + 2
        assert _value(second, "kvlife:time_to_first_token_seconds_sum") > 0
        buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in second.items()
                         if name == "kvlife:time_to_first_token_seconds_bucket")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), 2)


class TestGauges:
    @pytest.mark.asyncio
    async def test_running_and_kv_usage_while_in_flight(self):
        """During a model step the request counts as running and its pages as KV usage."""
        gate = StepGate()
        async with serving(faults=FaultInjector(fail_step=gate)) as (engine, client):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json={"input_ids": PROMPT}))
                await gate.wait_entered()
                during = _samples(await _families(client))
                gate.open()
            await engine.wait_idle(5)
            after = _samples(await _families(client))
        assert _value(during, "kvlife:num_requests_running") == 1
        assert _value(during, "kvlife:num_requests_by_state", state="prefilling") == 1
        assert _value(during, "kvlife:pool_held_pages", pool="kv_pages") > 0
        assert 0 < _value(during, "kvlife:kv_cache_usage_ratio") <= 1
        assert _value(after, "kvlife:num_requests_running") == 0
        assert _value(after, "kvlife:kv_cache_usage_ratio") == 0


class TestTransferMetrics:
    @pytest.mark.asyncio
    async def test_a_decode_servers_transfer_metrics_carry_model_name(self):
        """A decode server with a remote prefill (here one that never answers) exports kvlife:transfer_*, and
        every one of their samples has the model_name label, like every other metric."""
        from engine.disagg.link.settings import RemotePrefill

        with socket.socket() as unused:  # a port nobody listens on: the link stays down
            unused.bind(("127.0.0.1", 0))
            peer = f"127.0.0.1:{unused.getsockname()[1]}"
        remote = RemotePrefill(peers=(peer,), connect_timeout=1.0)
        async with serving(disaggregation="decode", remote_prefill=remote) as (_, client):
            text = (await client.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        transfer = [f for name, f in families.items() if name.startswith("kvlife:transfer")]
        assert {"kvlife:transfer_bytes", "kvlife:transfer_link_up", "kvlife:transfer_seconds"} <= {
            f.name for f in transfer}
        samples = [s for f in transfer for s in f.samples]
        assert samples and all(s.labels.get("model_name") == "tiny" for s in samples), samples[:3]
        assert any(s.name == "kvlife:transfer_bytes_total" and s.value == 0 for s in samples)
