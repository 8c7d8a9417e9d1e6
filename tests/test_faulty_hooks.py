"""Plugin hooks that raise, in every call the machine makes, at every state it can
make it in, as a ResourceHook subclass and as a duck type: the request reaches
RELEASED, every other handle is released, the fault is attributed, and the
engine keeps serving the next request (conftest checks the pools after each)."""

from __future__ import annotations

import anyio
import pytest
from structlog.testing import capture_logs

from engine import Engine, HiSparseConfig, SamplingParams
from helpers import DEADLINE, CountingPool, collect, small_config
from resources import ManualFence, ResourceExhausted, ResourceHook
from states import HELD_STATES, FinishReason, Handle, RequestState

S = RequestState
PROMPT = list(range(3, 23))
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


class _Faulty:
    """One lease per request; `fail` names the call that raises and `at` the state it raises in."""

    name = "faulty"
    before: tuple[str, ...] = ()
    after = ("kv",)
    pool = "faulty_pool"

    def __init__(self, call: str, at: RequestState, error: BaseException) -> None:
        self.call, self.at, self.error = call, at, error
        self.armed = True
        self.acquire_on = frozenset({at if call == "acquire" else S.PREFILLING})
        self.scope = HELD_STATES - ({S.RETRACTED, S.QUEUED} if at is S.RETRACTED and call == "release" else set())
        self.pools = [CountingPool(self.pool, 4)]
        self.fences: list[ManualFence] = []

    def _maybe_fail(self, call: str) -> None:
        if self.armed and call == self.call:
            self.armed = False
            raise self.error

    def acquire(self, request, into):
        if into is self.at:
            self._maybe_fail("acquire")
        self.pools[0].free -= 1
        if self.call == "quarantine":  # a copy of ours that misses its deadline
            self.fences.append(ManualFence("faulty_copy", {self.name}, timeout=0.05))
            request.fences.append(self.fences[-1])
        return Handle(self.name, request.request_id, amount=1)

    def release(self, request, handle):
        self.pools[0].free += 1
        if self.call == "release":
            self._maybe_fail("release")

    def quarantine(self, request, handle):
        self._maybe_fail("quarantine")

    def grow(self, request, handle, num_tokens):
        self._maybe_fail("grow")
        return True


class _FaultySubclass(_Faulty, ResourceHook):
    """The same hook written on the base class (whose __init__ it never calls)."""


#: (call, state it is made in, engine config overrides)
CASES = [
    ("acquire", S.QUEUED, {}),
    ("acquire", S.PREFILLING, {}),
    ("acquire", S.PREBUILT, {}),
    ("acquire", S.DECODING, {}),
    ("acquire", S.STAGING, {"hisparse": HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=2)}),
    ("acquire", S.TRANSFERRING, {"disaggregation": "decode"}),
    ("release", S.RELEASED, {}),
    ("release", S.RETRACTED, {}),
    ("quarantine", S.RELEASED, {}),
    ("grow", S.DECODING, {}),
]
ERRORS = {"bug": RuntimeError("plugin bug"), "exhausted": ResourceExhausted("plugin pool empty")}


def _ids(case) -> str:
    call, state, overrides = case
    return f"{call}-{state.name}" + ("-" + "-".join(sorted(overrides)) if overrides else "")


@pytest.mark.parametrize("kind", [_Faulty, _FaultySubclass], ids=["duck", "subclass"])
@pytest.mark.parametrize("error", list(ERRORS), ids=list(ERRORS))
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
@pytest.mark.asyncio
async def test_a_faulty_hook_never_cuts_a_release_short(kind, error, case):
    """A hook's bug or exhaustion in any call ends or delays only its request; all released, logged, served on."""
    call, state, overrides = case
    hook = kind(call, state, ERRORS[error])
    config = small_config(model="null", resources=(hook,), **overrides)
    if call == "release" and state is S.RETRACTED:  # a pool that makes the second request retract the first
        config = small_config(model="null", resources=(hook,), num_kv_pages=12, page_size=4, max_context=40)
    engine = Engine(config)
    with anyio.fail_after(DEADLINE), capture_logs() as logs:
        async with engine:
            if call == "release" and state is S.RETRACTED:
                streams = [engine.generate(PROMPT[:8], SamplingParams(max_new_tokens=24, ignore_eos=True))
                           for _ in range(2)]
                finals = [(await collect(s))[-1] for s in streams]
            else:
                finals = [await engine.complete(PROMPT, PARAMS, request_id="victim")]
            await engine.wait_idle(DEADLINE)
            after = await engine.complete(PROMPT, PARAMS, request_id="next")
            await engine.wait_idle(DEADLINE)
            report = engine.memory_report()
            if call == "quarantine":
                assert report.pools["faulty_pool"].quarantined == 2  # quarantine is not a leak
                for fence in hook.fences:  # the late copies land: the leases are released then
                    fence.complete()
                while engine.memory_report().pools["faulty_pool"].held:
                    await anyio.sleep(0.01)
    assert not hook.armed, "the fault was never injected: the case does not reach its call"
    assert after.finish_reason is FinishReason.LENGTH and engine.errored is None
    if state is S.RETRACTED:
        assert engine.stats.retractions >= 1
    failed = [e for e in logs if e["event"] == f"resource.{call}_failed"]
    if call in ("release", "quarantine"):  # isolated in the release sequence, whatever the error
        assert failed and failed[0]["resource"] == "faulty" and report.pools["faulty_pool"].suspect
        assert all(f.finish_reason in (FinishReason.LENGTH, FinishReason.ERROR) for f in finals)
    elif error == "exhausted":  # wait and retry: the request completes once the pool answers
        assert finals[0].finish_reason is FinishReason.LENGTH
    else:
        assert finals[0].finish_reason is FinishReason.ERROR and "plugin bug" in finals[0].error
    released = [e for e in logs if e["event"] == "request.transition" and e["dst"] == "RELEASED"]
    assert len(released) >= len(finals) + 1
