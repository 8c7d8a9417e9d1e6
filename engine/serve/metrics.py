"""Prometheus metrics named and shaped as vLLM's, with a ``kvlife:`` prefix, computed at scrape time.

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, model_name="tiny"))
    text = generate_latest(registry)

Every metric has a ``model_name`` label. Nothing is counted twice: counters
are read from `engine.stats` (the loop's own counts), gauges from
`engine.requests_by_state()` and `engine.memory_report()`. Health checks
are not traffic: the engine keeps them out of the token counters and the
latency samples, and their finishes are counted in `kvlife:health_checks`,
not in `kvlife:request_success`. The latency histograms fold in the samples
recorded since the previous scrape (`window.total` says how many were
recorded; the sample windows keep the latest 100,000, far more than arrive
between two scrapes).

Every gauge carries one unit, in its name: pool sizes are
``kvlife:pool_<field>_<unit>`` (pages, slots, bytes, ...), one gauge per
unit, labelled by pool. Label values are lower case (``finished_reason=
"length"``, ``state="decoding"``).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from states import RequestKind, RequestState

P = "kvlife:"
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
POOL_FIELDS = ("capacity", "free", "evictable", "held", "quarantined")
WAITING = frozenset({RequestState.QUEUED, RequestState.RETRACTED})
RUNNING = frozenset({RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.PREBUILT,
                     RequestState.STAGING, RequestState.DECODING})
KV_POOL = "kv_pages"


class _Folded:
    """A cumulative histogram fed from a bounded window of samples plus their running total."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.seen = 0

    def fold(self, window: Any) -> None:
        samples, total = window.samples, window.total
        new = min(total - self.seen, len(samples))
        if new > 0:
            for value in itertools.islice(samples, len(samples) - new, None):
                self.counts[bisect.bisect_left(self.bounds, value)] += 1
                self.sum += value
        self.seen = total

    def metric(self, model_name: str) -> HistogramMetricFamily:
        cumulative = list(itertools.accumulate(self.counts))
        buckets = [(repr(b), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([model_name], buckets, sum_value=self.sum)
        return family


class EngineCollector(Collector):
    """Collects one engine's counters, gauges and latency histograms."""

    def __init__(self, engine: Any, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._histograms = {
            "ttft": _Folded(f"{P}time_to_first_token_seconds", "Time from arrival to the first output token.",
                            TTFT_BUCKETS),
            "itl": _Folded(f"{P}inter_token_latency_seconds", "Time between consecutive output tokens.",
                           ITL_BUCKETS),
            "e2e": _Folded(f"{P}e2e_request_latency_seconds", "Time from arrival to the final output.",
                           REQUEST_BUCKETS),
            "queue": _Folded(f"{P}request_queue_time_seconds", "Time from arrival to first admission.",
                             REQUEST_BUCKETS),
        }

    def describe(self) -> list[Metric]:
        return []  # NOTE: no describe-time collection; the registry calls collect() at scrape only

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        counter = CounterMetricFamily(f"{P}{name}", doc, labels=["model_name"])
        counter.add_metric([self.model_name], value)
        return counter

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(f"{P}{name}", doc, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge

    def collect(self) -> Iterator[Metric]:
        stats, model = self.engine.stats, self.model_name
        yield self._counter("prompt_tokens", "Prompt tokens of admitted requests (health checks excluded).",
                            stats.prompt_tokens)
        yield self._counter("generation_tokens", "Output tokens generated (health checks excluded).",
                            stats.tokens_generated)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_query_tokens)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens)
        yield self._counter("num_preemptions", "Requests retracted (preempted) under memory pressure.",
                            stats.retractions)
        yield from self._finishes(stats)
        yield from self._requests()
        yield from self._pools()
        transitions = CounterMetricFamily(f"{P}transitions", "Request state transitions, by edge.",
                                          labels=["model_name", "src", "dst"])
        for (src, dst), count in sorted(stats.transitions.items()):
            transitions.add_metric([model, src.lower(), dst.lower()], count)
        yield transitions
        for name, value, doc in (
            ("model_steps", stats.steps, "Model steps run (failed ones included)."),
            ("step_errors", stats.step_errors, "Model steps that raised."),
            ("leak_checks", stats.leak_checks, "Leak checks run (each time the loop went idle)."),
            ("leak_check_failures", stats.leak_check_failures, "Leak checks that found a leak."),
            ("spec_decode_num_drafts", stats.spec_verify_steps,
             "Speculative decoding: verify steps of a request with draft tokens."),
            ("spec_decode_num_draft_tokens", stats.spec_draft_tokens, "Speculative decoding: draft tokens verified."),
            ("spec_decode_num_accepted_tokens", stats.spec_accepted_tokens,
             "Speculative decoding: draft tokens the model accepted."),
            ("decode_runs", stats.decode_runs, "Decode runs started (EngineConfig.decode_steps > 1)."),
            ("decode_run_steps", stats.decode_run_steps, "Model steps taken inside decode runs."),
        ):
            yield self._counter(name, doc, value)
        for key, histogram in self._histograms.items():
            histogram.fold(getattr(stats, key))
            yield histogram.metric(model)

    def _finishes(self, stats: Any) -> Iterator[Metric]:
        success = CounterMetricFamily(f"{P}request_success", "Requests finished, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        health = CounterMetricFamily(f"{P}health_checks", "Health-check requests finished, by finish reason.",
                                     labels=["model_name", "finished_reason"])
        for (kind, reason), count in sorted(stats.finishes.items()):
            family = health if kind == RequestKind.HEALTH_CHECK.value else success
            family.add_metric([self.model_name, reason.lower()], count)
        yield success
        yield health

    def _requests(self) -> Iterator[Metric]:
        by_state = self.engine.requests_by_state()
        yield self._gauge("num_requests_running", "Requests admitted and not yet finished.",
                          sum(n for s, n in by_state.items() if s in RUNNING))
        yield self._gauge("num_requests_waiting", "Requests queued for admission (retracted ones included).",
                          sum(n for s, n in by_state.items() if s in WAITING))
        current = GaugeMetricFamily(f"{P}num_requests_by_state", "Requests not yet released, by state.",
                                    labels=["model_name", "state"])
        for state in RequestState:
            if state is not RequestState.RELEASED:
                current.add_metric([self.model_name, state.value], by_state.get(state, 0))
        yield current

    def _pools(self) -> Iterator[Metric]:
        pools = sorted(self.engine.memory_report().pools.items())
        kv = dict(pools).get(KV_POOL)
        usage = 0.0 if kv is None or not kv.capacity else kv.held / kv.capacity
        yield self._gauge("kv_cache_usage_ratio", "KV pages held by requests over KV capacity (0 to 1).", usage)
        units: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        for name, pool in pools:
            units[pool.unit].append((name, pool))
        for unit, members in sorted(units.items()):
            for field in POOL_FIELDS:
                gauge = GaugeMetricFamily(f"{P}pool_{field}_{unit}", f"Pool {field}, in {unit}, per pool.",
                                          labels=["model_name", "pool"])
                for name, pool in members:
                    gauge.add_metric([self.model_name, name], getattr(pool, field))
                yield gauge
        suspect = GaugeMetricFamily(f"{P}pool_suspect", "1 if a release into this pool failed, else 0.",
                                    labels=["model_name", "pool"])
        for name, pool in pools:
            suspect.add_metric([self.model_name, name], int(pool.suspect))
        yield suspect
