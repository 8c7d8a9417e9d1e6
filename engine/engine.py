"""Engine: the public embedded API.

    async with Engine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_new_tokens=8)):
            print(out.new_text, end="")

`generate` validates at once (raising `InvalidRequest` before anything is
allocated) and returns a stream; a client that stops iterating, closes the
stream or is cancelled aborts its request. Leaving `async with` finishes
every request still in flight with SHUTDOWN and releases it, then runs the
leak check (raising `LeakError` itself with `leak_check="raise"`). An
exception raised in the body leaves `async with` as itself (never wrapped in
an ExceptionGroup), after the same shutdown. An engine may be built under
one anyio backend (or none) and entered under another: what needs the
running async library is created on entry.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup
import attrs

from engine.config import EngineConfig, SamplingParams
from engine.errors import EngineClosed, HealthCheckFailed, HealthCheckTimeout, InvalidConfig, InvalidRequest
from engine.logging import ensure_logging
from engine.outputs import RequestOutput
from engine.runtime.assembly import build_parts
from engine.runtime.intake import RequestIntake
from engine.runtime.loop import RuntimeLoop
from engine.runtime.sessions import SessionInfo
from engine.runtime.submit_options import SubmitOptions
from engine.stream import RequestStream
from engine.structured.constraint import Constraint
from engine.testing import FaultInjector
from resources.ledger import LeakError, MemoryReport, check_memory, memory_report
from states import FinishReason, RequestKind, RequestState


@attrs.frozen
class HealthReport:
    """`healthy` unless the engine is dead ("dead"), a pool cannot be checked because
    its `stats()` raises ("unchecked"), its last leak check failed, idle or busy
    ("leaking"), a decode role has no prefill peer up ("no_prefill": it admits
    nothing then), a request is starving for memory ("starved"), or requests are
    live but nothing has progressed for `stuck_after` seconds ("stuck"). `reason`
    is "ok" or which one, `detail` names the pools, peers and requests."""

    healthy: bool
    reason: str
    detail: str = ""
    last_progress_age_s: float | None = None
    live_requests: int = 0
    leaks_found: int = 0


@attrs.frozen
class StructuredCounts:
    """`Engine.structured_stats`: the grammar hook's counts and the compiler's."""

    grammars: Any
    compiles: Any


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, faults: FaultInjector | None = None,
                 **overrides: Any) -> None:
        if config is not None and overrides:
            raise InvalidConfig("Engine(config, **overrides)", "either a config or field overrides, not both",
                                sorted(overrides))
        if faults is not None and not isinstance(faults, FaultInjector):
            raise InvalidConfig("Engine.faults", "None or an engine.testing.FaultInjector", faults)
        self.config = config if config is not None else EngineConfig(**overrides)
        ensure_logging()
        self.parts = build_parts(self.config, faults=faults)
        self.tokenizer = self.parts.tokenizer
        self.model_config = self.parts.model_config
        self.max_context = self.parts.max_context
        self.loop = RuntimeLoop(self.parts, tokenizer=self.tokenizer, max_context=self.max_context,
                               check_memory=self.check_memory, memory_report=self.memory_report)
        self._intake = RequestIntake(tokenizer=self.tokenizer, model=self.parts.model, model_config=self.model_config,
                                     max_context=self.max_context, mm_cache_bytes=self.parts.mm_cache_bytes,
                                     is_live=self.loop.is_live, sessions=self.loop.sessions,
                                     max_queued=self.config.max_queued)
        self._exit: Callable[..., Awaitable[bool | None]] | None = None
        self._task_group: TaskGroup | None = None
        self._running = False
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Engine:
        if self._running or self._closed:
            raise EngineClosed("an Engine can be entered once")
        self._closed = True  # NOTE: entered once, whether or not the start succeeds
        lifetime = self._lifetime()
        engine = await lifetime.__aenter__()
        self._exit = lifetime.__aexit__
        return engine

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        exit_lifetime, self._exit = self._exit, None
        if exit_lifetime is None:
            return None
        return await exit_lifetime(*exc_info)

    @contextlib.asynccontextmanager
    async def _lifetime(self) -> AsyncIterator[Engine]:
        """The engine's tasks, owned for the duration of the `async with` body (anyio's
        `AsyncContextManagerMixin` pattern).

        NOTE: the body's exception never enters the task group, so it leaves `async with` as
        itself (not wrapped in an ExceptionGroup), after every request is finished with
        SHUTDOWN and released, and the tasks have ended. The loop's waiting primitives are
        created here, in the async library that enters the engine, whichever built it."""
        error: BaseException | None = None  # the start's or the body's, re-raised as itself
        self.loop.bind()
        client = self.parts.prefill_client
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group  # NOTE: grammar compiles wait here (structured outputs)
            try:
                if client is not None:
                    await task_group.start(client.run)
                await task_group.start(self.loop.run)
            except BaseException as exc:  # noqa: BLE001 - a start that failed: nothing ran
                error = exc
                task_group.cancel_scope.cancel()
            else:
                self._running = True
                try:
                    yield self
                except BaseException as exc:  # noqa: BLE001 - the body's: re-raised once the tasks are gone
                    error = exc
                finally:
                    self._running = False
                    with anyio.CancelScope(shield=True):
                        await self.loop.shutdown()
                        if client is not None:
                            await client.close()
                    task_group.cancel_scope.cancel()
        if error is not None:
            raise error
        if self.config.leak_check != "off" and self.loop.errored is None:
            try:
                self.check_memory()
            except LeakError:
                if self.config.leak_check == "raise":
                    raise

    @property
    def running(self) -> bool:
        return self._running

    @property
    def prefill_client(self) -> Any:
        """The decode role's prefill client (in-process worker or remote links), else None;
        a remote client's `stats` feed `engine.serve.transfer_metrics.TransferCollector`."""
        return self.parts.prefill_client

    @property
    def errored(self) -> BaseException | None:
        """What killed the loop, if it died (streams then raise `EngineDead`)."""
        return self.loop.errored

    # ------------------------------------------------------------- requests
    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        mm_inputs: Sequence[Any] | None = None,
        kind: RequestKind = RequestKind.NORMAL,
        priority: int = 0,
        deadline: float | None = None,
        session: str | None = None,
        resume_output_ids: Sequence[int] | None = None,
    ) -> RequestStream:
        """Submit a request; returns an async iterator of RequestOutput.

        Issue 21 (`engine.runtime.submit_options`): `priority` (lower runs first),
        `deadline` (seconds from now; then it finishes DEADLINE), `session` (a turn of an
        open session: `prompt` is the turn's new tokens), `resume_output_ids` (continue a
        request from the tokens it already generated; `max_new_tokens` is what is left).

        A request with a `SamplingParams.constraint` whose grammar is not compiled yet
        is live at once but enters the engine when the grammar is ready (compiled in a
        worker thread); one that cannot be compiled is refused before it holds anything,
        and its stream raises `InvalidRequest` (`await stream.ready()` waits for either)."""
        if not self._running:
            raise EngineClosed("the engine is not running (use `async with Engine(...)`)")
        options = SubmitOptions.build(priority=priority, deadline=deadline, session=session,
                                      resume_output_ids=resume_output_ids)
        request_id, requests = self._intake.build(prompt, params, request_id, mm_inputs, kind, options)
        constraint = requests[0].params.constraint
        if constraint is None:
            return self.loop.submit(request_id, requests)
        structured = self.parts.structured
        assert structured is not None  # assembly always installs it (or says why not)
        structured.check_supported()
        compiler = structured.compiler
        assert compiler is not None
        compiler.raise_if_failed(constraint)  # a grammar known not to compile is refused at once
        if compiler.lookup(constraint):
            return self.loop.submit(request_id, requests)
        stream = self.loop.submit(request_id, requests, held=True)
        stream.hold()
        assert self._task_group is not None  # running
        self._task_group.start_soon(self._start_when_compiled, constraint, requests, stream)
        return stream

    async def _start_when_compiled(self, constraint: Constraint, requests: list[Any], stream: RequestStream) -> None:
        compiler = self.parts.structured.compiler if self.parts.structured is not None else None
        assert compiler is not None
        error: InvalidRequest | None = None
        try:
            await compiler.compile(constraint, request_id=stream.request_id)
        except InvalidRequest as exc:
            error = exc
        finally:  # NOTE: also when cancelled at exit: shutdown has finished the requests, the stream ends
            self.loop.start_held(requests, error)
            stream.mark_ready(error)

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       **kwargs: Any) -> RequestOutput:
        """Run a request to the end and return its final output (one sequence: n == 1)."""
        if params is not None and isinstance(params, SamplingParams) and params.n != 1:
            raise InvalidRequest("SamplingParams.n", "1 for complete() (iterate generate() for n > 1)", params.n)
        stream = self.generate(prompt, params, **kwargs)
        stream._final_only()  # NOTE: no wake-up per token for chunks this call discards
        final = None
        async with stream:
            async for output in stream:
                final = output
        assert final is not None and final.finished
        return final

    async def abort(self, request_id: Any) -> bool:
        """Abort a live request. False if the id is unknown, odd or already finished."""
        return self.loop.abort(request_id)

    # ------------------------------------------------------------- sessions (issue 21)
    async def open_session(self, session_id: str | None = None, *, idle_timeout: float | None = None,
                           max_pages: int | None = None) -> str:
        """Open a session whose KV is kept between turns; returns its id. `EngineOverloaded` when
        `max_sessions` are open. See `engine.runtime.sessions`."""
        if not self._running:
            raise EngineClosed("the engine is not running (use `async with Engine(...)`)")
        opened = self.loop.sessions.open(session_id, idle_timeout=idle_timeout, max_pages=max_pages)
        self.loop.wake()  # an idle loop waits with no timeout: its next wait is bounded by this lease
        return opened

    async def close_session(self, session_id: str) -> bool:
        """Close a session (its kept KV is released); False if it is not open. A turn in flight
        keeps running; its KV is then not kept."""
        found = self.loop.sessions.close(session_id)
        if found:
            self.loop.wake()
        return found

    def session_info(self, session_id: str) -> SessionInfo | None:
        """An open session's conversation length, kept KV, lease and whether a turn runs."""
        return self.loop.sessions.info(session_id)

    async def health_check(self, timeout: float = 10.0) -> bool:
        """Run a one-token request through the whole path; True, or HealthCheckFailed."""
        request_id = f"health-{uuid.uuid4().hex[:12]}"
        prompt = [self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else 0]
        try:
            with anyio.fail_after(timeout):
                final = await self.complete(prompt, SamplingParams(max_new_tokens=1, detokenize=False),
                                            request_id=request_id, kind=RequestKind.HEALTH_CHECK)
        except TimeoutError:
            await self.abort(request_id)
            raise HealthCheckTimeout(f"no token within {timeout}s") from None
        if final.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
            raise HealthCheckFailed(f"health check finished with {final.finish_reason}: {final.error}")
        return True

    def health(self, *, stuck_after: float = 30.0) -> HealthReport:
        """Whether the engine is serving, without running a request (see `HealthReport`)."""
        stats = self.loop.stats
        live = self.loop.num_live
        age = None if stats.last_progress is None else time.monotonic() - stats.last_progress
        common: dict[str, Any] = dict(last_progress_age_s=age, live_requests=live, leaks_found=stats.leak_check_failures)
        if self.loop.errored is not None:
            return HealthReport(False, "dead", repr(self.loop.errored), **common)
        unchecked = self.memory_report().unchecked
        if unchecked:
            detail = "; ".join(f"pool {name} cannot be checked: its stats() raised {error}"
                               for name, error in unchecked.items())
            return HealthReport(False, "unchecked", detail, **common)
        if self.loop.last_leak:
            return HealthReport(False, "leaking", "; ".join(self.loop.last_leak), **common)
        no_prefill = None if self.parts.prefill_client is None else self.parts.prefill_client.unavailable()
        if no_prefill is not None:
            return HealthReport(False, "no_prefill", no_prefill, **common)
        starved = self.loop.starved()
        if starved:
            waiting = ", ".join(f"{r['request_id']} (for {', '.join(r.get('waiting_for', ())) or 'memory'})"
                                for r in starved)
            return HealthReport(False, "starved", f"waiting for memory: {waiting}", **common)
        if live and self.loop.num_running and (age is None or age > stuck_after):
            return HealthReport(False, "stuck", f"no step or token for {stuck_after}s", **common)
        return HealthReport(True, "ok", **common)

    def flush_prefix_cache(self) -> tuple[int, int]:
        """Free the prefix cache's pages that no request holds (SGLang's /flush_cache, vLLM's
        /reset_prefix_cache): (pages freed, pages still cached for running requests or sessions)."""
        return self.parts.kv_pool.flush_prefix_cache()

    # --------------------------------------------------------------- memory
    def _report_extra(self) -> dict[str, Any]:
        return dict(live_requests=self.loop.num_live, leaks_found=self.loop.stats.leak_check_failures,
                    last_leak=self.loop.last_leak, starved=self.loop.starved())

    def memory_report(self) -> MemoryReport:
        return memory_report(self.parts.pools, self.parts.ledger, idle=self.idle, **self._report_extra())

    def check_memory(self) -> MemoryReport:
        """Raise LeakError if a pool does not add up, or anything is held while idle."""
        return check_memory(self.parts.pools, self.parts.ledger, idle=self.idle, **self._report_extra())

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until no request is outside RELEASED (aborts and releases are applied)."""
        await self.loop.wait_idle(timeout)

    def requests_by_state(self) -> dict[RequestState, int]:
        """How many requests not yet RELEASED are in each state (a snapshot)."""
        return dict(Counter(request.state for request in self.loop.requests()))

    @property
    def idle(self) -> bool:
        return self.loop.idle

    def expert_distribution(self) -> Any:
        """Routed-expert counts [moe_layers, num_experts] of every released request (MoE models)."""
        if self.parts.expert_distribution is None:
            raise RuntimeError(f"model {self.config.model!r} has no MoE layers")
        return self.parts.expert_distribution.counts.clone()

    @property
    def stats(self) -> Any:
        return self.loop.stats

    @property
    def structured_stats(self) -> Any:
        """Structured output's counts: `grammars` (this engine's constrained sequences and how
        they ended) and `compiles` (compiles and cache hits), or None without llguidance."""
        structured = self.parts.structured
        if structured is None or structured.compiler is None:
            return None
        return StructuredCounts(structured.stats, structured.compiler.stats)
