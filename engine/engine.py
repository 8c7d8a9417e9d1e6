"""Engine: the public embedded API.

    async with Engine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_new_tokens=8)):
            print(out.text)

`generate` validates at once (raising `InvalidRequest` before anything is
allocated) and returns a stream; a client that stops iterating, closes the
stream or is cancelled aborts its request. Leaving `async with` finishes
every request still in flight with SHUTDOWN and releases it.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio

from engine.runtime.assembly import build_parts
from engine.config import EngineConfig, SamplingParams
from engine.errors import EngineClosed, EngineOverloaded, HealthCheckFailed, InvalidConfig, InvalidRequest
from engine.runtime.loop import DecodeLoop
from engine.outputs import RequestOutput
from engine.stream import RequestStream
from engine.testing import FaultInjector
from resources import MemoryReport, check_memory, memory_report
from states import FinishReason, Request, RequestKind, RequestState


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, faults: FaultInjector | None = None,
                 **overrides: Any) -> None:
        if config is not None and overrides:
            raise InvalidConfig("Engine(config, **overrides)", "either a config or field overrides, not both",
                                sorted(overrides))
        if faults is not None and not isinstance(faults, FaultInjector):
            raise InvalidConfig("Engine.faults", "None or an engine.testing.FaultInjector", faults)
        self.config = config if config is not None else EngineConfig(**overrides)
        self.parts = build_parts(self.config, faults=faults)
        self.tokenizer = self.parts.tokenizer
        self.model_config = self.parts.model_config
        self.loop = DecodeLoop(
            machine=self.parts.machine,
            scheduler=self.parts.scheduler,
            runner=self.parts.runner,
            kv_hook=self.parts.kv_hook,
            kv_pool=self.parts.kv_pool,
            stop_ids=frozenset(self.model_config.stop_token_ids),
            max_context=self.config.max_context,
            check_memory=lambda: self.check_memory(),
            leak_check=self.config.leak_check,
            max_queued=self.config.max_queued,
            after_prefill=self.parts.after_prefill,
            admit_into=self.parts.admit_into,
            grow=self.parts.grow,
        )
        self.loop.step_observers.extend(self.parts.step_observers)
        self.loop.make_output = self._make_output
        self.loop.release_observers.append(lambda r: self.parts.ledger.forget_request(r.request_id))
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
            if self.parts.prefill_worker is not None:
                await self._task_group.start(self.parts.prefill_worker.run)
            await self._task_group.start(self.loop.run)
        except BaseException:
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
                await self._drain_prefill_worker()
                if self.config.leak_check != "off" and exc_info[0] is None:
                    try:
                        self.check_memory()
                    except Exception:
                        if self.config.leak_check == "raise":
                            raise
        finally:
            self._task_group.cancel_scope.cancel()
            await self._task_group.__aexit__(*exc_info)
        return None

    async def _drain_prefill_worker(self) -> None:
        """Let the prefill worker finish what it started (its fences bound the wait)."""
        worker = self.parts.prefill_worker
        if worker is None:
            return
        worker.jobs.clear()  # their decode requests are already finished
        while worker.requests:
            worker.release_finished()
            if worker.requests:
                await anyio.sleep(0.005)

    @property
    def running(self) -> bool:
        return self._running

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
        request = self._make_request(prompt, params, request_id, mm_inputs, kind)
        send, receive = anyio.create_memory_object_stream(math.inf)
        loop = self.loop
        try:
            loop.inbox_send.send_nowait(request)
        except anyio.WouldBlock:
            send.close()
            receive.close()
            raise EngineOverloaded(f"{self.config.max_queued} requests already queued") from None
        loop.requests[request.request_id] = request
        if loop.idle_event.is_set():
            loop.idle_event = anyio.Event()
        loop.outputs[request.request_id] = send
        loop.stats.submitted += 1
        loop.wake()
        return RequestStream(request.request_id, receive, self._abandon)

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       **kwargs: Any) -> RequestOutput:
        """Run a request to the end and return its final output."""
        stream = self.generate(prompt, params, **kwargs)
        final = None
        async with stream:
            async for output in stream:
                final = output
        assert final is not None and final.finished
        return final

    async def abort(self, request_id: str) -> bool:
        """Abort a live request. False if the id is unknown or already finished."""
        request = self.loop.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self.loop.pending_aborts.append((request_id, FinishReason.ABORT))
        self.loop.wake()
        return True

    def _abandon(self, request_id: str) -> None:
        """The client stopped listening: abort (safe from any thread or __del__).

        NOTE: a request already released has nothing to abort; queueing one for
        it would leave a stale entry behind while the engine idles."""
        if request_id in self.loop.requests:
            self.loop.pending_aborts.append((request_id, FinishReason.ABORT))

    async def health_check(self, timeout: float = 10.0) -> bool:
        """Run a one-token request through the whole path; True, or HealthCheckFailed."""
        request_id = f"health-{uuid.uuid4().hex[:12]}"
        prompt = [self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else 0]
        try:
            with anyio.fail_after(timeout):
                final = await self.complete(prompt, SamplingParams(max_new_tokens=1), request_id=request_id,
                                            kind=RequestKind.HEALTH_CHECK)
        except TimeoutError:
            await self.abort(request_id)
            raise HealthCheckFailed(f"no token within {timeout}s") from None
        if final.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
            raise HealthCheckFailed(f"health check finished with {final.finish_reason}: {final.error}")
        return True

    # --------------------------------------------------------------- memory
    def memory_report(self) -> MemoryReport:
        return memory_report(self.parts.pools, self.parts.ledger, idle=self.idle,
                             live_requests=len(self.loop.requests))

    def check_memory(self) -> MemoryReport:
        """Raise LeakError if a pool does not add up, or anything is held while idle."""
        return check_memory(self.parts.pools, self.parts.ledger, idle=self.idle,
                            live_requests=len(self.loop.requests))

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until no request is outside RELEASED (aborts and releases are applied)."""
        with anyio.fail_after(timeout):
            while not self.idle:
                if self.loop.requests:
                    await self.loop.idle_event.wait()
                else:  # only the prefill worker's own requests are left
                    await anyio.sleep(0.005)

    def requests_by_state(self) -> dict[RequestState, int]:
        """How many requests not yet RELEASED are in each state (a snapshot)."""
        return dict(Counter(request.state for request in self.loop.requests.values()))

    @property
    def idle(self) -> bool:
        worker = self.parts.prefill_worker
        return not self.loop.requests and (worker is None or not worker.requests)

    def expert_distribution(self):
        """Routed-expert counts [moe_layers, num_experts] of every released request (MoE models)."""
        if self.parts.expert_distribution is None:
            raise RuntimeError(f"model {self.config.model!r} has no MoE layers")
        return self.parts.expert_distribution.counts.clone()

    @property
    def stats(self):
        return self.loop.stats

    # ------------------------------------------------------------ internals
    def _make_request(self, prompt, params, request_id, mm_inputs, kind) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params", "a SamplingParams", params)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt", "a non-empty string or token list", prompt)
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise InvalidRequest("prompt", "a string or a list of token ids", prompt)
        if not token_ids:
            raise InvalidRequest("prompt", "non-empty", prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequest("prompt", f"token ids in [0, {vocab})", bad[0])
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequest("SamplingParams.stop_token_ids", f"token ids in [0, {vocab})", bad[0])
        total = len(token_ids) + params.max_new_tokens
        cfg = self.config
        if total > cfg.max_context:
            raise InvalidRequest("prompt + max_new_tokens", f"<= max_context = {cfg.max_context}", total)
        # NOTE: EngineConfig guarantees max_context <= the whole KV pool, so a
        # request that passed the check above always fits once the pool drains.
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id", "a non-empty string", request_id)
        elif request_id in self.loop.requests:
            raise InvalidRequest("request_id", "unique among requests in flight", request_id)
        if mm_inputs is not None and not isinstance(mm_inputs, (list, tuple)):
            raise InvalidRequest("mm_inputs", "a list of images", type(mm_inputs).__name__)
        images = list(mm_inputs or ())
        if images:
            from engine.model.vision import prepare_images

            token_ids = prepare_images(self.parts.model, self.model_config.image_token_id, token_ids, images)
            if len(token_ids) + params.max_new_tokens > cfg.max_context:
                raise InvalidRequest("prompt + image tokens + max_new_tokens", f"<= max_context = {cfg.max_context}",
                                     len(token_ids) + params.max_new_tokens)
        return Request(request_id, token_ids, params, kind=kind, mm_inputs=images)

    def _make_output(self, request: Request, new_tokens: list[int], final: bool) -> RequestOutput:
        if not final:
            return RequestOutput(request.request_id, new_tokens, list(request.output_token_ids), self.tokenizer)
        now = time.monotonic()
        admitted = request.entered_at(RequestState.PREFILLING) or request.entered_at(RequestState.TRANSFERRING)
        return RequestOutput(
            request.request_id,
            new_tokens,
            list(request.output_token_ids),
            self.tokenizer,
            finished=True,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.extras.get("cached_tokens", 0),
            queue_time=None if admitted is None else admitted - request.arrival_time,
            time_to_first_token=None if request.first_token_time is None
            else request.first_token_time - request.arrival_time,
            completion_time=now - request.arrival_time,
            error=None if request.error is None else repr(request.error),
        )
