"""GET /metrics: Prometheus text, parsed with prometheus-client's parser, checked against what the test did."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.testing import FaultInjector
from http_helpers import StepGate, serving, stream_events

PROMPT = [5, 17, 42, 99, 3, 8]


async def _scrape(client) -> dict[tuple[str, tuple], float]:
    """Every sample of the metrics page: (sample name, sorted labels) -> value."""
    response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def _value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


class TestCounters:
    @pytest.mark.asyncio
    async def test_counters_match_the_requests_made(self):
        """Finishes, transitions, tokens and leak checks count exactly the requests the test made."""
        async with serving() as (engine, client):
            for _ in range(3):
                await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
            await stream_events(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True})
            await client.get("/health_generate")
            await engine.wait_idle(5)
            samples = await _scrape(client)
            report = engine.memory_report()
        assert _value(samples, "kvlife_requests_submitted_total") == 5
        assert _value(samples, "kvlife_requests_finished_total", kind="normal", reason="length") == 4
        assert _value(samples, "kvlife_requests_finished_total", kind="health_check", reason="length") == 1
        assert _value(samples, "kvlife_tokens_generated_total") == 3 * 4 + 3  # health checks are not traffic
        assert _value(samples, "kvlife_transitions_total", src="queued", dst="prefilling") == 5
        assert _value(samples, "kvlife_transitions_total", src="prebuilt", dst="finished") == 1
        assert _value(samples, "kvlife_transitions_total", src="finished", dst="released") == 5
        assert _value(samples, "kvlife_leak_checks_total") >= 1
        assert _value(samples, "kvlife_leak_check_failures_total") == 0
        for state in ("queued", "prefilling", "decoding", "finished"):
            assert _value(samples, "kvlife_requests", state=state) == 0
        for name, pool in report.pools.items():
            labels = {"pool": name, "unit": pool.unit}
            assert _value(samples, "kvlife_pool_capacity", **labels) == pool.capacity
            assert _value(samples, "kvlife_pool_held", **labels) == 0
            assert (_value(samples, "kvlife_pool_free", **labels) + _value(samples, "kvlife_pool_evictable", **labels)
                    == pool.capacity)


class TestLatencyHistograms:
    @pytest.mark.asyncio
    async def test_histograms_count_every_token_once(self):
        """TTFT counts one sample per request and ITL one per later token, across scrapes."""
        async with serving() as (engine, client):
            await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}})
            first = await _scrape(client)
            await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
            second = await _scrape(client)
        assert _value(first, "kvlife_time_to_first_token_seconds_count") == 1
        assert _value(first, "kvlife_inter_token_latency_seconds_count") == 4
        assert _value(second, "kvlife_time_to_first_token_seconds_count") == 2
        assert _value(second, "kvlife_inter_token_latency_seconds_count") == 4 + 2
        assert _value(second, "kvlife_time_to_first_token_seconds_sum") > 0
        buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in second.items()
                         if name == "kvlife_time_to_first_token_seconds_bucket")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), 2)


class TestGauges:
    @pytest.mark.asyncio
    async def test_state_and_pool_gauges_while_in_flight(self):
        """During a model step the request shows as prefilling and its pages as held."""
        gate = StepGate()
        async with serving(faults=FaultInjector(fail_step=gate)) as (engine, client):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json={"input_ids": PROMPT}))
                await gate.wait_entered()
                during = await _scrape(client)
                gate.open()
            await engine.wait_idle(5)
            after = await _scrape(client)
        assert _value(during, "kvlife_requests", state="prefilling") == 1
        assert _value(during, "kvlife_pool_held", pool="kv_pages", unit="pages") > 0
        assert _value(after, "kvlife_requests", state="prefilling") == 0
        assert _value(after, "kvlife_pool_held", pool="kv_pages", unit="pages") == 0
