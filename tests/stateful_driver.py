"""Drive a real Engine from synchronous test code, one model step at a time.

The hypothesis state machine in test_stateful_engine.py is synchronous and
the engine is async, so `EngineDriver` runs the engine in a blocking portal
(its own event-loop thread, asyncio or trio) and offers what the rules need:
submit, abort, disconnect, health checks, and `run(n)`, which lets n model
steps through a `helpers.StepGate` (the engine's documented `FaultInjector.
stall_step` hook point), so a seed replays the same interleaving of rules
and steps. Between rules the engine is parked at the gate or idle. Faults
are tagged on requests; `chaos_plugin.ChaosLease` fails the plugin seam.

It records everything an invariant needs: each request's stream outputs,
each RELEASED transition, every handle ever held, and (`helpers.PoolWatch`)
any pool that did not add up at any transition or step. `Oracle` computes
the greedy output each prompt has alone, in a fresh fault-free engine of the
same variant.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import attrs
from anyio.from_thread import start_blocking_portal

from chaos_plugin import ChaosLease
from engine import Engine, EngineConfig, InvalidRequest, SamplingParams
from engine.model.dense_reference import dense_forward
from engine.testing import FaultInjector
from helpers import PoolWatch, StepGate, assert_pools_whole, live_request, step_running
from states import Handle, RequestState

DEADLINE = 60.0  # seconds any single wait may take before the engine is declared hung
QUIET = 0.1  # seconds without progress (and no step running) that mean "nothing left to step"


@attrs.define(eq=False)
class Rec:
    """One submitted request as its client sees it."""

    request_id: str
    prompt: tuple[int, ...]
    image: Any
    params: SamplingParams
    tags: frozenset[str]
    stream: Any = None
    outputs: list = attrs.Factory(list)
    error: BaseException | None = None
    done: bool = False
    aborted: bool = False
    disconnected: str | None = None
    scope: Any = None

    @property
    def final(self) -> Any:
        return self.outputs[-1] if self.outputs and self.outputs[-1].finished else None


class EngineDriver:
    """One engine in a portal, parked at a step gate between rules."""

    def __init__(self, config: EngineConfig, backend: str, *, drain_at_end: bool, built: list) -> None:
        # NOTE: the decode role's prefill worker runs freely: holding its steps would hold
        # transfers past their fences' (wall-clock) deadlines
        self.gate = StepGate(match=lambda ids: not all(rid.startswith("prefill:") for rid in ids), timeout=DEADLINE)
        self.tags: dict[str, frozenset[str]] = {}
        self.failed_ids: set[str] = set()  # every request id in a batch whose step was made to fail
        self.faults = FaultInjector(stall_step=self.gate, fail_step=self._fail_step,
                                    fail_release_when=self._fail_release, fail_transfer=self._fail_transfer,
                                    stuck_fence_when=lambda fence, rid: "stuck" in self._tags_of(rid))
        self.chaos = ChaosLease(self._tags_of)
        self.config = attrs.evolve(config, resources=(*config.resources, self.chaos))
        self.drain_at_end = drain_at_end
        self.built = built
        self.recs: dict[str, Rec] = {}
        self.health: list[Any] = []  # True or the exception of each finished health check
        self.released: Counter = Counter()  # Request -> RELEASED transitions (ids repeat: a re-prefill's job)
        self.requests: dict[str, Any] = {}
        self.handles: dict[int, Handle] = {}
        self._portal_cm = start_blocking_portal(backend)
        self.portal = self._portal_cm.__enter__()
        self.engine: Engine = self.portal.call(lambda: Engine(self.config, faults=self.faults))
        self.pool_watch = PoolWatch(self.engine)
        machines = [self.engine.parts.machine]
        worker = getattr(self.engine.parts, "prefill_client", None)
        if worker is not None:
            machines.append(worker.machine)
        for machine in machines:
            machine.transition_observers.append(self._observe)
        self.hook_names = [h.name for h in self.engine.parts.machine.hooks]
        self._started = threading.Event()
        self.host = self.portal.start_task_soon(self._host)
        while not self._started.wait(0.01):
            if self.host.done():
                self.host.result()

    # ------------------------------------------------------------ faults
    def _tags_of(self, request_id: str) -> frozenset[str]:
        return self.tags.get(request_id.removeprefix("prefill:"), frozenset())

    def _fail_step(self, request_ids) -> bool:
        if any("step" in self._tags_of(rid) for rid in request_ids):
            self.failed_ids.update(rid.removeprefix("prefill:") for rid in request_ids)
            return True
        return False

    def _fail_release(self, hook: str, request_id: str) -> bool:
        return f"release:{hook}" in self._tags_of(request_id)

    def _fail_transfer(self, request_id: str) -> bool:
        return "transfer" in self._tags_of(request_id)

    # ------------------------------------------------------ in the loop thread
    async def _host(self) -> None:
        async with anyio.create_task_group() as tg:
            self.tg = tg
            async with self.engine:
                self._stop = anyio.Event()
                self._started.set()
                await self._stop.wait()
                if self.drain_at_end:
                    await self.engine.wait_idle(DEADLINE)

    def _observe(self, request, src: RequestState, dst: RequestState) -> None:
        rid = request.request_id
        self.requests[rid] = request
        for handle in request.handles.values():
            self.handles[id(handle)] = handle
        if dst is RequestState.RELEASED:
            self.released[request] += 1

    async def _consume(self, rec: Rec) -> None:
        with anyio.CancelScope() as rec.scope:
            try:
                async with rec.stream:
                    async for output in rec.stream:
                        rec.outputs.append(output)
            except Exception as exc:  # the stream was closed under the client
                rec.error = exc
        rec.done = True

    async def _health(self) -> None:
        try:
            self.health.append(await self.engine.health_check(timeout=DEADLINE))
        except Exception as exc:
            self.health.append(exc)

    def _submit(self, rec: Rec) -> None:
        mm = [rec.image] if rec.image is not None else None
        rec.stream = self.engine.generate(list(rec.prompt), rec.params, request_id=rec.request_id, mm_inputs=mm)
        self.tg.start_soon(self._consume, rec)

    async def _abort(self, request_id: str) -> tuple[bool, bool]:
        """(what abort() returned, whether the request was live): one step of the loop thread."""
        request = live_request(self.engine, request_id)
        expected = request is not None and not request.is_finished
        return await self.engine.abort(request_id), expected

    def _snapshot(self) -> tuple:
        engine = self.engine
        return engine.idle, step_running(engine), sum(engine.stats.transitions.values()), self.gate.passed

    # --------------------------------------------------- rules (test thread)
    def submit(self, rec: Rec) -> None:
        self.tags[rec.request_id] = rec.tags
        self.portal.call(self._submit, rec)
        self.recs[rec.request_id] = rec

    def abort(self, request_id: str) -> None:
        got, expected = self.portal.call(self._abort, request_id)
        assert got is expected, f"abort({request_id!r}) returned {got}, expected {expected}"
        if request_id in self.recs and got:
            self.recs[request_id].aborted = True

    def disconnect(self, rec: Rec, how: str) -> None:
        rec.disconnected = rec.disconnected or how
        self.portal.call(rec.scope.cancel if how == "cancel" else rec.stream.abandon)

    def submit_duplicate(self, request_id: str) -> None:
        """A second request with the id of one still in flight is refused, and changes nothing."""
        self.portal.call(self._duplicate, request_id)

    def _duplicate(self, request_id: str) -> None:
        if not self.engine.loop.is_live(request_id):
            return
        before = len(self.engine.loop.requests())
        try:
            self.engine.generate([1, 2], request_id=request_id)
        except InvalidRequest as exc:
            assert "unique among requests in flight" in str(exc)
        else:
            raise AssertionError(f"a duplicate of {request_id!r} in flight was accepted")
        assert len(self.engine.loop.requests()) == before

    def health_check(self) -> None:
        self.portal.call(self._spawn, self._health)

    def _spawn(self, func: Callable, *args: Any) -> None:
        self.tg.start_soon(func, *args)  # NOTE: start_soon's task handle is awaitable; portal.call would await it

    def run(self, steps: int) -> None:
        """Let up to `steps` model steps through, then wait until the engine is parked or idle."""
        for _ in range(steps):
            before = self.gate.passed
            self.gate.allow(1)
            if not self._wait_until(lambda: self.gate.passed > before):
                self.gate.revoke()  # nothing wanted to step
                break
        self._wait_until(lambda: self.gate.waiting > 0 and self.gate.permits == 0)

    def _wait_until(self, done: Callable[[], bool]) -> bool:
        """True once done(); False if the engine went idle or quiet first; AssertionError if hung."""
        deadline = time.monotonic() + DEADLINE
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            if done():
                return True
            self.raise_if_crashed()
            snap = self.portal.call(self._snapshot)
            if snap[0]:
                return done()
            if snap != last:
                last, since = snap, time.monotonic()
            elif not snap[1] and time.monotonic() - since > QUIET:
                return done()
            self.gate.wait_change(0.002)
        raise AssertionError(f"engine hung for {DEADLINE}s: {self.portal.call(self.engine.requests_by_state)}")

    def drain(self) -> None:
        """Let every step through until the engine is idle, then close the gate again."""
        self.gate.set_open(True)
        try:
            self.portal.call(self._wait_idle)
        except AssertionError:
            self.raise_if_crashed()
            raise
        finally:
            self.gate.set_open(False)

    async def _wait_idle(self) -> None:
        try:
            await self.engine.wait_idle(DEADLINE)
            with anyio.fail_after(DEADLINE):
                while not all(r.done for r in self.recs.values()):
                    await anyio.sleep(0.001)
        except TimeoutError:
            prefill = getattr(self.engine.parts, "prefill_client", None)
            live = None if prefill is None else [repr(r) for r in prefill.loop.requests()]
            raise AssertionError(f"not idle after {DEADLINE}s: {self.engine.requests_by_state()}, "
                                 f"{self.engine.memory_report().as_dict()}, prefill requests {live}") from None

    # ------------------------------------------------------------ checks
    def raise_if_crashed(self) -> None:
        if self.host.done():
            self.host.result()
            raise AssertionError("the engine exited while the test was running")

    def check_now(self) -> None:
        """After every rule: the engine runs, every pool adds up, nothing was released twice."""
        self.raise_if_crashed()
        assert not self.pool_watch.violations, self.pool_watch.violations[:3]
        twice = [r.request_id for r, n in self.released.items() if n > 1]
        assert not twice, f"released more than once: {twice}"
        report = self.portal.call(self.engine.memory_report)
        assert all(s.adds_up for s in report.pools.values()), report.as_dict()

    def check_idle(self) -> None:
        """At idle: nothing held but quarantine, no internal table keeps a request, each released once."""
        self.portal.call(self._check_idle)

    def _check_idle(self) -> None:
        engine = self.engine
        report = assert_pools_whole(engine, quarantined=None)  # no table of the loop keeps anything either
        stuck = {rid for rid, tags in self.tags.items() if "stuck" in tags}
        for owners in report.owners.values():  # quarantined, and only what a stuck fence protects
            assert all(o.request_id.removeprefix("prefill:") in stuck for o in owners), [o.describe() for o in owners]
        suspects = {n for n, s in report.pools.items() if s.suspect}
        assert not suspects or any(t.startswith("release:") or t == "plugin:release"
                                   for ts in self.tags.values() for t in ts), suspects
        assert engine.stats.leak_check_failures == 0
        for rid in self.recs:
            times = self.released[self.requests[rid]]
            assert times == 1, f"{rid} released {times} times"
        held = [h for h in self.handles.values() if h.held]
        assert not held, f"handles still held at idle: {held[:5]}"
        bad_quarantine = [h for h in self.handles.values()
                          if h.status == Handle.QUARANTINED and h.request_id.removeprefix("prefill:") not in stuck]
        assert not bad_quarantine, bad_quarantine[:5]

    def close(self) -> None:
        """Stop the engine (draining first or not), then check what every client saw."""
        self.gate.set_open(True)
        try:
            if self.drain_at_end:
                self.drain()
                self.gate.set_open(True)
                self.check_idle()
            self.portal.call(self._stop.set)
            self.host.result(timeout=DEADLINE)
            self.check_idle()
        finally:
            self.gate.set_open(True)
            if not self.host.done():
                self.portal.call(self._stop.set)
            self._portal_cm.__exit__(None, None, None)
        if self.engine in self.built:  # checked above, and more strictly than conftest's fixture would
            self.built.remove(self.engine)


class Oracle:
    """Greedy continuations computed alone, one request at a time, in a fault-free engine per key."""

    def __init__(self, reference_fields: dict, new_tokens: int) -> None:
        self.fields = reference_fields
        self.new_tokens = new_tokens
        self.cache: dict[tuple, list[int]] = {}
        self._engines: dict[tuple, tuple[Engine, Any]] = {}
        self._portal_cm = None

    def continuation(self, key: tuple, overrides: dict, prompt: tuple[int, ...], image: Any) -> list[int]:
        image_key = None if image is None else tuple(image.shape)
        cache_key = (key, prompt, image_key)
        if cache_key not in self.cache:
            engine = self._engine(key, overrides)
            params = SamplingParams(max_new_tokens=self.new_tokens, ignore_eos=True)
            mm = None if image is None else [image]
            final = self.portal.call(lambda: engine.complete(list(prompt), params, mm_inputs=mm))
            self.cache[cache_key] = list(final.token_ids)
        return self.cache[cache_key]

    def is_tie(self, key: tuple, prompt: tuple[int, ...], got: list[int], expected: list[int], i: int) -> bool:
        """Whether position i's two candidates are within float noise of each other (dense logits)."""
        engine = self._engines[key][0]
        logits = dense_forward(engine.parts.model, list(prompt) + got[:i])[-1]
        return abs(float(logits[got[i]] - logits[expected[i]])) < 1e-3 * max(1.0, float(logits.abs().max()))

    def _engine(self, key: tuple, overrides: dict) -> Engine:
        if self._portal_cm is None:
            self._portal_cm = start_blocking_portal("asyncio")
            self.portal = self._portal_cm.__enter__()
        if key not in self._engines:
            engine = self.portal.call(Engine, EngineConfig(**{**self.fields, **overrides}))
            cm = self.portal.wrap_async_context_manager(engine)
            cm.__enter__()
            self._engines[key] = (engine, cm)
        return self._engines[key][0]

    def close(self) -> None:
        for _engine, cm in self._engines.values():
            cm.__exit__(None, None, None)
        self._engines.clear()
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None
