"""Random-event testing of a real Engine: the promise "nothing leaks, whatever
happens", attacked by a hypothesis state machine.

Each example draws an engine configuration (tiny pools, so bursts queue and
retract) and runs a random sequence of rules against it: submit (prompt
lengths, greedy or sampled, stop tokens, images), bursts, abort at any
moment (also unknown and finished ids), client disconnect (stream closed or
consumer cancelled), health checks, duplicate ids, drains to idle, and model
steps let through one at a time (`helpers.StepGate`, so a seed
replays the same interleaving). Faults are tagged on requests through the
engine's own `FaultInjector`: the model step raises, a release hook raises,
a transfer fails, a fence misses its deadline.

Invariants, after every rule: the engine is alive, every pool adds up (also
at every single transition), no request was released twice. At idle and at
the end: every request reached RELEASED exactly once, every stream ended
with a final output or an exception (or its client left), nothing is held
except quarantined handles of requests whose fence was made to miss (named
as such by the report), every internal table is empty, and every request
untouched by a fault produced the greedy output it has alone.

Variants: `VARIANTS` maps a name to EngineConfig overrides; adding one is one
line. At import each is built and run once; one that fails is left out of
the state machine (which still runs over the rest) and listed in `EXCLUDED`,
and `TestVariants` fails naming it: never a silent skip. Images are a
per-request option, on when the probe accepts an image.

Profiles: ``KVLIFE_HYPOTHESIS_PROFILE=ci`` (default, derandomized, about a
minute) or ``long`` (see docs/reliability.md); the trio run uses a reduced
profile. Reproduce a long-run failure with ``--hypothesis-seed=N``.
"""

from __future__ import annotations

import logging
import os
import random
import time

import anyio
import pytest
import structlog
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test

from engine import Engine, EngineConfig, HealthCheckFailed, SamplingParams
from hisparse import HiSparseConfig
from states import FinishReason
from helpers import leftovers
from stateful_driver import EngineDriver, Oracle, Rec

MAX_CONTEXT = 40
REF_NEW = 8
BASE = dict(max_context=MAX_CONTEXT, use_entry_points=False, fence_timeout=3.0, leak_check="raise")
VARIANTS = {
    "plain": {},
    "moe": {"model": "tiny-moe"},
    "hisparse": {"hisparse": HiSparseConfig(top_k=8, device_buffer_size=12, recent_window=4)},
    "decode": {"disaggregation": "decode"},
    "hisparse+decode": {"disaggregation": "decode",
                        "hisparse": HiSparseConfig(top_k=8, device_buffer_size=12, recent_window=4)},
    "runs": {"decode_steps": 4},  # decode runs: slots extended for a run, given back when it ends early
    "decode+runs": {"disaggregation": "decode", "decode_steps": 3},
}
_rng = random.Random(6)
_SYSTEM = [_rng.randrange(256) for _ in range(10)]
PROMPTS = [tuple(p) for p in (
    [7], [7, 3], _SYSTEM, _SYSTEM + [1, 2, 3], _SYSTEM + [9] * 6, _SYSTEM[:4] + [200, 201], list(range(40, 64)),
    list(range(40, 52)), [5] * 13, [250, 3, 77, 1, 9, 60], _SYSTEM * 2 + [11], [_rng.randrange(256) for _ in range(17)],
)]
IMAGES = [torch.arange(8 * 8 * 3, dtype=torch.uint8).reshape(8, 8, 3),
          torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))]
FAULTS = [None] * 20 + ["step", "release", "release", "transfer", "stuck", "plugin:acquire", "plugin:busy",
                        "plugin:release", "plugin:grow"]


def _quiet_logs() -> None:
    """Warnings and errors only (not cached: conftest restores the defaults after each test)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        cache_logger_on_first_use=False)


def _probe(overrides: dict, image: bool = False) -> str | None:
    """None if an engine with `overrides` serves one request (with an image); else why not."""
    async def one() -> None:
        config = EngineConfig(**{**BASE, "model": "null", "page_size": 4, "num_kv_pages": 24, **overrides})
        async with Engine(config) as engine:
            with anyio.fail_after(30):
                await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=3),
                                      mm_inputs=[IMAGES[0]] if image else None)
    try:
        anyio.run(one)
    except Exception as exc:  # the variant is not built yet, or broken: excluded, and listed
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


_saved = structlog.get_config()
_quiet_logs()
EXCLUDED = {name: why for name, over in VARIANTS.items() if (why := _probe(over)) is not None}
AVAILABLE = [name for name in VARIANTS if name not in EXCLUDED]
IMAGES_WHY_NOT = _probe({}, image=True)
if IMAGES_WHY_NOT is not None:
    EXCLUDED["images"] = IMAGES_WHY_NOT
structlog.configure(**_saved)

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=list(HealthCheck))
settings.register_profile("kvlife-stateful-ci", max_examples=15, stateful_step_count=30, derandomize=True,
                          database=None, **_COMMON)
settings.register_profile("kvlife-stateful-ci-trio", max_examples=4, stateful_step_count=25, derandomize=True,
                          database=None, **_COMMON)
settings.register_profile("kvlife-stateful-long", max_examples=300, stateful_step_count=60, **_COMMON)
settings.register_profile("kvlife-stateful-long-trio", max_examples=60, stateful_step_count=60, **_COMMON)
PROFILE = os.environ.get("KVLIFE_HYPOTHESIS_PROFILE", "ci")


@st.composite
def engine_configs(draw, variant: str) -> tuple[str, EngineConfig]:
    page_size = draw(st.sampled_from([4, 2, 1, 3, 5]))  # 3 and 5 do not divide any max_context drawn
    max_context = draw(st.sampled_from([MAX_CONTEXT, 37, 33]))
    pages = -(-max_context // page_size)
    fields = dict(BASE, model=draw(st.sampled_from(["null", "null", "tiny"])), page_size=page_size,
                  max_context=max_context,
                  num_kv_pages=draw(st.integers(2 * pages + 1, 3 * pages + 1)), max_running=draw(st.integers(1, 4)),
                  max_prefill_tokens=draw(st.sampled_from([8, 64, 3])), prefix_cache=draw(st.booleans()))
    fields.update(VARIANTS[variant])
    return variant, EngineConfig(**fields)


@st.composite
def request_specs(draw) -> dict:
    sampled = draw(st.integers(0, 4)) == 0
    return dict(
        prompt=draw(st.integers(0, len(PROMPTS) - 1)),
        image=draw(st.sampled_from([None, None, 0, 1])) if "images" not in EXCLUDED else None,
        max_new=draw(st.integers(1, REF_NEW)),
        temperature=draw(st.sampled_from([0.7, 1.3])) if sampled else 0.0,
        seed=draw(st.none() | st.integers(0, 2**20)),
        stop_at=draw(st.none() | st.none() | st.integers(0, REF_NEW - 1)),
        ignore_eos=draw(st.booleans()),
        fault=draw(st.sampled_from(FAULTS)),
        hook=draw(st.integers(0, 15)),
    )


class EngineChaos(RuleBasedStateMachine):
    """One engine per example; see the module docstring for rules and invariants."""

    backend = "asyncio"
    variant_name = "plain"
    examples = requests = 0  # counted per test run, printed by _run
    built: list = []
    oracle: Oracle = None  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.driver: EngineDriver | None = None
        self.count = 0

    @initialize(drawn=st.runner().flatmap(lambda self: engine_configs(self.variant_name)),
                drain_at_end=st.booleans())
    def start(self, drawn, drain_at_end) -> None:
        self.variant, config = drawn
        self.driver = EngineDriver(config, self.backend, drain_at_end=drain_at_end, built=self.built)
        self.budget = 30 if config.model == "null" else 8  # requests per example: the tiny models are slow
        fits = (config.num_kv_pages - 1) // -(-config.max_context // config.page_size)
        self.stuck_budget = min(fits, config.max_running) - 1  # a quarantine keeps pages and a slot forever

    def _key(self) -> tuple:
        return self.variant, self.driver.config.model

    def _reference(self, rec: Rec) -> list[int]:
        return self.oracle.continuation(self._key(), VARIANTS[self.variant] | {"model": self.driver.config.model},
                                        rec.prompt, rec.image)

    def _make(self, spec: dict) -> Rec:
        prompt = PROMPTS[spec["prompt"]]
        image = None if spec["image"] is None else IMAGES[spec["image"]]
        image_tokens = 0 if image is None else (image.shape[0] // 8) * (image.shape[1] // 8)
        max_new = min(spec["max_new"], self.driver.config.max_context - len(prompt) - image_tokens)
        fault, tags = spec["fault"], frozenset()
        if fault == "release":
            tags = frozenset({f"release:{self.driver.hook_names[spec['hook'] % len(self.driver.hook_names)]}"})
        elif fault == "stuck" and self.stuck_budget > 0:
            self.stuck_budget -= 1
            tags = frozenset({"stuck"})
        elif fault is not None and (fault in ("step", "transfer") or fault.startswith("plugin:")):
            tags = frozenset({fault})
        stop = ()
        self.count += 1
        rec = Rec(f"r{self.count}", prompt, image, SamplingParams(), tags)
        if spec["stop_at"] is not None and spec["temperature"] == 0:
            stop = (self._reference(rec)[spec["stop_at"]],)
        rec.params = SamplingParams(max_new_tokens=max_new, temperature=spec["temperature"], seed=spec["seed"],
                                    stop_token_ids=stop, ignore_eos=spec["ignore_eos"])
        return rec

    @precondition(lambda self: self.driver is not None and len(self.driver.recs) < self.budget)
    @rule(spec=request_specs())
    def submit(self, spec) -> None:
        self.driver.submit(self._make(spec))

    @precondition(lambda self: self.driver is not None and len(self.driver.recs) < self.budget)
    @rule(specs=st.lists(request_specs(), min_size=3, max_size=8))
    def burst(self, specs) -> None:
        for spec in specs[: self.budget - len(self.driver.recs)]:
            self.driver.submit(self._make(spec))

    @rule(steps=st.integers(1, 8))
    def run_steps(self, steps) -> None:
        self.driver.run(steps)

    def _pick(self, pick: int, any_rec: bool) -> Rec | None:
        """A request the client still reads (or, with `any_rec`, any submitted one)."""
        recs = [r for r in self.driver.recs.values() if any_rec or not (r.done or r.final)]
        return recs[pick % len(recs)] if recs else None

    @rule(pick=st.integers(0, 10**6), which=st.sampled_from(["live", "live", "any", "unknown"]))
    def abort(self, pick, which) -> None:
        rec = None if which == "unknown" else self._pick(pick, which == "any")
        self.driver.abort(f"unknown-{pick}" if rec is None else rec.request_id)

    @precondition(lambda self: self.driver is not None and self.driver.recs)
    @rule(pick=st.integers(0, 10**6), how=st.sampled_from(["close", "cancel"]), any_rec=st.booleans())
    def disconnect(self, pick, how, any_rec) -> None:
        rec = self._pick(pick, any_rec)
        if rec is not None:
            self.driver.disconnect(rec, how)

    @rule()
    def health_check(self) -> None:
        self.driver.health_check()

    @precondition(lambda self: self.driver is not None and self.driver.recs)
    @rule(pick=st.integers(0, 10**6))
    def duplicate_id(self, pick) -> None:
        self.driver.submit_duplicate(list(self.driver.recs)[pick % len(self.driver.recs)])

    @rule()
    def drain(self) -> None:
        self.driver.drain()
        self.driver.check_idle()

    @invariant()
    def engine_alive_and_pools_add_up(self) -> None:
        if self.driver is not None:
            self.driver.check_now()

    def teardown(self) -> None:
        if self.driver is None:
            return
        type(self).examples += 1
        type(self).requests += len(self.driver.recs)
        self.driver.close()
        for rec in self.driver.recs.values():
            self._check_stream(rec)
        for result in self.driver.health:  # True, unless a step fault or the shutdown ended it
            assert result is True or (isinstance(result, HealthCheckFailed) and (
                self.driver.faults.steps_failed or not self.driver.drain_at_end)), result

    def _check_stream(self, rec: Rec) -> None:
        """The client's view: one final output or an exception, a legal reason, the greedy output alone."""
        final = rec.final
        request = self.driver.requests[rec.request_id]
        if not rec.disconnected:
            assert rec.error is None and final is not None, (rec.request_id, rec.error, rec.outputs[-1:])
            assert [o.finished for o in rec.outputs].count(True) == 1
            assert sum((o.new_token_ids for o in rec.outputs), []) == final.token_ids
        reason = final.finish_reason if final is not None else request.finish_reason
        assert reason is request.finish_reason
        error = repr(request.error)
        allowed = {FinishReason.LENGTH, FinishReason.STOP}
        if rec.aborted or rec.disconnected:
            allowed.add(FinishReason.ABORT)
        if rec.request_id in self.driver.failed_ids or "missed its deadline" in error or "no page" in error:
            allowed |= {FinishReason.ERROR, FinishReason.TRANSFER_FAILED}
        if rec.tags & {"transfer", "stuck"}:
            allowed.add(FinishReason.TRANSFER_FAILED)
        if rec.tags & {"plugin:acquire", "plugin:grow"}:  # a plugin bug finishes its request, nothing else
            allowed.add(FinishReason.ERROR)
        if not self.driver.drain_at_end:
            allowed.add(FinishReason.SHUTDOWN)
        assert reason in allowed, (rec.request_id, reason, error, rec.tags)
        if reason in (FinishReason.LENGTH, FinishReason.STOP) and rec.params.greedy and final is not None:
            self._check_greedy(rec, final, reason)

    def _check_greedy(self, rec: Rec, final, reason) -> None:
        ref = self._reference(rec)
        eos = set(self.driver.engine.model_config.stop_token_ids)
        expected, want = [], FinishReason.LENGTH
        for token in ref[: rec.params.max_new_tokens]:
            expected.append(token)
            if (token in eos and not rec.params.ignore_eos) or token in rec.params.stop_token_ids:
                want = FinishReason.STOP
                break
        got = list(final.token_ids)
        if got != expected:
            i = next(i for i, (a, b) in enumerate(zip(got + [-1], expected + [-1])) if a != b)
            tie = rec.image is None and i < min(len(got), len(expected)) and self.oracle.is_tie(
                self._key(), rec.prompt, got, expected, i)
            assert tie, f"{rec.request_id} {self._key()}: got {got}, alone {expected} (differs at {i})"
            return
        assert reason is want, (rec.request_id, reason, want)


@pytest.fixture(autouse=True)
def quiet_logs():
    _quiet_logs()


@pytest.fixture(scope="module")
def oracle():
    oracle = Oracle(dict(BASE, max_context=64, page_size=4, num_kv_pages=40, max_running=2,
                         max_prefill_tokens=64), REF_NEW)
    yield oracle
    oracle.close()


def _run(backend: str, variant: str, built: list, oracle: Oracle) -> None:
    machine = type(f"EngineChaos_{backend}_{variant}", (EngineChaos,),
                   {"backend": backend, "variant_name": variant, "built": built, "oracle": oracle})
    profile = f"kvlife-stateful-{PROFILE}" + ("-trio" if backend == "trio" else "")
    started = time.perf_counter()
    run_state_machine_as_test(machine, settings=settings.get_profile(profile))
    print(f"stateful {backend}/{variant} [{profile}]: {machine.examples} examples, {machine.requests} requests,"
          f" {time.perf_counter() - started:.1f}s")


class TestFoundByTheStateMachine:
    """Bugs the state machine found, pinned as plain deterministic tests."""

    @pytest.mark.asyncio
    async def test_images_never_share_prefix_pages(self):
        """Two images behind the same placeholder tokens do not reuse each other's KV pages."""
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        fields = dict(BASE, page_size=1, num_kv_pages=64, max_running=2, max_prefill_tokens=64)
        with anyio.fail_after(60):
            async with Engine(EngineConfig(**fields)) as alone:
                want = await alone.complete([7], params, mm_inputs=[IMAGES[1]])
            async with Engine(EngineConfig(**fields)) as engine:
                await engine.complete([7], params, mm_inputs=[IMAGES[1].flip(0)])
                got = await engine.complete([7], params, mm_inputs=[IMAGES[1]])
        assert got.num_cached_tokens == 0 and got.token_ids == want.token_ids

    @pytest.mark.asyncio
    async def test_no_stale_abort_after_release_or_shutdown(self):
        """Closing a stream of a released request, or aborting during shutdown, leaves no queued abort."""
        with anyio.fail_after(60):
            async with Engine(EngineConfig(**BASE, model="null", page_size=4, num_kv_pages=24)) as engine:
                stream = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="done")
                await engine.wait_idle(10)
                await stream.aclose()  # the final output was never read
                assert "aborts" not in leftovers(engine)
                engine.generate([1, 2, 3], SamplingParams(max_new_tokens=30), request_id="late")
                await engine.abort("late")
            assert not leftovers(engine) and engine.idle


class TestVariants:
    def test_variant_table(self):
        """Every variant builds and serves: none is excluded from the state machine."""
        assert EXCLUDED == {}, f"variants that failed to build or serve: {EXCLUDED}"
        assert AVAILABLE == list(VARIANTS)


class TestStatefulEngine:
    @pytest.mark.parametrize("variant", AVAILABLE)
    def test_asyncio(self, variant, assert_engines_leave_pools_whole, oracle):
        """Random rules against real engines on asyncio: nothing leaks, every invariant holds."""
        _run("asyncio", variant, assert_engines_leave_pools_whole, oracle)

    @pytest.mark.parametrize("variant", AVAILABLE)
    def test_trio(self, variant, assert_engines_leave_pools_whole, oracle):
        """A reduced profile of the same state machine on the trio backend."""
        _run("trio", variant, assert_engines_leave_pools_whole, oracle)
