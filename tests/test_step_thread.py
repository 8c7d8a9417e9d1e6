"""The runtime loop's step thread (`engine.runtime.step_thread`): results and exceptions come back
to the loop, a step in flight is never left behind by a cancellation, the caller's context
variables are seen, and the thread ends with the loop."""

from __future__ import annotations

import contextvars
import threading

import anyio
import anyio.lowlevel
import pytest

from engine import Engine, SamplingParams
from engine.runtime.inline_rule import InlineRule
from engine.runtime.step_thread import StepThread
from helpers import DEADLINE, assert_pools_whole, small_config

BACKENDS = ["asyncio", "trio"]
TAG: contextvars.ContextVar[str] = contextvars.ContextVar("TAG", default="unset")


def _steps_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvlife-step"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_results_exceptions_and_context_come_back(backend):
    """The step runs on the thread of its own; its value and its exception (same object) come back to
    the loop's thread, and it sees the context variables set by the caller."""
    seen: dict[str, object] = {}

    async def main() -> None:
        steps = StepThread()
        steps.bind(anyio.lowlevel.current_token())
        TAG.set("caller")

        def step(n: int) -> int:
            seen["thread"] = threading.current_thread().name
            seen["tag"] = TAG.get()
            return n * 2

        boom = ValueError("step failed")

        def failing(_: int) -> int:
            raise boom

        with anyio.fail_after(DEADLINE):
            assert await steps.run(step, 21) == 42
            with pytest.raises(ValueError) as raised:
                await steps.run(failing, 0)
            assert raised.value is boom
            assert await steps.run(step, 1) == 2  # the thread serves on after a failed step
        steps.close()

    anyio.run(main, backend=backend)
    assert seen == {"thread": "kvlife-step", "tag": "caller"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cancelled_caller_waits_for_its_step(backend):
    """Cancelling the awaiting task does not leave the step behind: the await returns only once the
    step has returned (it still writes its batch's pages), with its result (the loop applies it, as
    with `anyio.to_thread.run_sync`), and the cancellation is delivered at the caller's next checkpoint."""
    order: list[str] = []

    async def main() -> None:
        steps = StepThread()
        steps.bind(anyio.lowlevel.current_token())
        entered, release = threading.Event(), threading.Event()

        def held(_: None) -> str:
            entered.set()
            release.wait(DEADLINE)
            order.append("step returned")
            return "its result"

        async def caller(scope_box: list[anyio.CancelScope]) -> None:
            with anyio.CancelScope() as scope:
                scope_box.append(scope)
                order.append(f"run returned {await steps.run(held, None)}")
                await anyio.sleep(0)
                order.append("not cancelled")  # never: the checkpoint delivers the cancellation
            order.append("caller saw the step end" if scope.cancelled_caught else "caller ran on")

        scopes: list[anyio.CancelScope] = []
        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(caller, scopes)
                await anyio.to_thread.run_sync(entered.wait, DEADLINE)
                scopes[0].cancel()
                await anyio.sleep(0.05)
                order.append("cancelled")
                release.set()
        steps.close()

    anyio.run(main, backend=backend)
    assert order == ["cancelled", "step returned", "run returned its result", "caller saw the step end"]


def test_run_before_bind_is_refused_and_close_ends_the_thread():
    async def main() -> None:
        steps = StepThread(name="kvlife-step-test")
        with pytest.raises(RuntimeError, match="before bind"):
            await steps.run(lambda x: x, 1)
        steps.bind(anyio.lowlevel.current_token())
        assert await steps.run(lambda x: x + 1, 1) == 2
        thread = next(t for t in threading.enumerate() if t.name == "kvlife-step-test")
        steps.close()
        await anyio.to_thread.run_sync(thread.join, DEADLINE)
        assert not thread.is_alive() and not steps.alive

    anyio.run(main)


@pytest.mark.asyncio
async def test_the_engine_steps_on_its_thread_and_it_ends_with_the_engine():
    """With every step off the loop (`inline_step_tokens=0`, `inline_step_ms=0`) the engine's steps run on its step
    thread, greedy ids equal the inline engine's, and no step thread outlives the engine."""
    before = len(_steps_alive())
    prompt, params = list(range(5, 25)), SamplingParams(max_new_tokens=6, ignore_eos=True)
    threads: set[str] = set()
    async with Engine(small_config(inline_step_tokens=0, inline_step_ms=0)) as engine:
        engine.loop.step_observers.append(lambda batch, output: threads.add(threading.current_thread().name))
        off_loop = (await engine.complete(prompt, params)).token_ids
        runner_step = engine.loop.runner.step

        def recording(batch):
            threads.add("runner:" + threading.current_thread().name)
            return runner_step(batch)

        engine.loop.runner.step = recording
        await engine.complete(prompt, params)
        assert len(_steps_alive()) == before + 1
    async with Engine(small_config(inline_step_tokens=1 << 20)) as inline:
        assert (await inline.complete(prompt, params)).token_ids == off_loop
    with anyio.fail_after(DEADLINE):
        while len(_steps_alive()) > before:
            await anyio.sleep(0.01)
    assert "runner:kvlife-step" in threads and "kvlife-step" not in threads  # observers run on the loop


class TestInlineRule:
    def test_tokens_decide_until_a_larger_step_is_timed(self):
        rule = InlineRule(8, 0.020)
        assert rule.inline(8) and not rule.inline(9) and not rule.inline(64)
        rule.observe(8, 1.0)  # a step the token rule inlines teaches nothing
        assert rule.per_token_s is None and not rule.inline(64)

    def test_a_step_expected_within_the_budget_runs_inline(self):
        rule = InlineRule(8, 0.020)
        rule.observe(64, 0.0128)  # 0.2 ms a token
        assert rule.inline(64) and rule.inline(100) and not rule.inline(101) and not rule.inline(4096)
        for _ in range(40):  # the steps slow down (a longer context): the average follows
            rule.observe(64, 0.064)
        assert rule.per_token_s == pytest.approx(0.001, rel=0.01) and rule.inline(20) and not rule.inline(21)

    def test_a_decode_run_never_runs_inline_and_teaches_nothing(self):
        """A run of 16 steps of one row (16 tokens) is never inlined, however cheap its tokens look, and
        its time per token (a whole step's per row) does not enter the average."""
        rule = InlineRule(32, 0.020)
        rule.observe(64, 0.0064)  # 0.1 ms a token
        assert rule.inline(16) and not rule.inline(16, steps=16) and not rule.inline(1, steps=2)
        rule.observe(64, 0.5, steps=16)  # a run of 64 rows: ~0.5 s, 8 ms a token
        assert rule.per_token_s == pytest.approx(0.0001)

    def test_a_zero_budget_leaves_it_to_the_tokens(self):
        rule = InlineRule(0, 0.0)
        rule.observe(64, 0.001)
        assert rule.per_token_s is None and not rule.inline(1)


@pytest.mark.asyncio
@pytest.mark.parametrize("budget_ms,inlined", [(0.0, False), (1e5, True)])
async def test_the_engine_inlines_larger_steps_within_the_budget(budget_ms, inlined):
    """On a CPU, once a larger step has been timed, steps expected within `inline_step_ms` run on the loop's
    thread; with 0 only `inline_step_tokens` decides. The greedy ids are the same either way."""
    prompts = [list(range(5 + i, 25 + i)) for i in range(3)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    where: list[str] = []
    async with Engine(small_config(inline_step_tokens=2, inline_step_ms=budget_ms)) as engine:
        if engine.parts.device.type != "cpu":
            pytest.fail("this test runs on a CPU engine (its rule applies to CPU devices only)")
        runner_step = engine.loop.runner.step

        def recording(batch):
            if sum(s.num_tokens for s in batch) > 2:
                where.append(threading.current_thread().name)
            return runner_step(batch)

        engine.loop.runner.step = recording
        outs = [o.token_ids for o in await asyncio_gather(engine, prompts, params)]
    async with Engine(small_config()) as reference:
        assert outs == [o.token_ids for o in await asyncio_gather(reference, prompts, params)]
    assert where[0] == "kvlife-step"  # the first larger step is not timed yet: the thread
    assert ("MainThread" in where[1:]) == inlined and ("kvlife-step" in where[1:]) != inlined


async def asyncio_gather(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    outs: list = [None] * len(prompts)

    async def one(i: int) -> None:
        outs[i] = await engine.complete(prompts[i], params)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return outs


#: 19 tokens: one prefill step, then the decode rows (runs, where the engine has them)
RUN_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 2 + [5, 6, 7]


def _trace_threads(monkeypatch, runner) -> dict[str, set[int]]:
    """The threads the runner's `run` and `step` are called on."""
    where: dict[str, set[int]] = {"run": set(), "step": set()}
    for name in where:
        call = getattr(runner, name)

        def traced(*args, _call=call, _name=name, **kwargs):
            where[_name].add(threading.get_ident())
            return _call(*args, **kwargs)
        monkeypatch.setattr(runner, name, traced)
    return where


@pytest.mark.asyncio
async def test_a_run_never_runs_on_the_loops_thread(monkeypatch):
    """A decode run takes the step thread however short it is expected to be (its one hand-off is shared
    by its steps), so the loop keeps answering while it runs (test_decode_runs: work that arrives ends it
    after one step); on a CPU a batch-1 run of 16 steps used to be expected from the prefill's seconds per
    token, ran inline and held the loop for all 16. A plain engine's one-token steps still run inline,
    with the same greedy ids."""
    loop_thread = threading.get_ident()
    async with Engine(small_config(decode_steps=16)) as engine:
        where = _trace_threads(monkeypatch, engine.parts.runner)
        out = await engine.complete(RUN_PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert len(out.token_ids) == 40 and engine.stats.decode_runs >= 2
        assert where["run"] and loop_thread not in where["run"]
        await engine.wait_idle(DEADLINE)
        assert_pools_whole(engine)
    async with Engine(small_config()) as plain:
        where = _trace_threads(monkeypatch, plain.parts.runner)
        assert (await plain.complete(RUN_PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))).token_ids == \
            out.token_ids[:8]
        assert loop_thread in where["step"] and not where["run"]
        await plain.wait_idle(DEADLINE)
        assert_pools_whole(plain)
