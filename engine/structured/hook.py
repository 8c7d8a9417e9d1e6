"""The `grammar` resource hook: a request's matcher is a handle like its KV pages.

Acquired when the request is admitted (QUEUED -> PREFILLING or
TRANSFERRING), held in every state after (retraction keeps it: the output is
kept, and the matcher is synced to it), released on every finish path by
the machine's one release sequence. Its pool, ``grammar_matchers``, counts
the live matchers, so the leak check sees one that outlived its request.

Acquiring needs the compiled grammar: the engine compiles it before the
request is submitted, so admission finds it cached. A cold cache (a prefill
server's first job for this grammar, or an entry evicted meanwhile) starts
the compile in a worker thread and refuses the move for now
(`ResourceExhausted`: the request waits and is retried); a grammar that
failed to compile refuses it for good (the request ends ERROR). Each
sequence of an n > 1 request copies the compiled matcher for itself.

`check(request, token)` is the loop's per-token check (the finisher calls
it for every sampled token before appending it); it only reads the state
the step's mask left (the runner's masks consume each token when they sync,
off the loop's thread) and says whether the request ends, as a (reason,
error, keep) verdict: STOP when the grammar was complete (its mask allowed
only EOS, so the token is EOS; kept; or the request's last allowed token
completes it), ERROR when the sampler found no
allowed token (-1: a dead end, or a token before it that the grammar
refused; not kept). As with any grammar-constrained engine, a completed
grammar ends with the model's EOS token in `token_ids` (not in the text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog

from engine.structured.compiler import GrammarCompiler
from engine.structured.grammar import GrammarDeadEnd, GrammarError, GrammarViolation
from engine.structured.matcher import GrammarState
from engine.structured.stats import GrammarStats
from resources import PoolUsage, ResourceExhausted, ResourceHook
from states import HELD_STATES, FinishReason, Handle, Request, RequestState

S = RequestState
log = structlog.get_logger("kvlife.structured")
#: (reason, error, keep the token) or None: the token is ordinary
Verdict = tuple[FinishReason, BaseException | None, bool]


class MatcherPool:
    """Live matchers; a bound on them, so a leak shows as held memory that nobody owns."""

    name = "grammar_matchers"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live = 0

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.capacity, free=self.capacity - self.live, unit="matchers")


class GrammarHook(ResourceHook):
    name = "grammar"
    acquire_on = frozenset({S.PREFILLING, S.TRANSFERRING})
    scope = HELD_STATES
    pool = MatcherPool.name

    def __init__(self, compiler: GrammarCompiler, decode: Callable[[Sequence[int]], str], capacity: int,
                 stats: GrammarStats, stop_words: np.ndarray | None = None) -> None:
        self.compiler = compiler
        self.decode = decode
        #: the mask words allowing exactly the model's stop tokens
        self.stop_words = stop_words
        self.matchers = MatcherPool(capacity)
        self.pools = [self.matchers]
        self.stats = stats

    @staticmethod
    def state(request: Request) -> GrammarState | None:
        handle = request.handles.get(GrammarHook.name)
        return None if handle is None else handle.payload

    def acquire(self, request: Request, into: RequestState) -> Handle | None:
        constraint = getattr(request.params, "constraint", None)
        if constraint is None:
            return None
        compiled = self.compiler.cached(constraint)
        if compiled is None:
            failed = self.compiler.failure(constraint)
            if failed is not None:
                raise failed
            self.compiler.compile_in_background(constraint)
            raise ResourceExhausted(f"the grammar of {request.request_id!r} is compiling")
        if self.matchers.live >= self.matchers.capacity:
            raise ResourceExhausted(f"all {self.matchers.capacity} grammar matchers are in use")
        state = GrammarState(compiled.matcher(), constraint, self.decode, self.stop_words)
        if not state.sync(request.output_token_ids):  # a re-prefill's kept output (decode role jobs)
            raise GrammarError(f"the output so far does not match the grammar: {state.error}")
        self.matchers.live += 1
        self.stats.constrained += 1
        return Handle(self.name, request.request_id, state, amount=1)

    def release(self, request: Request, handle: Handle) -> None:
        handle.payload.close()
        self.matchers.live -= 1

    # ------------------------------------------------------------ the loop's check
    def check(self, request: Request, token: int) -> Verdict | None:
        """Whether the request ends with `token` (about to be appended). The matcher consumed
        every earlier token when this step's mask was computed, so this only reads it: -1 (no
        allowed token) ends it ERROR; a grammar that was complete (its mask allowed only EOS)
        ends it STOP with the token."""
        state = self.state(request)
        if state is None:
            return None
        if token < 0:
            reason = state.error or "no token is allowed"
            if state.dead_end or state.error is None:
                self.stats.dead_ends += 1
                log.warning("grammar.dead_end", request_id=request.request_id, reason=reason)
                return FinishReason.ERROR, GrammarDeadEnd(f"the output cannot continue under its grammar: "
                                                          f"{reason}"), False
            self.stats.violations += 1
            log.warning("grammar.violation", request_id=request.request_id, reason=reason)
            return FinishReason.ERROR, GrammarViolation(f"the output left its grammar: {reason}"), False
        if state.done and state.synced_to(request.num_output_tokens):
            self.stats.completed += 1
            return FinishReason.STOP, None, True
        if request.num_output_tokens + 1 >= request.params.max_new_tokens and self._completes(state, request, token):
            self.stats.completed += 1  # the last token the request may take completes the grammar: not LENGTH
            return FinishReason.STOP, None, True
        return None

    @staticmethod
    def _completes(state: GrammarState, request: Request, token: int) -> bool:
        """Whether `token` completes the grammar (consumed here, once per request at most: its last)."""
        if not state.active or not state.sync(request.output_token_ids) or not state.matcher.consume_token(token):
            return False
        state.consumed += 1
        return state.complete
