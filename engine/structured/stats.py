"""What structured output did: compiles and cache hits (the compiler's), constrained
requests and how they ended (each engine's grammar hook). Read by `/metrics`."""

from __future__ import annotations

from collections import deque

import attrs

_SAMPLES = 10_000


class Samples:
    """The latest samples (seconds) and how many were ever recorded (the shape the
    metrics' histograms fold: `samples`, `total`)."""

    __slots__ = ("samples", "total")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_SAMPLES)
        self.total = 0

    def add(self, value: float) -> None:
        self.samples.append(value)
        self.total += 1


@attrs.define
class CompileStats:
    """A compiler's counts: every lookup is a hit or a miss; a miss compiles (or joins the
    compile in flight for the same constraint)."""

    cache_hits: int = 0
    cache_misses: int = 0
    compiles: int = 0
    #: invalid schemas and grammars (refused, and remembered so they are refused at once)
    compile_failures: int = 0
    #: requests refused because their grammar was not ready within compile_timeout
    compile_timeouts: int = 0
    compile_seconds: Samples = attrs.field(factory=Samples)


@attrs.define
class GrammarStats:
    """An engine's constrained requests (sequences) and how their grammars ended."""

    #: sequences that held a matcher
    constrained: int = 0
    #: grammars that completed (the request ended STOP with output that parses)
    completed: int = 0
    #: requests ended because no token was allowed (`GrammarDeadEnd`)
    dead_ends: int = 0
    #: requests ended because a token outside the grammar arrived (`GrammarViolation`)
    violations: int = 0
