"""Compiling constraints: off the event loop's thread, within a deadline, cached.

    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab_size, stop_ids, config)
    compiled = await compiler.compile(constraint, request_id="r1")   # InvalidRequest if it cannot
    matcher = compiled.matcher()                                      # a fresh copy per request

A compile builds an llguidance matcher in its initial state (and computes its
first mask, so an unusable grammar is refused here, not mid-output) in one of
`compile_threads` worker threads. `compile` waits at most `compile_timeout`
seconds: past it the request is refused, while the thread (bounded by
llguidance's limits) finishes and caches its result for the next request.
Concurrent requests for one constraint share one compile. Compiled grammars
are cached by `Constraint.key`, least recently used evicted past
`cache_size`; constraints that failed are remembered too (refused at once).

One compiler serves one vocabulary: `for_tokenizer` shares it per tokenizer
object (the decode role's in-process prefill reuses the decode engine's),
and the llguidance vocabulary is built once, by the first compile.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import anyio.to_thread
import structlog

from engine.structured.config import StructuredConfig
from engine.structured.constraint import Constraint
from engine.structured.grammar import GrammarError, grammar_text
from engine.structured.stats import CompileStats
from engine.structured.vocabulary import UnsupportedVocabulary, build_vocabulary
from states.validation import InvalidRequest

log = structlog.get_logger("kvlife.structured")
FIELD = "SamplingParams.constraint"
_FAILURES_KEPT = 256


class CompiledGrammar:
    """A constraint compiled for one vocabulary: a matcher in its initial state, never
    advanced; each request gets a copy."""

    def __init__(self, constraint: Constraint, template: Any, seconds: float) -> None:
        self.constraint = constraint
        self.seconds = seconds
        self._template = template
        self._lock = threading.Lock()

    def matcher(self) -> Any:
        """A fresh matcher at the grammar's start (an llguidance `LLMatcher`)."""
        with self._lock:
            return self._template.deep_copy()


class GrammarCompiler:
    _shared: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
    _shared_lock = threading.Lock()

    def __init__(self, make_vocabulary: Callable[[], Any], config: StructuredConfig) -> None:
        import llguidance

        self._make_vocabulary = make_vocabulary
        self._vocabulary: Any = None
        self._vocabulary_lock = threading.Lock()  # NOTE: not `_lock`: lookups must not wait for a build
        self.config = config
        self.stats = CompileStats()
        self.limits = llguidance.LLParserLimits(max_grammar_size=config.max_grammar_size,
                                                step_max_items=config.step_max_items,
                                                step_lexer_fuel=config.step_lexer_fuel, verbose_errors=False)
        self._lock = threading.Lock()
        self._cache: OrderedDict[Any, CompiledGrammar] = OrderedDict()
        self._failed: OrderedDict[Any, str] = OrderedDict()
        self._inflight: dict[Any, concurrent.futures.Future[CompiledGrammar]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(config.compile_threads,
                                                               thread_name_prefix="kvlife-grammar")
        weakref.finalize(self, self._executor.shutdown, False)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int],
                      config: StructuredConfig) -> GrammarCompiler:
        """The compiler of this tokenizer object, built on first use (raises
        UnsupportedVocabulary for a tokenizer without a vocabulary)."""
        with cls._shared_lock:
            compiler = cls._shared.get(tokenizer)
            if compiler is None or compiler.config != config:
                stops = list(stop_ids)
                compiler = cls(lambda: build_vocabulary(tokenizer, vocab_size, stops), config)
                cls._shared[tokenizer] = compiler
            return compiler

    def vocabulary(self) -> Any:
        """The llguidance vocabulary, built on first use (in a compile thread: it can take a
        second for a large vocabulary)."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                try:
                    self._vocabulary = self._make_vocabulary()
                except (UnsupportedVocabulary, ValueError, RuntimeError) as exc:
                    raise GrammarError(f"the model's vocabulary cannot be read by llguidance: {exc}") from None
            return self._vocabulary

    # ------------------------------------------------------------ lookups
    def cached(self, constraint: Constraint) -> CompiledGrammar | None:
        """The compiled grammar if it is cached (counted nowhere)."""
        with self._lock:
            compiled = self._cache.get(constraint.key)
            if compiled is not None:
                self._cache.move_to_end(constraint.key)
            return compiled

    def lookup(self, constraint: Constraint) -> bool:
        """A submission's lookup, counted: True (a hit) if the grammar is compiled already."""
        hit = self.cached(constraint) is not None
        with self._lock:
            if hit:
                self.stats.cache_hits += 1
            else:
                self.stats.cache_misses += 1
        return hit

    def failure(self, constraint: Constraint) -> GrammarError | None:
        """Why `constraint` failed to compile, if it did."""
        with self._lock:
            reason = self._failed.get(constraint.key)
        return None if reason is None else GrammarError(reason)

    def raise_if_failed(self, constraint: Constraint) -> None:
        """InvalidRequest if `constraint` is known not to compile."""
        failed = self.failure(constraint)
        if failed is not None:
            raise _invalid(constraint, failed)

    # ------------------------------------------------------------ compiling
    async def compile(self, constraint: Constraint, *, request_id: str | None = None) -> CompiledGrammar:
        """The compiled grammar, compiled in a worker thread if needed; `InvalidRequest` naming
        `SamplingParams.constraint` if it is invalid or not ready within `compile_timeout`."""
        compiled = self.cached(constraint)
        if compiled is not None:
            return compiled
        self.raise_if_failed(constraint)
        future = self.compile_in_background(constraint)
        wait = functools.partial(future.result, timeout=self.config.compile_timeout)
        try:
            return await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)
        except concurrent.futures.TimeoutError:
            self.stats.compile_timeouts += 1
            log.warning("grammar.compile_timeout", request_id=request_id, constraint=constraint.describe(),
                        timeout_s=self.config.compile_timeout)
            raise InvalidRequest(FIELD, f"a grammar that compiles within compile_timeout = "
                                 f"{self.config.compile_timeout} s", constraint.describe()) from None
        except GrammarError as exc:
            log.warning("grammar.compile_failed", request_id=request_id, constraint=constraint.describe(),
                        error=str(exc))
            raise _invalid(constraint, exc) from None

    def compile_in_background(self, constraint: Constraint) -> concurrent.futures.Future[CompiledGrammar]:
        """Start compiling `constraint` (or join the compile in flight); the result is cached."""
        key = constraint.key
        with self._lock:
            future = self._inflight.get(key)
            if future is None:
                future = self._executor.submit(self._build, constraint)
                self._inflight[key] = future
        return future

    def _build(self, constraint: Constraint) -> CompiledGrammar:
        """In a worker thread: build, check and cache the matcher (GrammarError if unusable)."""
        from llguidance import LLMatcher

        key = constraint.key
        start = time.perf_counter()
        try:
            matcher = LLMatcher(self.vocabulary(), grammar_text(constraint), log_level=0, limits=self.limits)
            # NOTE: the first mask is computed here: the lexer is built now, off the loop, and a
            # grammar that allows nothing at its start is refused before any request holds it
            first = b"" if matcher.is_error() else matcher.compute_bitmask()
            if matcher.is_error():
                raise GrammarError(_short(matcher.get_error()))
            if not any(first):
                raise GrammarError("no token is allowed at the start of the output")
        except GrammarError as exc:
            with self._lock:
                self._inflight.pop(key, None)
                self._failed[key] = str(exc)
                while len(self._failed) > _FAILURES_KEPT:
                    self._failed.popitem(last=False)
                self.stats.compile_failures += 1
            raise
        seconds = time.perf_counter() - start
        compiled = CompiledGrammar(constraint, matcher, seconds)
        with self._lock:
            self._inflight.pop(key, None)
            self._cache[key] = compiled
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
            self.stats.compiles += 1
            self.stats.compile_seconds.append(seconds)
        return compiled

    def close(self) -> None:
        """Stop the worker threads once the compiles in flight end (nothing waits for them)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _short(message: str, limit: int = 400) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _invalid(constraint: Constraint, error: GrammarError) -> InvalidRequest:
    what = {"json_schema": "a valid JSON schema", "json_object": "a JSON object grammar", "regex": "a valid regex",
            "choice": "a list of choices", "lark": "a valid Lark grammar"}[constraint.kind]
    return InvalidRequest(f"{FIELD}.{constraint.kind}", f"{what} ({error})", constraint.describe())
