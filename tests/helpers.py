"""Builders, drivers and checks shared by the engine tests: one way to do each thing.

Tests reach the engine through its public API and these helpers, never
through `engine.loop`'s internals; what a helper reads of them is kept here.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio

from engine import Engine, EngineConfig, MemoryReport, RequestState, SamplingParams
from engine.testing import FaultInjector
from resources import PoolUsage

DEADLINE = 30  # seconds any helper or test waits before it fails the test instead of hanging it
#: the device the suite's engines run on: KVLIFE_TEST_DEVICE (e.g. "cuda"), else the host (docs/gpu.md)
TEST_DEVICE = os.environ.get("KVLIFE_TEST_DEVICE", "cpu")


def small_config(**overrides) -> EngineConfig:
    """A fast engine on the test device: small pools, small pages, the built-in tiny model."""
    fields = dict(page_size=4, num_kv_pages=256, max_running=8, max_context=256, max_prefill_tokens=64,
                  use_entry_points=False, device=TEST_DEVICE)
    fields.update(overrides)
    return EngineConfig(**fields)


class CountingPool:
    """A pool that is a counter of free units; its hook takes and gives them (`free -= 1`)."""

    def __init__(self, name: str, capacity: int, unit: str = "leases") -> None:
        self.name, self.capacity, self.free, self.unit = name, capacity, capacity, unit

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.capacity, free=self.free, unit=self.unit)


class Clock:
    """A hand-set monotonic clock for machines and fences."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ driving
async def collect(stream) -> list:
    """Every output of a stream, in order."""
    return [output async for output in stream]


async def run_all(engine: Engine, prompts: Sequence[Any], max_new_tokens: int, **kwargs: Any) -> list[list[int]]:
    """Greedy token ids of every prompt, all submitted at once (one batch), in prompt order."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    results: list = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = (await engine.complete(prompts[i], params, **kwargs)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


async def stream_outcome(engine: Engine, prompt: Any, params: SamplingParams, request_id: str, reasons: dict,
                         *, disconnect_after: int | None = None, ids: dict | None = None, **kwargs: Any) -> None:
    """Stream one request to its end: its finish reason into `reasons[request_id]` (its token ids into
    `ids[request_id]`); with `disconnect_after`, the client leaves once it has that many tokens."""
    stream = engine.generate(prompt, params, request_id=request_id, **kwargs)
    async with stream:
        async for out in stream:
            if disconnect_after is not None and len(out.token_ids) >= disconnect_after:
                return
            if out.finished:
                reasons[request_id] = out.finish_reason
                if ids is not None:
                    ids[request_id] = out.token_ids


async def crowd_paths(run: Callable[..., Any], long: SamplingParams, stop_id: int) -> None:
    """The finish-path tests' crowd, four requests at once through `run(rid, params, disconnect_after)`:
    "stop" ends on `stop_id`, "disconnect"'s client leaves after 5 tokens, and "retracted" and "pressure"
    (both `long`) retract one another in a small pool."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "stop", SamplingParams(max_new_tokens=30, stop_token_ids=[stop_id]))
        tg.start_soon(run, "disconnect", long, 5)
        tg.start_soon(run, "retracted", long)
        tg.start_soon(run, "pressure", long)


def finish_path_faults(holder: dict, *, abort: str, error: str, at: int) -> FaultInjector:
    """The faults of the finish-path tests: each step of a request named "deadline" stalls 30 ms (its
    deadline passes mid-decode); request `abort` is aborted from inside its `at`-th step (the abort lands
    while the step runs; `holder["engine"]` is the engine), and `error`'s `at`-th step fails."""
    steps: Counter = Counter()

    def stall(ids) -> None:  # runs in the step's thread
        if "deadline" in ids:
            time.sleep(0.03)
        if abort in ids:
            steps[abort] += 1
            if steps[abort] == at:
                holder["engine"].loop.abort(abort)

    def fail(ids) -> bool:
        if error not in ids:
            return False
        steps[error] += 1
        return steps[error] == at

    return FaultInjector(fail_step=fail, stall_step=stall)


def calls_by_request(events: Iterable[tuple[str, str]]) -> dict[str, Counter]:
    """A recording hook's (request id, call) events, counted per request."""
    calls: dict[str, Counter] = {}
    for rid, what in events:
        calls.setdefault(rid, Counter())[what] += 1
    return calls


def live_request(engine: Engine, request_id: str):
    """The live request with this id (one sequence), or None."""
    return next((r for r in engine.loop.requests() if r.request_id == request_id), None)


def live_request_ids(engine: Engine) -> list[str]:
    """The ids of the requests not yet RELEASED (a snapshot)."""
    return [r.request_id for r in engine.loop.requests()]


def finish_as(engine: Engine, request_id: str, reason: Any) -> bool:
    """Finish a live submission with `reason` (a FinishReason) the way the engine does itself (SHUTDOWN:
    as leaving `async with` does to every request in flight); applied at the loop's next iteration."""
    return engine.loop.abort(request_id, reason)


def abort_on_entry(engine: Engine, request_id: str, state: RequestState) -> None:
    """Abort `request_id` when it enters `state`; the loop applies it at its next iteration."""

    def observer(request, src, dst) -> None:
        if request.request_id == request_id and dst is state:
            engine.loop.abort(request_id)

    engine.parts.machine.transition_observers.append(observer)


def finished_from(engine: Engine) -> list[str]:
    """The states requests were finished from so far, by name (each once)."""
    return [src for (src, dst) in engine.stats.transitions if dst == "FINISHED"]


def step_running(engine: Engine) -> bool:
    """Whether a model step is in flight right now."""
    return engine.loop.step_running


def leftovers(engine: Engine) -> dict[str, int]:
    """The loop's tables that still keep something (by size): each must be empty once the engine is idle."""
    sizes = engine.loop.table_sizes()
    sizes.pop("quarantined")  # empties only when a late copy lands: the pool checks cover it
    return {name: size for name, size in sizes.items() if size}


def hisparse_state(engine_or_parts):
    """The HiSparse shared state (host pool, device buffers, copier) of an engine or its parts."""
    parts = getattr(engine_or_parts, "parts", engine_or_parts)
    return next(h for h in parts.machine.hooks if h.name == "hisparse_host").state


class StepGate:
    """A FaultInjector `stall_step` (or `fail_step`, `fail_transfer`: it never fails one) that holds
    the model steps or transfers `match` picks: until opened, or one per permit (`allow`).

    A held call never waits longer than `timeout`, so a forgotten gate slows a
    failing test down instead of hanging it.
    """

    def __init__(self, match: Callable[[Any], bool] = lambda ids: True, timeout: float = 10.0) -> None:
        self._cond = threading.Condition()
        self.match = match
        self.timeout = timeout
        self.permits = self.waiting = self.passed = 0
        self.opened = False
        self.entered = threading.Event()  # a matching call has arrived at the gate

    def __call__(self, ids: Any) -> bool:
        if not self.match(ids):
            return False
        with self._cond:
            self.entered.set()
            self.waiting += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.opened or self.permits > 0, timeout=self.timeout)
            self.waiting -= 1
            if not self.opened and self.permits > 0:
                self.permits -= 1
            self.passed += 1
            self._cond.notify_all()
        return False

    async def wait_entered(self) -> None:
        """Wait (without blocking the event loop) until a matching call is held at the gate."""
        await anyio.to_thread.run_sync(self.entered.wait, DEADLINE)
        assert self.entered.is_set(), f"nothing reached the step gate in {DEADLINE}s"

    async def wait_held(self, passed: int) -> None:
        """Wait (without blocking the event loop, at most `DEADLINE`) until `passed` calls went
        through the gate and the next one is held at it."""
        with anyio.fail_after(DEADLINE):
            while self.passed < passed or not self.waiting:
                await anyio.sleep(0.005)

    def allow(self, n: int) -> None:
        with self._cond:
            self.permits += n
            self._cond.notify_all()

    def revoke(self) -> None:
        with self._cond:
            self.permits = 0

    def set_open(self, opened: bool) -> None:
        with self._cond:
            self.opened = opened
            self._cond.notify_all()

    def open(self) -> None:
        self.set_open(True)

    def open_later(self, seconds: float) -> None:
        """Open from a timer thread, `seconds` from now (e.g. after a cancellation has landed)."""
        timer = threading.Timer(seconds, self.open)
        timer.daemon = True
        timer.start()

    def wait_change(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait(timeout)


# ------------------------------------------------------------------ checks
def assert_pools_whole(engine: Engine, *, quarantined: bool | None = False) -> MemoryReport:
    """Idle with no table keeping anything, every pool adds up, and nothing held but quarantine (named so).

    `quarantined`: whether some memory must be quarantined (True), none may be
    (False), or either (None)."""
    assert engine.idle and not engine.loop.requests(), f"requests in flight: {engine.requests_by_state()}"
    assert not leftovers(engine), f"the loop still keeps {leftovers(engine)}"
    report = engine.check_memory()
    for name, stats in report.pools.items():
        assert stats.adds_up and stats.held == stats.quarantined, (name, stats)
        assert all(owner.quarantined for owner in report.owners[name]), (name, report.owners[name])
    if quarantined is not None:
        assert quarantined == any(s.quarantined for s in report.pools.values()), report.as_dict()
    return report


class PoolWatch:
    """Checks that every pool adds up (free + evictable + held == capacity) at every transition and after
    every model step, on both sides of the decode role, recording what did not.

    Observers are isolated (whatever they raise is only logged), so the watch
    records and the test asserts: `assert_clean()`.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.checks = 0
        self.violations: list[str] = []
        machines = [engine.parts.machine]
        client = engine.parts.prefill_client
        if getattr(client, "machine", None) is not None:
            machines.append(client.machine)
        for machine in machines:
            machine.transition_observers.append(self._on_transition)
        engine.loop.step_observers.append(self._on_step)

    def check(self, where: str) -> None:
        self.checks += 1
        bad = {name: s for name, s in self.engine.memory_report().pools.items() if not s.adds_up}
        if bad:
            self.violations.append(f"{where}: pools do not add up: {bad}")

    def _on_transition(self, request, src: RequestState, dst: RequestState) -> None:
        self.check(f"{request.request_id} {src.name}->{dst.name}")

    def _on_step(self, batch, output) -> None:
        self.check(f"after a step of {[s.request.request_id for s in batch]}")

    def assert_clean(self) -> None:
        assert self.checks > 0, "the pool watch saw no transition"
        assert not self.violations, self.violations[:3]
