"""Sessions (issue 21): turns whose KV is kept, so only new tokens are computed; a lease released
through the machine; every hazard leaves the session's KV intact for the next turn or released,
never locked and unowned, with the pages accounted and the idle leak check clean."""

from __future__ import annotations

import time

import anyio
import pytest

from engine import Engine, EngineOverloaded, InvalidRequest, SamplingParams
from engine.model.tokenizer import ByteTokenizer
from engine.runtime.intake import RequestIntake
from engine.runtime.submit_options import SubmitOptions
from engine.testing import FaultInjector
from helpers import DEADLINE, assert_pools_whole, collect, live_request, small_config
from states import FinishReason, RequestKind, RequestState

S = RequestState
P1, P2, P3 = [5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [70, 71, 72, 73, 74]
TURN = SamplingParams(max_new_tokens=6, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=60, ignore_eos=True)


class Computed:
    """Prompt tokens each request had computed by the model (prefill rows), by request id."""

    def __init__(self, engine: Engine) -> None:
        self.prompt_tokens: dict[str, int] = {}
        engine.loop.step_observers.append(self._on_step)

    def _on_step(self, batch, output) -> None:
        for s in batch:
            n = min(s.start + s.num_tokens, s.request.num_prompt_tokens) - s.start
            if n > 0:
                self.prompt_tokens[s.request.request_id] = self.prompt_tokens.get(s.request.request_id, 0) + n


def _slow(seconds: float = 0.01) -> FaultInjector:
    return FaultInjector(stall_step=lambda ids: time.sleep(seconds))


def assert_accounted(engine: Engine, sessions: dict[str, int]) -> None:
    """Idle, the leak check clean; what is held is exactly the open sessions' kept pages and slots,
    and the memory report names each session as their owner."""
    assert engine.idle
    report = engine.check_memory()  # raises LeakError otherwise
    kv, slots = report.pools["kv_pages"], report.pools["sessions"]
    assert kv.held == kv.kept and slots.held == slots.kept == len(sessions)
    if len(sessions) == 1:
        assert kv.kept == engine.session_info(next(iter(sessions))).kept_pages
    owners = {o.request_id: o.amount for o in report.owners["kv_pages"]}
    assert owners == {f"session:{sid}": pages for sid, pages in sessions.items() if pages}
    assert {o.request_id for o in report.owners["sessions"]} == {f"session:{sid}" for sid in sessions}


async def _turn(engine: Engine, sid: str, prompt, params=TURN, **kwargs):
    return await engine.complete(prompt, params, session=sid, **kwargs)


class TestTurns:
    @pytest.mark.anyio
    @pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache-on", "cache-off"])
    async def test_three_turns_equal_the_one_shot_prompt_computing_only_new_tokens(self, prefix_cache):
        """Turn 3 equals the one-shot greedy output of the whole conversation; each later turn computes
        only its new tokens and the previous turn's last token (page size 1: nothing else)."""
        config = small_config(page_size=1, num_kv_pages=512, max_context=256, prefix_cache=prefix_cache)
        with anyio.fail_after(DEADLINE):
            async with Engine(config) as engine:
                computed = Computed(engine)
                sid = await engine.open_session()
                t1 = await _turn(engine, sid, P1, request_id="t1")
                t2 = await _turn(engine, sid, P2, request_id="t2")
                t3 = await _turn(engine, sid, P3, request_id="t3")
                conversation = P1 + t1.token_ids + P2 + t2.token_ids + P3
                assert engine.session_info(sid).num_tokens == len(conversation) + len(t3.token_ids)
                await engine.wait_idle(DEADLINE)
                kept = engine.session_info(sid).kept_pages
                assert_accounted(engine, {sid: kept})
                assert await engine.close_session(sid)
        async with Engine(config) as fresh:
            one_shot = await fresh.complete(conversation, TURN, request_id="one")
            fresh_computed = Computed(fresh)
            await fresh.complete(conversation, TURN, request_id="again")
        assert t3.token_ids == one_shot.token_ids
        assert computed.prompt_tokens["t1"] == len(P1)
        assert computed.prompt_tokens["t2"] == len(P2) + 1 and t2.num_cached_tokens == len(P1) + len(t1.token_ids) - 1
        assert computed.prompt_tokens["t3"] == len(P3) + 1
        assert kept == len(conversation) + len(t3.token_ids) - 1
        if not prefix_cache:  # the session's KV rode on the cache; other requests still compute it all
            assert fresh_computed.prompt_tokens["again"] == len(conversation)

    @pytest.mark.anyio
    async def test_whole_pages_are_kept(self):
        """With pages of 4 a turn recomputes at most the last partial page of what came before."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config()) as engine:
                computed = Computed(engine)
                sid = await engine.open_session()
                t1 = await _turn(engine, sid, P1)
                await _turn(engine, sid, P2, request_id="t2")
                context = len(P1) + len(t1.token_ids)
                await engine.wait_idle(DEADLINE)
                assert_accounted(engine, {sid: engine.session_info(sid).kept_pages})
        assert computed.prompt_tokens["t2"] == len(P2) + context - 4 * ((context - 1) // 4)

    @pytest.mark.anyio
    async def test_text_turns_add_no_bos_mid_conversation(self):
        """The first text turn is tokenized as any prompt (BOS first); later ones without special tokens."""
        tokenizer = ByteTokenizer(add_bos=True)
        async with Engine(small_config()) as engine:
            intake = RequestIntake(tokenizer=tokenizer, model=engine.parts.model, model_config=engine.model_config,
                                   max_context=engine.max_context, mm_cache_bytes=None, is_live=lambda rid: False,
                                   sessions=engine.loop.sessions)
            sid = await engine.open_session()
            _, [first] = intake.build("Hi", TURN, None, None, RequestKind.NORMAL, SubmitOptions(session=sid))
            out = await _turn(engine, sid, first.prompt_token_ids)
            _, [second] = intake.build(" you", TURN, None, None, RequestKind.NORMAL, SubmitOptions(session=sid))
        assert first.prompt_token_ids == [tokenizer.bos_token_id, *b"Hi"]
        assert second.prompt_token_ids == first.prompt_token_ids + out.token_ids + list(b" you")

    @pytest.mark.anyio
    async def test_sessions_sharing_a_prefix_are_counted_once(self):
        """Two sessions over the same first prompt share its pages: kept counts them once, and closing
        one leaves the other's whole path locked."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config()) as engine:
                a, b = await engine.open_session(), await engine.open_session()
                shared = list(range(20, 36))  # four whole pages
                await _turn(engine, a, shared + [1])
                await _turn(engine, b, shared + [2])
                await engine.wait_idle(DEADLINE)
                both = engine.check_memory().pools["kv_pages"]
                pages = {sid: engine.session_info(sid).kept_pages for sid in (a, b)}
                assert_accounted(engine, pages)
                await engine.close_session(a)
                while engine.session_info(a) is not None:
                    await anyio.sleep(0.005)
                assert_accounted(engine, {b: pages[b]})
                left = engine.check_memory().pools["kv_pages"]
        assert both.kept == pages[a] + pages[b] - 4 and left.kept == pages[b]

    @pytest.mark.anyio
    async def test_one_turn_at_a_time(self):
        """A second turn while one is in flight is refused with a clear error; after it, it runs."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null"), faults=_slow()) as engine:
                sid = await engine.open_session()
                stream = engine.generate(P1, LONG, session=sid, request_id="first")
                with pytest.raises(InvalidRequest) as info:
                    engine.generate(P2, TURN, session=sid)
                await collect(stream)
                assert (await _turn(engine, sid, P2)).finish_reason is FinishReason.LENGTH
        assert info.value.field == "session" and "one turn at a time" in str(info.value)

    @pytest.mark.anyio
    async def test_page_budget(self):
        """A session locks at most its page budget; the rest of its context is only evictable cache."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config()) as engine:
                sid = await engine.open_session(max_pages=2)
                await _turn(engine, sid, P1 + P2)
                await engine.wait_idle(DEADLINE)
                assert engine.session_info(sid).kept_pages == 2
                assert_accounted(engine, {sid: 2})
                evictable = engine.memory_report().pools["kv_pages"].evictable
                second = await _turn(engine, sid, P3)
        whole_pages = (len(P1 + P2) + TURN.max_new_tokens - 1) // 4  # what the first turn's KV filled
        assert evictable == whole_pages - 2 > 0 and second.num_cached_tokens >= 8

    @pytest.mark.anyio
    async def test_bad_turns_and_limits(self):
        """Unknown sessions, n > 1, images, an over-long conversation and too many sessions are refused."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(max_sessions=2, max_context=64)) as engine:
                a, b = await engine.open_session("a"), await engine.open_session()
                with pytest.raises(EngineOverloaded):
                    await engine.open_session()
                with pytest.raises(InvalidRequest) as duplicate:
                    await engine.open_session("a")
                assert await engine.close_session(b) and not await engine.close_session(b)
                errors = {}
                for name, call in {
                    "unknown": lambda: engine.generate(P1, TURN, session="nope"),
                    "n": lambda: engine.generate(P1, SamplingParams(n=2), session=a),
                    "long": lambda: engine.generate(list(range(1, 60)), TURN, session=a),
                    "resume": lambda: engine.generate(P1, TURN, session=a, resume_output_ids=[1]),
                }.items():
                    with pytest.raises(InvalidRequest) as info:
                        call()
                    errors[name] = info.value.field
                assert engine.stats.submitted == 0
        assert duplicate.value.field == "session_id"
        assert errors == {"unknown": "session", "n": "SamplingParams.n",
                          "long": "session tokens + prompt + max_new_tokens", "resume": "resume_output_ids"}


class TestHazards:
    @pytest.mark.anyio
    @pytest.mark.parametrize("when", ["decoding", "admission"])
    async def test_aborted_turn_leaves_the_session_intact(self, when):
        """A turn aborted mid-decode or at admission: the session keeps what it had, the next turn
        continues the conversation without the aborted turn."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(), faults=_slow(0.002)) as engine:
                sid = await engine.open_session()
                t1 = await _turn(engine, sid, P1)
                await engine.wait_idle(DEADLINE)
                before = engine.session_info(sid)
                stream = engine.generate(P2, LONG, session=sid, request_id="doomed")
                if when == "decoding":
                    await stream.__anext__()
                    assert live_request(engine, "doomed").state is S.DECODING
                assert await engine.abort("doomed")
                final = (await collect(stream))[-1]
                await engine.wait_idle(DEADLINE)
                after = engine.session_info(sid)
                assert_accounted(engine, {sid: before.kept_pages})
                t2 = await _turn(engine, sid, P3)
                one_shot = await engine.complete(P1 + t1.token_ids + P3, TURN)
        assert final.finish_reason is FinishReason.ABORT and not after.busy
        assert (after.kept_pages, after.num_tokens) == (before.kept_pages, before.num_tokens)
        assert t2.token_ids == one_shot.token_ids

    @pytest.mark.anyio
    async def test_close_during_a_turn(self):
        """Closing while a turn runs releases the session at once; the turn still finishes; nothing stays locked."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null"), faults=_slow()) as engine:
                sid = await engine.open_session()
                await _turn(engine, sid, P1)
                stream = engine.generate(P2, LONG, session=sid)
                await stream.__anext__()
                assert await engine.close_session(sid)
                while engine.session_info(sid) is not None:
                    await anyio.sleep(0.005)
                final = (await collect(stream))[-1]
                await engine.wait_idle(DEADLINE)
                assert_accounted(engine, {})
                with pytest.raises(InvalidRequest):
                    engine.generate(P3, TURN, session=sid)
        assert final.finish_reason is FinishReason.LENGTH

    @pytest.mark.anyio
    async def test_lease_expires_mid_turn(self):
        """A turn outlasting the idle timeout: the lease expires through the machine (DEADLINE), the turn
        finishes, its KV is not kept, and the session is gone for the next turn."""
        ended = []
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null"), faults=_slow()) as engine:
                engine.parts.machine.transition_observers.append(
                    lambda r, src, dst: ended.append((r.request_id, r.finish_reason)) if dst is S.RELEASED else None)
                sid = await engine.open_session(idle_timeout=0.15)
                final = await _turn(engine, sid, P1, LONG)
                await engine.wait_idle(DEADLINE)
                assert engine.session_info(sid) is None
                assert_accounted(engine, {})
        assert final.finish_reason is FinishReason.LENGTH
        assert (f"session:{sid}", FinishReason.DEADLINE) in ended
        assert all(kind != "session" for kind, _ in engine.stats.finishes)  # an anchor is not traffic

    @pytest.mark.anyio
    async def test_lease_expires_with_no_traffic(self):
        """An idle engine still expires a lease on time: the loop's wait is bounded by it."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config()) as engine:
                sid = await engine.open_session(idle_timeout=1.0)  # the turn ends well within it, even under load
                await _turn(engine, sid, P1)
                await engine.wait_idle(DEADLINE)
                assert engine.session_info(sid).kept_pages > 0
                checks = engine.stats.leak_checks
                start = time.monotonic()
                while engine.session_info(sid) is not None:
                    await anyio.sleep(0.01)
                waited = time.monotonic() - start
                await anyio.sleep(0.05)
                assert_pools_whole(engine)
        assert waited < 5.0 and engine.stats.leak_checks > checks  # the idle check ran again, clean

    @pytest.mark.anyio
    async def test_an_unused_lease_expires_on_an_idle_engine(self):
        """A session opened and never used, on an engine with no traffic at all: it expires on time and
        gives its sessions slot back (opening it wakes the loop, whose idle wait is then bounded)."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config()) as engine:
                await engine.wait_idle(DEADLINE)
                sid = await engine.open_session(idle_timeout=0.2)
                assert engine.memory_report().pools["sessions"].held == 1
                while engine.session_info(sid) is not None:
                    await anyio.sleep(0.01)
                assert engine.memory_report().pools["sessions"].held == 0
                assert_pools_whole(engine)

    @pytest.mark.anyio
    async def test_retracted_turn_keeps_the_session(self):
        """A turn retracted for a higher priority request: the session's KV stays locked meanwhile,
        and the turn's output equals the one-shot output."""
        seen = {}
        config = small_config(max_running=1)
        with anyio.fail_after(DEADLINE):
            async with Engine(config, faults=_slow(0.002)) as engine:
                sid = await engine.open_session()
                t1 = await _turn(engine, sid, P1)
                await engine.wait_idle(DEADLINE)
                kept = engine.session_info(sid).kept_pages

                def on(request, src, dst):
                    if request.request_id == "turn" and dst is S.RETRACTED:
                        seen["kept"] = engine.session_info(sid).kept_pages
                        seen["report"] = engine.memory_report().pools["kv_pages"].kept

                engine.parts.machine.transition_observers.append(on)
                stream = engine.generate(P2, SamplingParams(max_new_tokens=30, ignore_eos=True), session=sid,
                                         request_id="turn", priority=3)
                await stream.__anext__()
                await engine.complete(P3, TURN, priority=0)
                turn = (await collect(stream))[-1]
                await engine.wait_idle(DEADLINE)
                assert_accounted(engine, {sid: engine.session_info(sid).kept_pages})
                one_shot = await engine.complete(P1 + t1.token_ids + P2, SamplingParams(max_new_tokens=30,
                                                                                        ignore_eos=True))
        assert seen == {"kept": kept, "report": kept}
        assert turn.token_ids == one_shot.token_ids

    @pytest.mark.anyio
    async def test_shutdown_with_sessions_and_a_turn_in_flight(self):
        """Leaving the engine ends the turn (SHUTDOWN) and releases every session (conftest checks the pools)."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(model="null"), faults=_slow()) as engine:
                sids = [await engine.open_session() for _ in range(3)]
                for sid in sids[:2]:
                    await _turn(engine, sid, P1)
                stream = engine.generate(P2, LONG, session=sids[0])
                await stream.__anext__()
        final = (await collect(stream))[-1]
        assert final.finish_reason is FinishReason.SHUTDOWN
        assert engine.memory_report().pools["sessions"].held == 0

