"""Engine counters: transitions per edge, finishes per reason, latencies.

Updated by the decode loop (one transition observer, one call per emitted
token); read by `kvlife run`'s report and the HTTP server's metrics.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

import attrs

from states import Request, RequestKind, RequestState

#: latency samples each window keeps (a long run's memory stops growing once they are full)
SAMPLE_WINDOW = 100_000
_SAMPLES = SAMPLE_WINDOW


class SampleWindow:
    """The latest latency samples (seconds) and how many were ever recorded.

    A scraper folds in the `total - seen` newest samples since its last look;
    the window keeps far more than arrive between two scrapes.
    """

    __slots__ = ("samples", "total")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_SAMPLES)
        self.total = 0

    def add(self, value: float) -> None:
        self.samples.append(value)
        self.total += 1

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100) of the window, nearest-rank; None if empty."""
        return percentile(self.samples, q)


@attrs.define
class EngineStats:
    """Counters by request kind where it matters: health checks never count as
    traffic (tokens, prompt tokens, latencies), only in `finishes`.

    `last_progress` is the monotonic time of the latest model step that
    completed (or failed) or token that was accepted: a health endpoint reads
    "making progress" from it, not from whether a slot is free.
    """

    transitions: Counter[tuple[str, str]] = attrs.field(factory=Counter)  # (src, dst) names -> count
    finishes: Counter[tuple[str, str]] = attrs.field(factory=Counter)  # (kind, reason) names -> count
    submitted: int = 0
    retractions: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted NORMAL requests (each admission once)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # of those, tokens found cached
    leak_checks: int = 0
    leak_check_failures: int = 0
    step_errors: int = 0
    steps: int = 0
    finished_total: int = 0  # requests that reached FINISHED, any kind
    starved: int = 0  # requests reported waiting past the starvation bound
    last_progress: float | None = None
    #: the monotonic time of the latest admission of any request (a health check's included): a request
    #: admitted after a quiet spell has had no chance to make progress yet, so "stuck" counts from here too
    last_admission: float | None = None
    #: speculative decoding: verify steps of a row with drafts, draft tokens verified, accepted
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    #: decode runs (`EngineConfig.decode_steps`): runs started, and the model steps they ran
    decode_runs: int = 0
    decode_run_steps: int = 0
    ttft: SampleWindow = attrs.field(factory=SampleWindow)  # arrival -> first token
    itl: SampleWindow = attrs.field(factory=SampleWindow)  # between consecutive tokens
    e2e: SampleWindow = attrs.field(factory=SampleWindow)  # arrival -> final output
    queue: SampleWindow = attrs.field(factory=SampleWindow)  # arrival -> first admission

    def on_transition(self, request: Request, src: RequestState, dst: RequestState) -> None:
        if request.kind is RequestKind.SESSION:  # issue 21: a session's anchor is not a request of traffic
            return
        self.transitions[(src.name, dst.name)] += 1
        if dst is RequestState.FINISHED and request.finish_reason is not None:
            self.finishes[(request.kind.value, request.finish_reason.name)] += 1
            self.finished_total += 1
            if request.kind is RequestKind.NORMAL and request.history:
                self.e2e.add(request.history[-1][1] - request.arrival_time)
        elif dst is RequestState.RETRACTED:
            self.retractions += 1

    def on_admit(self, request: Request, now: float, cached_tokens: int, queried_tokens: int) -> None:
        """A request's first admission (not a re-admission after retraction)."""
        if request.kind is not RequestKind.NORMAL:
            return
        self.queue.add(now - request.arrival_time)
        self.prompt_tokens += request.num_prompt_tokens
        self.prefix_query_tokens += queried_tokens
        self.prefix_hit_tokens += cached_tokens

    def on_verified(self, proposed: int, accepted: int) -> None:
        """A speculating row verified `proposed` drafts and the model accepted `accepted`."""
        self.spec_verify_steps += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted

    def on_step(self, now: float, steps: int = 1) -> None:
        """`steps` model steps ended (more than 1: a decode run)."""
        self.steps += steps
        self.last_progress = now

    def on_token(self, request: Request, now: float) -> None:
        self.last_progress = now
        last = request.extras.get("last_token_time")
        request.extras["last_token_time"] = now
        if request.kind is not RequestKind.NORMAL:
            return
        self.tokens_generated += 1
        if last is None:
            self.ttft.add(now - request.arrival_time)
        else:
            self.itl.add(now - last)


def percentile(samples: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `samples`, nearest-rank; None if empty."""
    data = sorted(samples)
    if not data:
        return None
    rank = max(0, min(len(data) - 1, int(round(q / 100 * len(data) + 0.5)) - 1))
    return data[rank]
