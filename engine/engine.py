"""Engine: the public embedded API.

    async with Engine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_new_tokens=8)):
            print(out.new_text, end="")

`generate` validates at once (raising `InvalidRequest` before anything is
allocated) and returns a stream; a client that stops iterating, closes the
stream or is cancelled aborts its request. Leaving `async with` finishes
every request still in flight with SHUTDOWN and releases it, then runs the
leak check (raising `LeakError` itself with `leak_check="raise"`).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from engine.config import EngineConfig, SamplingParams
from engine.errors import EngineClosed, HealthCheckFailed, HealthCheckTimeout, InvalidConfig, InvalidRequest
from engine.logging import ensure_logging
from engine.outputs import RequestOutput
from engine.runtime.assembly import build_parts
from engine.runtime.intake import RequestIntake
from engine.runtime.loop import RuntimeLoop
from engine.stream import RequestStream
from engine.testing import FaultInjector
from resources.ledger import LeakError, MemoryReport, check_memory, memory_report
from states import FinishReason, RequestKind, RequestState


@attrs.frozen
class HealthReport:
    """`healthy` unless the engine is dead, its last idle leak check failed, a
    decode role has no prefill peer up (``no_prefill``: it admits nothing
    then), a request is starving for memory, or requests are live but nothing
    has progressed for `stuck_after` seconds. `reason` is "ok" or which one."""

    healthy: bool
    reason: str
    detail: str = ""
    last_progress_age_s: float | None = None
    live_requests: int = 0
    leaks_found: int = 0


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
                                     is_live=self.loop.is_live)
        self._task_group: Any = None
        self._running = False
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Engine:
        if self._running or self._closed:
            raise EngineClosed("an Engine can be entered once")
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        try:
            if self.parts.prefill_client is not None:
                await self._task_group.start(self.parts.prefill_client.run)
            await self._task_group.start(self.loop.run)
        except BaseException:
            self._task_group.cancel_scope.cancel()
            await self._task_group.__aexit__(None, None, None)
            raise
        self._running = True
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self._running = False
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self.loop.shutdown()
                if self.parts.prefill_client is not None:
                    await self.parts.prefill_client.close()
        finally:
            self._task_group.cancel_scope.cancel()
            await self._task_group.__aexit__(*exc_info)
        if self.config.leak_check != "off" and exc_info[0] is None and self.loop.errored is None:
            try:
                self.check_memory()
            except LeakError:
                if self.config.leak_check == "raise":
                    raise
        return None

    @property
    def running(self) -> bool:
        return self._running

    @property
    def prefill_client(self) -> Any:
        """The decode role's prefill client (in-process worker or remote links), else None;
        a remote client's `stats` feed `engine.disagg.link.observability.TransferCollector`."""
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
    ) -> RequestStream:
        """Submit a request; returns an async iterator of RequestOutput."""
        if not self._running:
            raise EngineClosed("the engine is not running (use `async with Engine(...)`)")
        request_id, requests = self._intake.build(prompt, params, request_id, mm_inputs, kind)
        return self.loop.submit(request_id, requests)

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       **kwargs: Any) -> RequestOutput:
        """Run a request to the end and return its final output (one sequence: n == 1)."""
        if params is not None and isinstance(params, SamplingParams) and params.n != 1:
            raise InvalidRequest("SamplingParams.n", "1 for complete() (iterate generate() for n > 1)", params.n)
        stream = self.generate(prompt, params, **kwargs)
        final = None
        async with stream:
            async for output in stream:
                final = output
        assert final is not None and final.finished
        return final

    async def abort(self, request_id: Any) -> bool:
        """Abort a live request. False if the id is unknown, odd or already finished."""
        return self.loop.abort(request_id)

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
        if self.loop.last_leak:
            return HealthReport(False, "leaking", "; ".join(self.loop.last_leak), **common)
        no_prefill = None if self.parts.prefill_client is None else self.parts.prefill_client.unavailable()
        if no_prefill is not None:
            return HealthReport(False, "no_prefill", no_prefill, **common)
        starved = self.loop.starved()
        if starved:
            waiting = ", ".join(record["request_id"] for record in starved)
            return HealthReport(False, "starved", f"waiting for memory: {waiting}", **common)
        if live and self.loop.num_running and (age is None or age > stuck_after):
            return HealthReport(False, "stuck", f"no step or token for {stuck_after}s", **common)
        return HealthReport(True, "ok", **common)

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
