"""Transfer counters, latency histograms and link states.

`TransferStats` is written by link threads and read at scrape time (one
lock); `engine.serve.transfer_metrics.TransferCollector` exports it to
Prometheus (``kvlife:transfer_*``; labels lower case):

    bytes_total                     KV bytes received (decode) or sent (prefill)
    jobs_total{outcome}             jobs ended: ok, failed, cancelled
    failures_total{cause}           failed jobs by cause (engine.disagg.link.transport.CAUSES)
    seconds                         histogram: first KV byte expected -> landed (the wire)
    wait_seconds                    histogram: submitted -> landed (compute and queueing too)
    link_up{peer}, link_epoch{peer} gauges; link_changes_total{peer, change}
    refused_total{cause}            handshakes refused (auth, incompatible)
    failovers_total{cause}          jobs re-sent to another peer when their link went down, by its cause
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

import attrs

WIRE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@attrs.define
class LinkState:
    up: bool = False
    epoch: int = 0
    boot: str = ""
    ups: int = 0
    downs: int = 0
    last_cause: str = ""
    #: what carries the chunks of its current (or last) epoch: "socket", "gloo" or "nccl"
    transport: str = ""


class TransferStats:
    """Counters of one side's links (see the module docstring)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.lock = threading.Lock()
        self.bytes = 0
        self.jobs: dict[str, int] = {"ok": 0, "failed": 0, "cancelled": 0}
        self.failures: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.failovers: dict[str, int] = {}
        self.wire = Histogram(WIRE_BUCKETS)
        self.wait = Histogram(WAIT_BUCKETS)
        self.links: dict[str, LinkState] = {}

    def link_up(self, peer: str, epoch: int, boot: str, transport: str = "") -> None:
        with self.lock:
            state = self.links.setdefault(peer, LinkState())
            state.up, state.epoch, state.boot, state.transport = True, epoch, boot, transport
            state.ups += 1

    def link_down(self, peer: str, cause: str) -> None:
        with self.lock:
            state = self.links.setdefault(peer, LinkState())
            if state.up:
                state.downs += 1
            state.up, state.last_cause = False, cause

    def job_ok(self, nbytes: int, wire_s: float | None, wait_s: float | None) -> None:
        with self.lock:
            self.jobs["ok"] += 1
            self.bytes += nbytes
            if wire_s is not None:
                self.wire.observe(wire_s)
            if wait_s is not None:
                self.wait.observe(wait_s)

    def job_failed(self, cause: str) -> None:
        with self.lock:
            self.jobs["failed"] += 1
            self.failures[cause] = self.failures.get(cause, 0) + 1

    def job_cancelled(self) -> None:
        with self.lock:
            self.jobs["cancelled"] += 1

    def count_refused(self, cause: str) -> None:
        with self.lock:
            self.refused[cause] = self.refused.get(cause, 0) + 1

    def count_failover(self, cause: str) -> None:
        with self.lock:
            self.failovers[cause] = self.failovers.get(cause, 0) + 1

    def links_up(self) -> int:
        with self.lock:
            return sum(1 for s in self.links.values() if s.up)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy (for /debug pages and tests)."""
        with self.lock:
            return {
                "role": self.role, "bytes": self.bytes, "jobs": dict(self.jobs), "failures": dict(self.failures),
                "refused": dict(self.refused), "failovers": dict(self.failovers),
                "links": {peer: attrs.asdict(state) for peer, state in self.links.items()},
            }
