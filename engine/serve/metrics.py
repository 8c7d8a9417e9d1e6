"""Prometheus metrics over the public Engine API, computed at scrape time.

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    text = generate_latest(registry)

Nothing is counted twice: counters are read from `engine.stats` (the loop's
own counts), gauges from `engine.requests_by_state()` and
`engine.memory_report()`. The latency histograms fold in the samples the
loop recorded since the previous scrape (`stats.ttft.total` and
`stats.itl.total` say how many were recorded; the sample windows keep the
most recent 100,000, far more than arrive between two scrapes).

Label values are lower case: ``reason="length"``, ``state="decoding"``,
``src="prebuilt"``, ``kind="health_check"``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from states import RequestState

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
POOL_FIELDS = ("capacity", "free", "evictable", "held", "quarantined")


class _Folded:
    """A cumulative histogram fed from a bounded window of samples plus their running total."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.seen = 0

    def fold(self, window: Sequence[float], total: int) -> None:
        new = min(total - self.seen, len(window))
        if new > 0:
            for value in itertools.islice(window, len(window) - new, None):
                self.counts[bisect.bisect_left(self.bounds, value)] += 1
                self.sum += value
        self.seen = total

    def metric(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative = list(itertools.accumulate(self.counts))
        buckets = [(repr(b), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.sum)


class EngineCollector(Collector):
    """Collects one engine's counters, gauges and latency histograms."""

    def __init__(self, engine: Any, *, prefix: str = "kvlife") -> None:
        self.engine = engine
        self.prefix = prefix
        self._ttft = _Folded(TTFT_BUCKETS)
        self._itl = _Folded(ITL_BUCKETS)

    def describe(self) -> list[Metric]:
        return []  # NOTE: no describe-time collection; the registry calls collect() at scrape only

    def collect(self) -> Iterator[Metric]:
        p = self.prefix
        stats = self.engine.stats

        submitted = CounterMetricFamily(f"{p}_requests_submitted", "Requests submitted to the engine.")
        submitted.add_metric([], stats.submitted)
        yield submitted

        finished = CounterMetricFamily(f"{p}_requests_finished", "Requests finished, by kind and finish reason.",
                                       labels=["kind", "reason"])
        for (kind, reason), count in sorted(stats.finishes.items()):
            finished.add_metric([kind, reason.lower()], count)
        yield finished

        by_state = self.engine.requests_by_state()
        current = GaugeMetricFamily(f"{p}_requests", "Requests not yet released, by current state.", labels=["state"])
        for state in RequestState:
            if state is not RequestState.RELEASED:
                current.add_metric([state.value], by_state.get(state, 0))
        yield current

        transitions = CounterMetricFamily(f"{p}_transitions", "Request state transitions, by edge.",
                                          labels=["src", "dst"])
        for (src, dst), count in sorted(stats.transitions.items()):
            transitions.add_metric([src.lower(), dst.lower()], count)
        yield transitions

        report = self.engine.memory_report()
        for field in POOL_FIELDS:
            gauge = GaugeMetricFamily(f"{p}_pool_{field}", f"Pool units {field}, per pool.", labels=["pool", "unit"])
            for name, pool in sorted(report.pools.items()):
                gauge.add_metric([name, pool.unit], getattr(pool, field))
            yield gauge
        suspect = GaugeMetricFamily(f"{p}_pool_suspect", "1 if a release into this pool failed.", labels=["pool"])
        for name, pool in sorted(report.pools.items()):
            suspect.add_metric([name], int(pool.suspect))
        yield suspect

        for name, value, doc in (
            ("leak_checks", stats.leak_checks, "Leak checks run (each time the loop went idle)."),
            ("leak_check_failures", stats.leak_check_failures, "Leak checks that found a leak."),
            ("tokens_generated", stats.tokens_generated, "Output tokens generated."),
            ("retractions", stats.retractions, "Requests retracted under memory pressure."),
            ("step_errors", stats.step_errors, "Model steps that raised."),
        ):
            counter = CounterMetricFamily(f"{p}_{name}", doc)
            counter.add_metric([], value)
            yield counter

        self._ttft.fold(stats.ttft.samples, stats.ttft.total)
        self._itl.fold(stats.itl.samples, stats.itl.total)
        yield self._ttft.metric(f"{p}_time_to_first_token_seconds", "Time from arrival to first output token.")
        yield self._itl.metric(f"{p}_inter_token_latency_seconds", "Time between consecutive output tokens.")
