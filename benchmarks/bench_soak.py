"""Soak: many short requests with aborts and disconnects; nothing may grow.

    python benchmarks/bench_soak.py [--requests 100000] [--tiny-requests 10000]
                                    [--roles none decode] [--decode-requests N] [--decode-steps K]
                                    [--out bench-results/soak.json]

Runs through the public API, each one engine for the whole run, per role
(`--roles`: a single engine, and the decode role, whose in-process prefill is
the same runtime in the prefill role, with tables and an idle leak check of
its own):

1. `model="null"` (the no-compute runner: real pools, tables, machine and
   batch tensors, no forward pass), `--requests` requests (`--decode-requests`
   in the decode role, default the same);
2. the built-in tiny model, `--tiny-requests` requests.

Requests are short (prompts 4-48 tokens, drawn from a few shared prefixes so
the prefix cache fills and evicts; 1-16 new tokens) and come from
`--clients` concurrent clients. 10% are aborted by the client with
`engine.abort()` at a random point and 10% disconnect (the client closes its
stream mid-way); the rest read to the end. Reported per run: requests/s,
finish reasons, resident memory after warm-up (once the latency windows are
full, in a run long enough) and at the end (growth must stay under 5%), the size of every internal table at the end (all zero: the
decode role's include its prefill runtime's), and the leak check's verdict
(`check_memory()` every 1,000 requests while busy, at idle at the end, plus
every automatic idle check the loop ran, and in the decode role every idle
check its prefill runtime ran on its own pools).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import sys
import time
from collections import Counter

import anyio
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.logging import configure_logging  # noqa: E402
from engine.runtime.prefill_runtime import PrefillRuntime  # noqa: E402
from engine.runtime.stats import SAMPLE_WINDOW  # noqa: E402
from resources import LeakError  # noqa: E402

ABORT, DISCONNECT = "abort", "disconnect"


def rss_mib() -> float:
    """Resident set size now, MiB (/proc/self/status; ru_maxrss as a fallback)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def internal_tables(engine: Engine) -> dict[str, int]:
    """Every per-request table the engine keeps; all must be empty when idle."""
    parts = engine.parts
    tables = {f"loop.{name}": size for name, size in engine.loop.table_sizes().items()}
    tables.update({
        "ledger.requests": parts.ledger.num_tracked_requests,
        "ledger.held": sum(parts.ledger.held(p.name) for p in parts.pools),
        "kv.slots_in_use": parts.kv_pool.slots.capacity - parts.kv_pool.slots.num_free,
        "kv.protected_prefix_pages": parts.kv_pool.radix.protected_pages,
    })
    prefill = parts.prefill_client
    if isinstance(prefill, PrefillRuntime):  # the in-process prefill: the same tables, on its own runtime
        tables.update({f"prefill.loop.{name}": size for name, size in prefill.loop.table_sizes().items()})
        tables.update({"prefill.inbox": len(prefill.inbox), "prefill.ledger.requests":
                       prefill.parts.ledger.num_tracked_requests, "prefill.jobs": len(prefill.jobs_in_flight)})
    return tables


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    prefix = rng.choice(prefixes)[: rng.randrange(0, 33)]
    return prefix + [rng.randrange(256) for _ in range(rng.randrange(4, 17))]


async def _client(engine: Engine, rng: random.Random, plan: str | None, prompt: list[int], n: int,
                  request_id: str, reasons: Counter) -> None:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    stop_after = rng.randrange(0, n) if plan else n
    async with engine.generate(prompt, params, request_id=request_id) as stream:
        seen = 0
        async for output in stream:
            if output.finished:
                reasons[output.finish_reason.name] += 1
                return
            seen += 1
            if seen > stop_after:
                if plan == ABORT:
                    await engine.abort(request_id)  # keep reading: the final output says ABORT
                    stop_after = n + 1
                elif plan == DISCONNECT:
                    reasons["DISCONNECTED"] += 1
                    return  # leaving `async with` closes the stream: the engine aborts it


async def soak(model: str, total: int, clients: int, seed: int, warmup: int, device: str = "cpu",
               role: str = "none", decode_steps: int = 1) -> dict:
    # NOTE: about 4 pages per live request, so 64 clients press on 128 pages: admission queues, the cache evicts
    config = EngineConfig(model=model, device=device, page_size=16, num_kv_pages=128, max_running=clients, max_context=128,
                          max_prefill_tokens=1024, leak_check="raise", use_entry_points=False, disaggregation=role,
                          decode_steps=decode_steps)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(32)] for _ in range(8)]
    reasons: Counter = Counter()
    plans: Counter = Counter()
    counter = iter(range(total))
    marks: dict[str, float] = {}

    async def worker(engine: Engine) -> None:
        for i in counter:
            if i == warmup:
                gc.collect()
                marks["warm_rss"], marks["warm_t"] = rss_mib(), time.perf_counter()
            if i % 1000 == 0:  # every pool adds up at this moment (LeakError otherwise)
                engine.check_memory()
                marks["running_checks"] = marks.get("running_checks", 0) + 1
            roll = rng.random()
            plan = ABORT if roll < 0.1 else DISCONNECT if roll < 0.2 else None
            plans[plan or "complete"] += 1
            await _client(engine, rng, plan, _prompt(rng, prefixes), rng.randrange(1, 17), f"s{i}", reasons)

    gc.collect()
    start_rss = rss_mib()
    async with Engine(config) as engine:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(worker, engine)
        wall = time.perf_counter() - t0
        await engine.wait_idle(60)
        gc.collect()
        end_rss = rss_mib()
        tables = internal_tables(engine)
        prefill = engine.parts.prefill_client
        prefill_stats = prefill.loop.stats if isinstance(prefill, PrefillRuntime) else None
        try:
            report = engine.check_memory()
            if prefill_stats is not None:
                with anyio.fail_after(10):  # the prefill runtime's own idle check, once it has seen it idle
                    while not prefill.loop.checked_idle:
                        await anyio.sleep(0.01)
                prefill.check_memory()
            failed = engine.stats.leak_check_failures + (prefill_stats.leak_check_failures if prefill_stats else 0)
            verdict = "pass" if failed == 0 else "FAIL (an idle check failed)"
        except LeakError as exc:
            report, verdict = exc.report, f"FAIL: {exc}"
        stats = engine.stats
    measured = total - warmup
    warm_rss = marks.get("warm_rss", start_rss)
    return {
        "model": model,
        "role": role,
        "requests": total,
        "clients": clients,
        "seed": seed,
        "wall_s": wall,
        "requests_per_s": total / wall,
        "requests_per_s_after_warmup": measured / (time.perf_counter() - marks["warm_t"]) if "warm_t" in marks
        else None,
        "tokens_generated": stats.tokens_generated,
        "plans": dict(plans),
        "client_outcomes": dict(reasons),
        "engine_finishes": {f"{k}/{r}": v for (k, r), v in stats.finishes.items()},
        "retractions": stats.retractions,
        "decode_steps": decode_steps,
        "decode_runs": stats.decode_runs,
        "decode_run_steps": stats.decode_run_steps,
        "rss_mib": {"start": start_rss, "after_warmup": warm_rss, "end": end_rss},
        "rss_growth_pct": 100 * (end_rss - warm_rss) / warm_rss,
        "internal_tables_at_end": tables,
        "evictable_prefix_pages_at_end": report.pools["kv_pages"].evictable,
        "idle_leak_checks": stats.leak_checks,
        "prefill_idle_leak_checks": None if prefill_stats is None else prefill_stats.leak_checks,
        "prefill_requests": None if prefill_stats is None else prefill_stats.submitted,
        "running_checks": int(marks.get("running_checks", 0)),
        "leak_check": verdict,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--tiny-requests", type=int, default=10_000)
    parser.add_argument("--roles", nargs="+", default=["none", "decode"], choices=["none", "decode"],
                        help="a single engine, and the decode role with its in-process prefill runtime")
    parser.add_argument("--decode-requests", type=int, default=None,
                        help="no-compute requests in the decode role (default: --requests)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="EngineConfig.decode_steps (decode runs: slots extended and given back every run)")
    parser.add_argument("--out", default="bench-results/soak.json")
    parser.add_argument("--device", default="cpu", help="torch device the engines run on: cpu (default), cuda, cuda:1 ... (docs/gpu.md)")
    args = parser.parse_args()
    configure_logging("warning")
    torch.set_num_threads(args.threads)
    runs = []
    for role in args.roles:
        null_total = args.requests if role == "none" or args.decode_requests is None else args.decode_requests
        for model, total in (("null", null_total), ("tiny", args.tiny_requests)):
            if total <= 0:
                continue
            # RSS is compared from here to the end: past the latency windows' filling when the run is long
            # enough (they keep SAMPLE_WINDOW samples each, then stop growing)
            warmup = min(max(total // 20, 500, SAMPLE_WINDOW + 10_000), total // 2)
            print(f"load average {os.getloadavg()[0]:.2f} before {model}/{role}", flush=True)
            result = anyio.run(soak, model, total, args.clients, args.seed, warmup, args.device, role,
                               args.decode_steps)
            result["load_average"] = os.getloadavg()
            runs.append(result)
            rss = result["rss_mib"]
            nonzero = {k: v for k, v in result["internal_tables_at_end"].items() if v}
            print(f"{model:>5}/{role}: {total} requests in {result['wall_s']:.1f}s = {result['requests_per_s']:.0f}"
                  f" req/s; RSS {rss['after_warmup']:.0f} -> {rss['end']:.0f} MiB ({result['rss_growth_pct']:+.2f}%);"
                  f" tables at end {nonzero or 'all zero'} ({len(result['internal_tables_at_end'])} tables);"
                  f" leak check {result['leak_check']} (checks run {result['idle_leak_checks']}, the prefill's"
                  f" {result['prefill_idle_leak_checks']})", flush=True)
            print(f"       client outcomes {result['client_outcomes']}; engine finishes {result['engine_finishes']}"
                  f"; decode runs {result['decode_runs']} ({result['decode_run_steps']} steps)", flush=True)
    ok = all(r["leak_check"] == "pass" and r["rss_growth_pct"] < 5
             and not any(r["internal_tables_at_end"].values()) for r in runs)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": args.device, "runs": runs, "ok": ok, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "python": sys.version.split()[0]}, f, indent=2)
    print("soak", "PASSED" if ok else "FAILED", "->", args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
