"""The verified greedy head against the float32 head, in one run, on one checkpoint.

    python benchmarks/bench_greedy_head.py [--batches 1 8 32 128] [--repeat 4] [--threads 1]
        [--new-tokens 64] [--prompt-len 128] [--out bench-results/greedy_head.json]

The anchor checkpoint of `bench_engine.py` (tiny random Llama, hidden 256,
vocabulary 32,000, fp32, `save_pretrained`), loaded twice into kvlife in this
process: `EngineConfig(greedy_head="full")` (the float32 head) and
`greedy_head="auto"` (the verified bfloat16 head: `engine.model.greedy_head`).
Per batch size B, B seeded random prompts of `--prompt-len` tokens, greedy,
`--new-tokens` each and the same with one token, both engines in turn
(alternating which goes first), `--repeat` times. *step ms* =
(wall(new tokens) - wall(1)) / (new tokens - 1), as in `bench_engine.py`;
*forward ms* the runner's forward + sampling of a decode step (median). Each
ratio (float32 step / verified step) is taken within one repeat; the table
gives the median and range. Greedy ids are compared on every repeat, and the
verified head's served / declined steps are reported. Also the head alone:
the float32 head and its argmax against the verified head, on final-normed
random rows (this thread's CPU time, median of 30). Prints the tables and
writes JSON.
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
import attrs
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import engine_config, kvlife_run, make_prompts, write_checkpoint  # noqa: E402
from benchmarks.machine import fmt, header, loadavg, machine_info, median_range, write_results  # noqa: E402
from engine import Engine  # noqa: E402
from engine.logging import configure_logging  # noqa: E402
from engine.model.sampling import argmax_rows  # noqa: E402

MODES = ("full", "auto")


def head_alone(model, batch: int) -> dict:
    """CPU ms of the float32 head + argmax and of the verified head on `batch` final-normed rows."""
    x = F.rms_norm(torch.randn(batch, model.config.hidden_size, generator=torch.Generator().manual_seed(batch)),
                   (model.config.hidden_size,))
    verified = model.verified_head
    out = {}
    with torch.inference_mode():
        for name, run in (("full", lambda: argmax_rows(model.logits(x))), ("verified", lambda: verified.argmax(x))):
            times = []
            for i in range(35):
                t0 = time.thread_time()
                run()
                times.append(time.thread_time() - t0)
            out[f"{name}_ms"] = 1e3 * statistics.median(times[5:])
        out["equal"] = bool(torch.equal(verified.argmax(x), argmax_rows(model.logits(x))))
    return out


async def bench_batch(args, directory: Path, batch: int) -> dict:
    prompts = make_prompts(batch, args.prompt_len)
    n = args.new_tokens
    runs = []
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for mode in MODES:
            config = attrs.evolve(engine_config(directory, batch, args.prompt_len, n), greedy_head=mode)
            engines[mode] = await stack.enter_async_context(Engine(config))
            await kvlife_run(engines[mode], prompts[:1], 2)  # warm-up
        head = engines["auto"].parts.model.verified_head
        assert head is not None, "the verified head does not apply on this machine (docs/models.md)"
        for rep in range(args.repeat):
            run: dict = {"load": loadavg()}
            ids = {}
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                one = await kvlife_run(engines[mode], prompts, 1)
                full = await kvlife_run(engines[mode], prompts, n)
                run[mode] = {"step_ms": 1e3 * (full["wall_s"] - one["wall_s"]) / (n - 1),
                             "forward_ms": full["forward_ms"]}
                ids[mode] = full["ids"]
            run["x_full"] = run["full"]["step_ms"] / run["auto"]["step_ms"]
            run["ids_equal"] = ids["full"] == ids["auto"]
            runs.append(run)
            print(f"  batch {batch} repeat {rep + 1}: step {run['full']['step_ms']:.2f} -> {run['auto']['step_ms']:.2f} ms"
                  f" ({run['x_full']:.2f}x), ids equal {run['ids_equal']}, load {run['load']}", flush=True)
        alone = head_alone(engines["auto"].parts.model, batch)
        served, declined = head.served, head.declined

    def stat(get) -> dict:
        return median_range([get(r) for r in runs])

    return {"batch": batch, "full_step_ms": stat(lambda r: r["full"]["step_ms"]),
            "verified_step_ms": stat(lambda r: r["auto"]["step_ms"]), "x_full": stat(lambda r: r["x_full"]),
            "full_forward_ms": stat(lambda r: r["full"]["forward_ms"]),
            "verified_forward_ms": stat(lambda r: r["auto"]["forward_ms"]),
            "ids_equal": [r["ids_equal"] for r in runs], "served": served, "declined": declined,
            "head_alone": alone, "runs": runs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out", default="bench-results/greedy_head.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    configure_logging("warning")
    info = machine_info()
    print(header(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_checkpoint(Path(tmp) / "anchor-llama")
        rows = [anyio.run(bench_batch, args, directory, batch) for batch in args.batches]
    info["load_at_end"] = loadavg()
    print(f"\n{header(info)}; load at end {info['load_at_end']}")
    print("decode step ms (median, range over repeats); x = float32 head's step / verified head's, within a repeat")
    print(f"{'batch':>5} | {'float32 head step':>20} | {'verified step':>20} | {'x':>16} | {'forward f32 / ver':>17} | "
          f"{'ids equal':>9} | {'served/declined':>15} | head alone f32 / verified ms")
    for r in rows:
        alone = r["head_alone"]
        print(f"{r['batch']:>5} | {fmt(r['full_step_ms'], 2):>20} | {fmt(r['verified_step_ms'], 2):>20} | "
              f"{fmt(r['x_full'], 2):>16} | {r['full_forward_ms']['median']:>7.2f} / {r['verified_forward_ms']['median']:<7.2f} | "
              f"{sum(r['ids_equal'])}/{len(r['ids_equal']):<7} | {r['served']:>7}/{r['declined']:<7} | "
              f"{alone['full_ms']:.2f} / {alone['verified_ms']:.2f} (equal {alone['equal']})")
    return write_results(args.out, {"machine": info, "workload": {"prompt_len": args.prompt_len,
                                    "new_tokens": args.new_tokens, "repeat": args.repeat, "threads": args.threads},
                                    "rows": rows})


if __name__ == "__main__":
    main()
