"""Prometheus export of a decode's or a prefill's transfer statistics.

    registry.register(TransferCollector(engine.prefill_client.stats))   # decode, remote prefill
    registry.register(TransferCollector(server.stats))                  # the prefill server

Names are in `engine.disagg.link.observability` (``kvlife:transfer_*``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.disagg import Histogram, TransferStats


class TransferCollector:
    """A prometheus_client collector over a TransferStats."""

    def __init__(self, stats: TransferStats, *, prefix: str = "kvlife:transfer") -> None:
        self.stats = stats
        self.prefix = prefix

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        p, s = self.prefix, self.stats
        with s.lock:
            total = CounterMetricFamily(f"{p}_bytes", "KV bytes moved over prefill/decode links.")
            total.add_metric([], s.bytes)
            jobs = CounterMetricFamily(f"{p}_jobs", "Transfer jobs ended, by outcome.", labels=["outcome"])
            for outcome, n in sorted(s.jobs.items()):
                jobs.add_metric([outcome], n)
            failures = CounterMetricFamily(f"{p}_failures", "Failed transfer jobs, by cause.", labels=["cause"])
            for cause, n in sorted(s.failures.items()):
                failures.add_metric([cause], n)
            refused = CounterMetricFamily(f"{p}_refused", "Link handshakes refused, by cause.", labels=["cause"])
            for cause, n in sorted(s.refused.items()):
                refused.add_metric([cause], n)
            failovers = CounterMetricFamily(f"{p}_failovers", "Jobs re-sent to another prefill when their link "
                                            "went down, by its cause.", labels=["cause"])
            for cause, n in sorted(s.failovers.items()):
                failovers.add_metric([cause], n)
            hists = [self._histogram(f"{p}_seconds", "Transfer wire time: header to KV landed.", s.wire),
                     self._histogram(f"{p}_wait_seconds", "Job submitted to KV landed.", s.wait)]
            up = GaugeMetricFamily(f"{p}_link_up", "1 while the link to a peer is up.", labels=["peer"])
            epoch = GaugeMetricFamily(f"{p}_link_epoch", "The link's current epoch.", labels=["peer"])
            changes = CounterMetricFamily(f"{p}_link_changes", "Links that came up or went down.",
                                          labels=["peer", "change"])
            for peer, state in sorted(s.links.items()):
                up.add_metric([peer], int(state.up))
                epoch.add_metric([peer], state.epoch)
                changes.add_metric([peer, "up"], state.ups)
                changes.add_metric([peer, "down"], state.downs)
        yield from (total, jobs, failures, refused, failovers, *hists, up, epoch, changes)

    @staticmethod
    def _histogram(name: str, doc: str, hist: Histogram) -> Any:
        cumulative, buckets = 0, []
        for bound, count in zip(hist.bounds, hist.counts):
            cumulative += count
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", cumulative + hist.counts[-1]))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist.sum)
