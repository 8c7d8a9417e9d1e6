"""Speculating requests on every finish path leave every pool whole.

A plugin hook that holds one unit of its own pool per token the request covers
(grown with the KV, extended for drafts, rolled back after verification, like the
KV hook's pages) records every acquire, extend, rollback and release. On every
path (length, a stop token inside accepted drafts, abort while a verify step runs,
a failed verify step, a deadline passing mid-decode, retraction under page pressure,
client disconnect, shutdown)
each request acquires and releases its handle exactly once per admission, drafts
were extended and rolled back, and every pool (the KV pages, the draft model's
pages, the plugin's) is whole once idle (the conftest fixture checks it again).
"""

from __future__ import annotations


import anyio
import pytest

from engine import Engine, SamplingParams
from engine.speculative import SpeculativeConfig
from helpers import (CountingPool, assert_pools_whole, calls_by_request, collect, crowd_paths, finish_path_faults,
                     small_config, stream_outcome)
from resources import ResourceExhausted, ResourceHook
from resources.request_slots import KV_SCOPE
from states import FinishReason, Handle, RequestState

S = RequestState
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 2 + [5, 6, 7]
SPECS = {"ngram": SpeculativeConfig(num_tokens=4),
         "draft": SpeculativeConfig(method="draft_model", draft_model="tiny", num_tokens=3)}


class TokenUnits(ResourceHook):
    """One unit of `token_units` per token the request's KV covers; records every call."""

    name = "token_units"
    acquire_on = frozenset({S.PREFILLING})
    scope = KV_SCOPE
    pool = "token_units"

    def __init__(self) -> None:
        self.units = CountingPool("token_units", 100_000, unit="tokens")
        self.pools = [self.units]
        self.events: list[tuple[str, str]] = []

    def _take(self, handle: Handle, num_tokens: int) -> bool:
        need = num_tokens - handle.amount
        if need > self.units.free:
            return False
        if need > 0:
            self.units.free -= need
            handle.amount += need
        return True

    def acquire(self, request, into) -> Handle:
        if request.num_tokens > self.units.free:
            raise ResourceExhausted("no token units")
        self.units.free -= request.num_tokens
        self.events.append((request.request_id, "acquire"))
        return Handle(self.name, request.request_id, None, amount=request.num_tokens)

    def grow(self, request, handle: Handle, num_tokens: int) -> bool:
        return self._take(handle, num_tokens)

    def extend(self, request, handle: Handle, num_tokens: int) -> bool:
        self.events.append((request.request_id, "extend"))
        return self._take(handle, num_tokens)

    def rollback(self, request, handle: Handle, num_tokens: int) -> None:
        self.events.append((request.request_id, "rollback"))
        if handle.amount > num_tokens:
            self.units.free += handle.amount - num_tokens
            handle.amount = num_tokens

    def release(self, request, handle: Handle) -> None:
        self.units.free += handle.amount
        self.events.append((request.request_id, "release"))


async def _drive(engine: Engine, plain_ids: list[int]) -> dict[str, FinishReason]:
    reasons: dict[str, FinishReason] = {}
    ids: dict[str, list[int]] = {}
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)

    async def run(rid: str, params: SamplingParams, disconnect_after: int | None = None, **kwargs) -> None:
        await stream_outcome(engine, PROMPT, params, rid, reasons, disconnect_after=disconnect_after,
                             ids=ids if rid == "stop" else None, **kwargs)

    reasons["length"] = (await engine.complete(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True),
                                               request_id="length")).finish_reason
    await run("error", long)
    await run("abort-verify", long)
    await run("deadline", long, deadline=0.3)  # its steps stall: the deadline passes mid-decode
    await crowd_paths(run, long, plain_ids[6])
    await engine.wait_idle(20)
    reasons["stop-ids"] = ids["stop"]  # type: ignore[assignment]
    return reasons


@pytest.mark.asyncio
@pytest.mark.parametrize("method", sorted(SPECS))
async def test_every_finish_path_gives_every_slot_back(method):
    """Each path: one acquire and one release per admission, drafts extended and rolled back, pools whole."""
    async with Engine(small_config()) as plain_engine:
        plain_ids = (await plain_engine.complete(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))).token_ids
    holder: dict = {}
    hook = TokenUnits()
    faults = finish_path_faults(holder, abort="abort-verify", error="error", at=3)
    # a pool small enough that two long requests retract one another
    config = small_config(speculative=SPECS[method], resources=[hook], num_kv_pages=26, max_context=80,
                          prefix_cache=False)
    engine = holder["engine"] = Engine(config, faults=faults)
    with anyio.fail_after(120):
        async with engine:
            reasons = await _drive(engine, plain_ids)
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=60, ignore_eos=True), request_id="shutdown")
            await stream.__anext__()
        reasons["shutdown"] = (await collect(stream))[-1].finish_reason
    stop_ids = reasons.pop("stop-ids")
    assert stop_ids == plain_ids[: plain_ids.index(plain_ids[6]) + 1]
    assert reasons == {"length": FinishReason.LENGTH, "error": FinishReason.ERROR, "abort-verify": FinishReason.ABORT,
                       "stop": FinishReason.STOP, "retracted": FinishReason.LENGTH, "pressure": FinishReason.LENGTH,
                       "shutdown": FinishReason.SHUTDOWN, "deadline": FinishReason.DEADLINE}
    assert engine.stats.retractions > 0 and engine.stats.spec_accepted_tokens > 0
    calls = calls_by_request(hook.events)
    assert set(calls) == set(reasons) | {"disconnect"}
    for rid, counted in calls.items():
        assert counted["acquire"] == counted["release"] >= 1, (rid, counted)
    assert sum(c["extend"] for c in calls.values()) > 0 and sum(c["rollback"] for c in calls.values()) > 0
    assert hook.units.free == hook.units.capacity
    report = assert_pools_whole(engine)
    assert report.idle and (method != "draft" or "draft_kv_pages" in report.pools)


class ShortUnits(TokenUnits):
    """A per-token pool that never has room for drafts (`extend` False), or whose `extend` raises."""

    def __init__(self, raises: bool) -> None:
        super().__init__()
        self.raises = raises

    def extend(self, request, handle: Handle, num_tokens: int) -> bool:
        self.events.append((request.request_id, "extend"))
        if self.raises:
            raise RuntimeError("a faulty extend")
        return False


@pytest.mark.asyncio
@pytest.mark.parametrize("raises", [False, True], ids=["short", "faulty"])
async def test_no_room_for_drafts_decodes_plainly(raises):
    """A pool short of room for drafts (or a hook whose extend raises) costs the speculation, never the
    request: it decodes plainly, retracts nobody, and what grew is given back."""
    async with Engine(small_config()) as plain_engine:
        plain = (await plain_engine.complete(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True))).token_ids
    hook = ShortUnits(raises)
    async with Engine(small_config(speculative=SPECS["ngram"], resources=[hook])) as engine:
        out = await engine.complete(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert out.token_ids == plain and out.finish_reason is FinishReason.LENGTH
    assert engine.stats.spec_draft_tokens == 0 and engine.stats.retractions == 0
    assert any(what == "extend" for _, what in hook.events) and any(what == "rollback" for _, what in hook.events)
    assert hook.units.free == hook.units.capacity
