"""Structured output in /metrics: grammar compiles (a histogram of their time), cache hits and
misses, constrained requests, and how their grammars ended (completed, dead ends, violations).

Read at scrape time from `engine.structured_stats` (absent without llguidance). Every sample has
the ``model_name`` label, as the engine's own metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.serve.metrics import P, _Folded

COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StructuredCollector(Collector):
    def __init__(self, engine: Any, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._compile = _Folded(f"{P}structured_compile_seconds", "Time to compile a grammar (in a worker thread).",
                                COMPILE_BUCKETS)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counts = self.engine.structured_stats
        if counts is None:
            return
        compiles, grammars = counts.compiles, counts.grammars
        for name, value, doc in (
            ("structured_cache_hits", compiles.cache_hits, "Constrained submissions whose grammar was compiled."),
            ("structured_cache_misses", compiles.cache_misses, "Constrained submissions that waited for a compile."),
            ("structured_compiles", compiles.compiles, "Grammars compiled."),
            ("structured_compile_failures", compiles.compile_failures, "Grammars that did not compile (refused)."),
            ("structured_compile_timeouts", compiles.compile_timeouts,
             "Requests refused because their grammar was not ready within compile_timeout."),
            ("structured_requests", grammars.constrained, "Sequences that held a grammar matcher."),
            ("structured_completed", grammars.completed, "Grammars that completed (the output parses)."),
            ("structured_dead_ends", grammars.dead_ends, "Requests ended because their grammar allowed no token."),
            ("structured_violations", grammars.violations, "Requests ended by a token outside their grammar."),
        ):
            counter = CounterMetricFamily(f"{P}{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        self._compile.fold(compiles.compile_window)
        yield self._compile.metric(self.model_name)
