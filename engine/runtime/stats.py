"""Engine counters: transitions per edge, finishes per reason, latencies.

Updated by the decode loop (one transition observer, one call per emitted
token); read by `kvlife run`'s report and the HTTP server's metrics.
"""

from __future__ import annotations

from collections import Counter, deque

import attrs

from states import Request, RequestState

_SAMPLES = 100_000


@attrs.define
class EngineStats:
    transitions: Counter = attrs.field(factory=Counter)  # (src, dst) names -> count
    finishes: Counter = attrs.field(factory=Counter)  # (kind, reason) names -> count
    submitted: int = 0
    retractions: int = 0
    tokens_generated: int = 0
    leak_checks: int = 0
    leak_check_failures: int = 0
    step_errors: int = 0
    ttft: deque = attrs.field(factory=lambda: deque(maxlen=_SAMPLES))
    itl: deque = attrs.field(factory=lambda: deque(maxlen=_SAMPLES))
    ttft_total: int = 0  # samples ever appended to `ttft` (the window keeps the latest)
    itl_total: int = 0  # samples ever appended to `itl`

    def on_transition(self, request: Request, src: RequestState, dst: RequestState) -> None:
        self.transitions[(src.name, dst.name)] += 1
        if dst is RequestState.FINISHED and request.finish_reason is not None:
            self.finishes[(request.kind.value, request.finish_reason.name)] += 1
        elif dst is RequestState.RETRACTED:
            self.retractions += 1

    def on_token(self, request: Request, now: float) -> None:
        self.tokens_generated += 1
        last = request.extras.get("last_token_time")
        if last is None:
            self.ttft.append(now - request.arrival_time)
            self.ttft_total += 1
        else:
            self.itl.append(now - last)
            self.itl_total += 1
        request.extras["last_token_time"] = now


def percentile(samples, q: float) -> float | None:
    """The q-th percentile (0..100) of `samples`, nearest-rank; None if empty."""
    data = sorted(samples)
    if not data:
        return None
    rank = max(0, min(len(data) - 1, int(round(q / 100 * len(data) + 0.5)) - 1))
    return data[rank]
