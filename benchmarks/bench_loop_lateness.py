"""How long decoding holds the engine's event loop: a timer's lateness while a batch decodes.

    python benchmarks/bench_loop_lateness.py [--batches 1 8] [--decode-steps 1 16] [--repeat 3]
        [--new-tokens 64] [--out bench-results/loop_lateness.json]

An embedded engine shares its event loop with the application (an HTTP
server, health checks, other tasks): while a step or a decode run runs on the
loop's own thread, nothing else on that loop runs. This measures it from the
outside. The anchor checkpoint of `bench_engine.py` (written the same way),
one engine per `--decode-steps` value (`EngineConfig.decode_steps`), B seeded
128-token prompts decoded greedily to `--new-tokens` each while a task on
the same loop sleeps 1 ms at a time: its *lateness* is how much later than
1 ms each sleep returned (p50, p99, max), and *held*: the lateness of the
sleeps more than 5 ms late, summed, as a share of the wall time (how much of
the decode the loop spent unable to run anything else). Also the decode rate (B x new tokens /
wall time), which the ticker's own wake-ups slow a little for every engine
alike. Repeats alternate the engines; the table prints medians over repeats.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import complete_all, engine_config, make_prompts, write_checkpoint  # noqa: E402
from benchmarks.machine import add_device_option, header, loadavg, machine_info, write_results  # noqa: E402
from engine import Engine  # noqa: E402
from engine.logging import configure_logging  # noqa: E402

TICK_S = 0.001
#: a sleep this much late counts its lateness as time the loop was held (the `held` column)
HELD_S = 0.005


async def decode_with_ticker(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Decode `prompts` while a task on the same loop sleeps `TICK_S` at a time; its lateness in ms."""
    late: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(TICK_S)
            late.append(time.perf_counter() - t0 - TICK_S)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        wall, _ = await complete_all(engine, prompts, new_tokens)
        done.set()
    await engine.wait_idle(30)
    engine.check_memory()
    ordered = sorted(late)
    return {"tokens_per_s": len(prompts) * new_tokens / wall, "late_p50_ms": 1e3 * statistics.median(ordered),
            "late_p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))], "late_max_ms": 1e3 * ordered[-1],
            "held_share": sum(x for x in ordered if x > HELD_S) / wall, "ticks": len(ordered)}


async def bench(args, directory: Path) -> list[dict]:
    rows = []
    for batch in args.batches:
        prompts = make_prompts(batch, 128)
        runs: dict[int, list[dict]] = {steps: [] for steps in args.decode_steps}
        engines = {}
        async with contextlib.AsyncExitStack() as stack:
            for steps in args.decode_steps:
                engines[steps] = await stack.enter_async_context(Engine(engine_config(
                    directory, batch, 128, args.new_tokens, args.device, decode_steps=steps)))
                await complete_all(engines[steps], prompts[:1], 2)  # warm-up
            for rep in range(args.repeat):
                order = list(args.decode_steps)
                order = order[rep % len(order):] + order[: rep % len(order)]
                for steps in order:
                    runs[steps].append(await decode_with_ticker(engines[steps], prompts, args.new_tokens))
        for steps, got in runs.items():
            row = {"batch": batch, "decode_steps": steps, "repeats": got}
            for key in ("tokens_per_s", "late_p50_ms", "late_p99_ms", "late_max_ms", "held_share"):
                row[key] = statistics.median(r[key] for r in got)
            rows.append(row)
            print(f"  batch {batch}, decode_steps {steps}: {row['tokens_per_s']:.0f} tok/s, loop late p50 "
                  f"{row['late_p50_ms']:.2f} / p99 {row['late_p99_ms']:.1f} / max {row['late_max_ms']:.1f} ms, held "
                  f"{100 * row['held_share']:.0f}%, load {loadavg()}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--decode-steps", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="bench-results/loop_lateness.json")
    add_device_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configure_logging("error")
    info = machine_info(args.device)
    print(header(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = anyio.run(bench, args, write_checkpoint(Path(tmp) / "anchor-llama"))
    print(f"\nloop lateness of a {TICK_S * 1e3:g} ms sleep on the engine's loop while a batch decodes, ms, median "
          f"over {args.repeat} repeats; load at end {loadavg()}")
    print(f"{'batch':>5} | {'decode_steps':>12} | {'tok/s':>8} | {'late p50':>8} | {'late p99':>8} | {'late max':>8} | "
          f"{'held':>5}")
    for r in rows:
        print(f"{r['batch']:>5} | {r['decode_steps']:>12} | {r['tokens_per_s']:>8.0f} | {r['late_p50_ms']:>8.2f} | "
              f"{r['late_p99_ms']:>8.1f} | {r['late_max_ms']:>8.1f} | {100 * r['held_share']:>4.0f}%")
    return write_results(args.out, {"machine": info, "load_at_end": loadavg(), "tick_s": TICK_S, "rows": rows})


if __name__ == "__main__":
    main()
