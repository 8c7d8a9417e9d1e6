"""Mixed steps (a prefill chunk beside decode rows) with and without the scheduler's size-class trim.

    python benchmarks/bench_mixed_steps.py [--batch 128] [--prompt-len 128] [--new-tokens 64]
        [--max-prefill-tokens 4096] [--repeat 4] [--threads 1] [--out bench-results/mixed_steps.json]

One engine on bench_engine.py's checkpoint (the anchor tiny Llama, written here), `--batch` prompts
submitted at once, greedy: the first chunk prefills alone, the later ones run beside the decode rows of
the requests already prefilled. Each repeat runs the workload once with the trim (the engine's
scheduler: a full chunk is cut so the step's rows end on a size class) and once without it (the
chunk takes the whole budget: 4,096 + 32 rows, padded to 5,120 in every CPU projection), alternating
which goes first. Reported per mode: the median forward time of the chunks that ran alone and of those
that ran beside decode rows (from the runner's step timings), and the whole run's wall time; the
ratios are taken within each repeat. Greedy ids are compared between the two modes.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import anyio
import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import complete_all, engine_config, make_prompts, write_checkpoint  # noqa: E402
from benchmarks.machine import header, machine_info, write_results  # noqa: E402
from engine import Engine  # noqa: E402
from engine.logging import configure_logging  # noqa: E402
from engine.runtime import scheduler  # noqa: E402

TRIM = scheduler.size_class_below


async def _run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """One run of the workload; the chunk that ran alone (the first step) and the full chunks that ran
    beside decode rows (the later prefill steps of at least half its forward time: not the short tail)."""
    runner = engine.parts.runner
    runner.timings = []
    wall, outputs = await complete_all(engine, prompts, new_tokens)
    timings, runner.timings = runner.timings, None
    await engine.wait_idle(30)
    engine.check_memory()
    first = timings[0]
    beside = [t for t in timings[1:] if not t.decode_only and t.forward_s * 2 >= first.forward_s]
    return {"wall_s": wall, "alone_ms": [1e3 * first.forward_s], "beside_ms": [1e3 * t.forward_s for t in beside],
            "steps": len(timings), "ids": [o.token_ids for o in outputs]}


async def bench(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_checkpoint(Path(tmp) / "anchor-llama")
        config = engine_config(directory, args.batch, args.prompt_len, args.new_tokens)
        config = attrs.evolve(config, max_prefill_tokens=args.max_prefill_tokens)
        prompts = make_prompts(args.batch, args.prompt_len)
        repeats = []
        async with Engine(config) as engine:
            await _run(engine, prompts[:1], 2)  # warm-up
            for rep in range(args.repeat):
                order = ["trim", "pad"] if rep % 2 == 0 else ["pad", "trim"]
                runs = {}
                for mode in order:
                    scheduler.size_class_below = TRIM if mode == "trim" else (lambda n: n)
                    try:
                        runs[mode] = await _run(engine, prompts, args.new_tokens)
                    finally:
                        scheduler.size_class_below = TRIM
                repeats.append({"order": order, "load": os.getloadavg(), **runs,
                                "ids_equal": runs["trim"]["ids"] == runs["pad"]["ids"]})
    return {"repeats": repeats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench-results/mixed_steps.json")
    args = parser.parse_args()
    configure_logging("warning")
    torch.set_num_threads(args.threads)
    info = machine_info()
    result = anyio.run(bench, args)
    rows = []
    for mode in ("pad", "trim"):
        runs = [r[mode] for r in result["repeats"]]
        rows.append({"mode": mode,
                     "alone_ms": statistics.median(x for r in runs for x in r["alone_ms"]),
                     "beside_ms": statistics.median(x for r in runs for x in r["beside_ms"]),
                     "wall_s": statistics.median(r["wall_s"] for r in runs),
                     "steps": statistics.median(r["steps"] for r in runs)})
    wall_ratio = statistics.median(r["pad"]["wall_s"] / r["trim"]["wall_s"] for r in result["repeats"])
    equal = all(r["ids_equal"] for r in result["repeats"])
    for r in result["repeats"]:
        for mode in ("pad", "trim"):
            del r[mode]["ids"]
    info["load_at_end"] = os.getloadavg()
    print(header(info) + f"; load at end {info['load_at_end'][0]:.2f}")
    print(f"batch {args.batch}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
          f"max_prefill_tokens {args.max_prefill_tokens}, {args.repeat} repeats")
    print("| mode | chunk alone, forward ms | chunk beside decode rows, forward ms | run wall s | steps |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['mode']} | {row['alone_ms']:.1f} | {row['beside_ms']:.1f} | {row['wall_s']:.3f} | "
              f"{row['steps']:.0f} |")
    print(f"run wall, pad over trim (median of per-repeat ratios): {wall_ratio:.3f}x; greedy ids equal: {equal}")
    write_results(args.out, {"machine": info, "workload": vars(args), "rows": rows, "pad_over_trim_wall": wall_ratio,
                             "greedy_equal": equal, **result})
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
