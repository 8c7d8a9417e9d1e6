"""The built-in mixed workload behind `kvlife run`, and its report.

Requests of varied prompt and output lengths stream concurrently; some are
aborted mid-stream, some clients disconnect, health checks run in between.
Each request is fitted to the engine's max_context (`fit_to_context`: the
output length first capped, then the prompt cut), so any valid EngineConfig
runs the whole workload; the report says how many were fitted.
The report counts finishes by reason, throughput and latency percentiles,
transitions per edge, and every pool with the leak-check verdict: "clean",
"LEAK", or "UNCHECKED" (a pool whose stats() raises cannot be checked).

A leak can keep the engine from ever going idle (a hook that leaks its pool
dry leaves every later request waiting for it). The engine finds it while
busy (`resources.leak_watch`); once a request has starved (waited
`starvation_timeout`) with a leak found, the run stops: the clients leave,
their requests are aborted, and the report says LEAK, names the starved
requests, the pool they waited for and its holders. So the run ends within
starvation_timeout + about a second of the pool running dry.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from resources import LeakError


async def run_workload(
    config: EngineConfig,
    *,
    num_requests: int = 48,
    concurrency: int = 16,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    plans = [_plan(rng, i) for i in range(num_requests)]
    done = 0
    client_outcomes: Counter = Counter()
    health: Counter = Counter()
    limiter = anyio.Semaphore(concurrency)
    start = time.perf_counter()
    stopped: list[dict[str, Any]] = []  # the starvation records that ended the run early
    engine = Engine(config)
    async with engine:

        async def client(plan: dict[str, Any]) -> None:
            nonlocal done
            async with limiter:
                outcome = await _run_client(engine, plan)
            client_outcomes[outcome] += 1
            done += 1
            if progress is not None:
                progress(done, num_requests)

        async def health_checker() -> None:
            while done < num_requests:
                try:
                    await engine.health_check(timeout=30)
                    health["ok"] += 1
                except Exception:  # noqa: BLE001 - counted, and shown in the report
                    health["failed"] += 1
                await anyio.sleep(0.05)

        async def watchdog(scope: anyio.CancelScope) -> None:
            """A leak that starves requests would keep the run waiting forever: stop it."""
            while done < num_requests:
                report = engine.memory_report()
                if report.last_leak and report.starved:
                    stopped.extend(report.starved)
                    scope.cancel()
                    return
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(health_checker)
            tg.start_soon(watchdog, tg.cancel_scope)
            for plan in plans:
                tg.start_soon(client, plan)
        await engine.wait_idle(timeout=30)
        elapsed = time.perf_counter() - start
        verdict, problems = "clean", []
        try:
            report = engine.check_memory()
        except LeakError as exc:
            problems, report = exc.problems, exc.report
            verdict = "LEAK" if report.leaks() else "UNCHECKED"
        if stopped and verdict == "clean":  # the leak that starved them was found while busy
            verdict, problems = "LEAK", list(engine.memory_report().last_leak or ("a leak starved requests",))
    stats = engine.stats
    return {
        "requests": num_requests,
        "fitted_to_context": sum(1 for plan in plans if plan.get("fitted")),
        "health_checks": dict(health),
        "client_outcomes": dict(client_outcomes),
        "finishes": {f"{kind}/{reason}": n for (kind, reason), n in sorted(stats.finishes.items())},
        "tokens_generated": stats.tokens_generated,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(stats.tokens_generated / elapsed, 1),
        "ttft_ms": {q: _ms(stats.ttft.percentile(q)) for q in (50, 99)},
        "itl_ms": {q: _ms(stats.itl.percentile(q)) for q in (50, 99)},
        "retractions": stats.retractions,
        "transitions": {f"{src}->{dst}": n for (src, dst), n in sorted(stats.transitions.items())},
        "pools": report.as_dict()["pools"],
        "leak_check": verdict,
        "leak_problems": problems,
        "stopped_early": [{k: r.get(k) for k in ("request_id", "waited_s", "waiting_for", "holders")}
                          for r in stopped],
    }


def _plan(rng: random.Random, index: int) -> dict[str, Any]:
    kind = rng.choices(["complete", "abort", "disconnect"], weights=[6, 1, 1])[0]
    return {
        "id": f"req-{index}",
        "prompt": f"request {index}: " + "lorem ipsum " * rng.randint(1, 40),
        "max_new_tokens": rng.choice([1, 8, 16, 32, 64]),
        "kind": kind,
        "cut_after": rng.randint(1, 4),
        "temperature": rng.choice([0.0, 0.0, 0.8]),
        "seed": index,
    }


def fit_to_context(token_ids: list[int], max_new_tokens: int, max_context: int) -> tuple[list[int], int]:
    """(prompt, max_new_tokens) within `max_context`: at most half of it for output, the prompt cut to the rest."""
    max_new = max(1, min(max_new_tokens, max_context // 2))
    return token_ids[: max_context - max_new], max_new


async def _run_client(engine: Engine, plan: dict[str, Any]) -> str:
    token_ids = engine.tokenizer.encode(plan["prompt"])
    prompt, max_new = fit_to_context(token_ids, plan["max_new_tokens"], engine.max_context)
    plan["fitted"] = (len(prompt), max_new) != (len(token_ids), plan["max_new_tokens"])
    params = SamplingParams(max_new_tokens=max_new, temperature=plan["temperature"], top_p=0.95, seed=plan["seed"])
    stream = engine.generate(prompt, params, request_id=plan["id"])
    async with stream:
        async for output in stream:
            if output.finished:
                assert output.finish_reason is not None  # a final output names why it finished
                return output.finish_reason.name.lower()
            if len(output.token_ids) >= plan["cut_after"]:
                if plan["kind"] == "abort":
                    await engine.abort(plan["id"])
                elif plan["kind"] == "disconnect":
                    return "disconnected"
    return "ended without a final output"  # never expected: counted so it shows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def format_report(report: dict[str, Any]) -> str:
    lines = [f"kvlife run: {report['requests']} requests in {report['elapsed_s']} s"
             f" ({report['fitted_to_context']} fitted to max_context)"]
    lines.append(f"  finishes       {report['finishes']}")
    lines.append(f"  clients        {report['client_outcomes']}   health checks {report['health_checks']}")
    lines.append(f"  tokens/s       {report['tokens_per_s']}  ({report['tokens_generated']} tokens, "
                 f"{report['retractions']} retractions)")
    lines.append(f"  TTFT ms        p50 {report['ttft_ms'][50]}  p99 {report['ttft_ms'][99]}")
    lines.append(f"  ITL ms         p50 {report['itl_ms'][50]}  p99 {report['itl_ms'][99]}")
    lines.append("  transitions")
    for edge, n in report["transitions"].items():
        lines.append(f"    {edge:<26} {n}")
    lines.append(f"  {'pool':<16} {'capacity':>9} {'free':>7} {'evictable':>9} {'held':>6}")
    for name, s in report["pools"].items():
        lines.append(f"  {name:<16} {s['capacity']:>9} {s['free']:>7} {s['evictable']:>9} {s['held']:>6}")
    lines.append(f"  leak check     {report['leak_check']}")
    for problem in report["leak_problems"]:
        lines.append(f"    {problem}")
    for record in report.get("stopped_early", ()):
        lines.append(f"  stopped early: {record['request_id']} starved {record['waited_s']} s waiting for "
                     f"{', '.join(record['waiting_for'] or ['memory'])}")
        for pool, holders in (record["holders"] or {}).items():
            lines.append(f"    {pool} held by: {'; '.join(holders) or 'nobody recorded'}")
    return "\n".join(lines)
