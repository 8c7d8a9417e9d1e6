"""What structured output did: compiles and cache hits (the compiler's), constrained
requests and how they ended (each engine's grammar hook). Read by `/metrics`."""

from __future__ import annotations

from collections import deque

import attrs

#: compile times kept (the newest); `CompileStats.compiles` counts them all
_SAMPLES = 10_000


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
    #: the latest compile times (seconds); with `compiles`, what a histogram folds (`samples`, `total`)
    compile_seconds: deque[float] = attrs.field(factory=lambda: deque(maxlen=_SAMPLES))

    @property
    def compile_window(self) -> CompileWindow:
        return CompileWindow(self.compile_seconds, self.compiles)


@attrs.frozen
class CompileWindow:
    """Compile times as the metrics' histograms read a window: `samples`, and `total` ever recorded."""

    samples: deque[float]
    total: int


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
