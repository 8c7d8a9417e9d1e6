"""The metrics routers read, under kvlife's names and, with ``--vllm-metric-names``, vLLM's too.

    registry.register(router_collector(EngineCollector(engine, model_name=name), engine,
                                       model_name=name, vllm_names=True))

The Gateway API Inference Extension's model-server protocol (the llm-d Endpoint Picker) scrapes a
queued-requests gauge, a running-requests gauge and a KV-utilisation gauge (0 to 1), and for its
prefix scorer a cache-info gauge whose labels carry ``block_size`` and ``num_gpu_blocks``:

| protocol | kvlife | vLLM's name (also exported with the switch) |
|---|---|---|
| TotalQueuedRequests | ``kvlife:num_requests_waiting`` | ``vllm:num_requests_waiting`` |
| TotalRunningRequests | ``kvlife:num_requests_running`` | ``vllm:num_requests_running`` |
| KVCacheUtilization | ``kvlife:kv_cache_usage_ratio`` | ``vllm:kv_cache_usage_perc`` |
| CacheInfo | ``kvlife:cache_config_info`` | ``vllm:cache_config_info`` |

The switch also copies every other metric with a vLLM counterpart (`VLLM_NAMES`), for dashboards
and autoscalers that hard-code them. A copy is the same family with the same samples, read in the
same scrape (the latency histograms are folded once).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

P = "kvlife:"
#: kvlife's family name -> vLLM's (counters without their `_total`, as prometheus_client names families)
VLLM_NAMES = {
    f"{P}num_requests_waiting": "vllm:num_requests_waiting",
    f"{P}num_requests_running": "vllm:num_requests_running",
    f"{P}kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    f"{P}cache_config_info": "vllm:cache_config_info",
    f"{P}prompt_tokens": "vllm:prompt_tokens",
    f"{P}generation_tokens": "vllm:generation_tokens",
    f"{P}request_success": "vllm:request_success",
    f"{P}prefix_cache_queries": "vllm:prefix_cache_queries",
    f"{P}prefix_cache_hits": "vllm:prefix_cache_hits",
    f"{P}num_preemptions": "vllm:num_preemptions",
    f"{P}time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    f"{P}inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    f"{P}e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    f"{P}request_queue_time_seconds": "vllm:request_queue_time_seconds",
    f"{P}spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    f"{P}spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    f"{P}spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def cache_config_info(engine: Any, model_name: str) -> GaugeMetricFamily:
    """An info gauge (always 1) whose labels describe the KV cache, as vLLM's ``cache_config_info``."""
    config = engine.config
    family = GaugeMetricFamily(f"{P}cache_config_info", "The KV cache's configuration (labels; value 1).",
                               labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"])
    family.add_metric([model_name, str(config.page_size), str(config.num_kv_pages), str(config.prefix_cache)], 1)
    return family


def renamed(family: Metric, name: str) -> Metric:
    """The same family and samples under another name (a sample's suffix, `_total`, `_bucket`, kept)."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        copy.add_sample(name + sample.name[len(family.name):], sample.labels, sample.value, sample.timestamp,
                        sample.exemplar)
    return copy


class RouterCollector(Collector):
    """The engine's metrics, the cache-info gauge, and their vLLM-named copies when asked."""

    def __init__(self, inner: Collector, engine: Any, *, model_name: str, vllm_names: bool) -> None:
        self.inner, self.engine, self.model_name, self.vllm_names = inner, engine, model_name, vllm_names

    def describe(self) -> list[Metric]:
        return []  # NOTE: collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        for family in (*self.inner.collect(), cache_config_info(self.engine, self.model_name)):
            yield family
            if self.vllm_names and family.name in VLLM_NAMES:
                yield renamed(family, VLLM_NAMES[family.name])


def router_collector(inner: Collector, engine: Any, *, model_name: str, vllm_names: bool) -> RouterCollector:
    return RouterCollector(inner, engine, model_name=model_name, vllm_names=vllm_names)
