"""Prometheus export of a decode's or a prefill's transfer statistics.

    registry.register(TransferCollector(engine.prefill_client.stats, model_name="m"))   # decode, remote prefill
    registry.register(TransferCollector(server.stats, model_name="m"))                  # the prefill server

Names are in `engine.disagg.link.observability` (``kvlife:transfer_*``). With
`model_name` every sample carries a ``model_name`` label, as every other
metric of the server does (docs/http.md); the servers always give it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.disagg import Histogram, TransferStats


class TransferCollector:
    """A prometheus_client collector over a TransferStats."""

    def __init__(self, stats: TransferStats, *, prefix: str = "kvlife:transfer", model_name: str | None = None) -> None:
        self.stats = stats
        self.prefix = prefix
        #: (label names, label values) every sample starts with
        self._base = (["model_name"], [model_name]) if model_name is not None else ([], [])

    def describe(self) -> list:
        return []

    def _family(self, kind: Any, name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return kind(name, doc, labels=[*self._base[0], *labels])

    def collect(self) -> Iterator[Any]:
        p, s, base = self.prefix, self.stats, self._base[1]
        with s.lock:
            total = self._family(CounterMetricFamily, f"{p}_bytes", "KV bytes moved over prefill/decode links.")
            total.add_metric(base, s.bytes)
            jobs = self._family(CounterMetricFamily, f"{p}_jobs", "Transfer jobs ended, by outcome.", ("outcome",))
            for outcome, n in sorted(s.jobs.items()):
                jobs.add_metric([*base, outcome], n)
            failures = self._family(CounterMetricFamily, f"{p}_failures", "Failed transfer jobs, by cause.",
                                    ("cause",))
            for cause, n in sorted(s.failures.items()):
                failures.add_metric([*base, cause], n)
            refused = self._family(CounterMetricFamily, f"{p}_refused", "Link handshakes refused, by cause.",
                                   ("cause",))
            for cause, n in sorted(s.refused.items()):
                refused.add_metric([*base, cause], n)
            failovers = self._family(CounterMetricFamily, f"{p}_failovers", "Jobs re-sent to another prefill when "
                                     "their link went down, by its cause.", ("cause",))
            for cause, n in sorted(s.failovers.items()):
                failovers.add_metric([*base, cause], n)
            hists = [self._histogram(f"{p}_seconds", "Transfer wire time: header to KV landed.", s.wire),
                     self._histogram(f"{p}_wait_seconds", "Job submitted to KV landed.", s.wait)]
            up = self._family(GaugeMetricFamily, f"{p}_link_up", "1 while the link to a peer is up.", ("peer",))
            epoch = self._family(GaugeMetricFamily, f"{p}_link_epoch", "The link's current epoch.", ("peer",))
            changes = self._family(CounterMetricFamily, f"{p}_link_changes", "Links that came up or went down.",
                                   ("peer", "change"))
            for peer, state in sorted(s.links.items()):
                up.add_metric([*base, peer], int(state.up))
                epoch.add_metric([*base, peer], state.epoch)
                changes.add_metric([*base, peer, "up"], state.ups)
                changes.add_metric([*base, peer, "down"], state.downs)
        yield from (total, jobs, failures, refused, failovers, *hists, up, epoch, changes)

    def _histogram(self, name: str, doc: str, hist: Histogram) -> Any:
        cumulative, buckets = 0, []
        for bound, count in zip(hist.bounds, hist.counts):
            cumulative += count
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", cumulative + hist.counts[-1]))
        family = HistogramMetricFamily(name, doc, labels=self._base[0])
        family.add_metric(self._base[1], buckets, sum_value=hist.sum)
        return family
