"""kvlife's native CPU kernels against torch's ops, one decode step of the anchor model, in one process.

    python benchmarks/bench_native_kernels.py [--batches 1 8 32 128] [--context 160] [--rounds 7]
        [--steps 30] [--threads 1] [--kv-cache-dtype float32] [--out bench-results/native_kernels.json]

The anchor model of `bench_engine.py` (built by kvlife with random weights,
packed as the engine packs it), one decode step of B sequences of
`--context` tokens on scattered 16-token pages (`step_profile.py`'s step:
the forward pass and the greedy argmax), run with the kernels installed
(`EngineConfig.native_kernels="on"`: decode attention, add + RMSNorm, RoPE)
and with torch's ops alone ("off"), alternating which goes first, `--rounds`
times; each figure the median of `--steps` steps of this thread's CPU time
(`time.thread_time`, so other processes' share of the cores is not counted;
the memory bandwidth they take still is). Per round the speedup off / on;
the table prints medians and ranges over rounds, and whether the two
steps' greedy ids were equal. Beside it, the decode attention of one layer
alone (the same rows and pages, hot in cache after the first call): the
kernel against torch's form for that batch (`engine.model.paged_attend`).
`--kv-cache-dtype bfloat16`: the K/V buffers in bfloat16 (`EngineConfig.kv_cache_dtype`; the
model stays float32), in the step and in the attention alone.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import header, loadavg, machine_info, median_range, write_results  # noqa: E402
from benchmarks.step_profile import ANCHOR, PAGE, _decode_step, _ms  # noqa: E402
from engine.model.attention import AttentionMetadata, PagedAttention  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.loading import install_native_kernels as install  # noqa: E402
from engine.model.native_kernels import NativeKernels, kernel_problem, load_kernels  # noqa: E402
from engine.model.paged_attend import attend  # noqa: E402
from resources.kv_buffers import KVBuffers  # noqa: E402


def _attention_alone(kernels: NativeKernels, batch: int, context: int, steps: int,
                     kv_dtype: torch.dtype = torch.float32) -> dict:
    """ms of one layer's decode attention: the kernel, and torch's form for this batch."""
    gen = torch.Generator().manual_seed(batch)
    per = -(-context // PAGE)
    kv = KVBuffers(num_layers=1, num_pages=batch * per + 1, page_size=PAGE, num_kv_heads=ANCHOR.num_kv_heads,
                   head_dim=ANCHOR.head_dim, dtype=kv_dtype, device="cpu")
    kv.k[0].normal_(generator=gen)
    kv.v[0].normal_(generator=gen)
    pages = (torch.randperm(batch * per, generator=gen) + 1).view(batch, per)
    meta = AttentionMetadata(out_locs=pages[:, 0] * PAGE, q_lens=[1] * batch, kv_lens=[context] * batch,
                             kv_pages=pages, page_size=PAGE)
    plan = PagedAttention(kv, meta)._decode
    assert plan is not None
    q = torch.randn(batch, 1, ANCHOR.num_heads, ANCHOR.head_dim, generator=gen)
    out = {}
    for name, kernel in (("torch", None), ("native", kernels)):
        out[f"{name}_ms"] = _ms(lambda: attend(q, kv.k[0], kv.v[0], plan, None, kernel), steps, kv.k[0].device)
    out["kv_mib"] = 2 * batch * context * ANCHOR.num_kv_heads * ANCHOR.head_dim * kv.k[0].element_size() / 2**20
    return out


def bench_batch(model: LlamaModel, kernels: NativeKernels, batch: int, args: argparse.Namespace) -> dict:
    kv_dtype = getattr(torch, args.kv_cache_dtype)
    on_step, _ = _decode_step(model, batch, args.context, kernels, kv_dtype)
    off_step, _ = _decode_step(model, batch, args.context, None, kv_dtype)
    rounds = []
    for r in range(args.rounds):
        times = {}
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
            install(model, kernels if name == "on" else None)
            times[name] = _ms(on_step if name == "on" else off_step, args.steps, model.device)
        rounds.append({**times, "speedup": times["off"] / times["on"], "load": loadavg()})
    ids = []
    for name, step in (("off", off_step), ("on", on_step)):  # the same inputs, one more step each: its ids
        install(model, kernels if name == "on" else None)
        ids.append(step())
    install(model, None)
    return {"batch": batch, "rounds": rounds,
            "off_ms": median_range([r["off"] for r in rounds]), "on_ms": median_range([r["on"] for r in rounds]),
            "speedup": median_range([r["speedup"] for r in rounds]), "ids_equal": bool(torch.equal(*ids)),
            "attention": _attention_alone(kernels, batch, args.context, args.steps, kv_dtype)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the dtype of the K/V buffers (the model stays float32)")
    parser.add_argument("--out", default="bench-results/native_kernels.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit(f"the native kernels could not be built: {kernel_problem()}")
    info = machine_info("cpu")
    print(header(info), flush=True)
    model = LlamaModel.from_seed(ANCHOR, 0, device="cpu")
    model.pack("auto")
    rows = []
    with torch.inference_mode():
        for batch in args.batches:
            rows.append(bench_batch(model, kernels, batch, args))
            r = rows[-1]
            print(f"  batch {batch}: speedup {r['speedup']['median']:.2f}, load {loadavg()}", flush=True)
    print(f"\ndecode step of the anchor model, context {args.context}, K/V {args.kv_cache_dtype}, ms of thread CPU "
          f"time, median (range) over "
          f"{args.rounds} rounds; load at end {loadavg()}")
    print(f"{'batch':>5} | {'torch ops':>20} | {'native kernels':>20} | {'speedup':>18} | ids equal | "
          f"attention, 1 layer: torch / native ms (K/V MiB)")
    for r in rows:
        a = r["attention"]

        def fmt(s: dict, digits: int = 2) -> str:
            return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

        print(f"{r['batch']:>5} | {fmt(r['off_ms']):>20} | {fmt(r['on_ms']):>20} | {fmt(r['speedup']):>18} | "
              f"{str(r['ids_equal']):>9} | {a['torch_ms']:.3f} / {a['native_ms']:.3f} ({a['kv_mib']:.1f})")
    return write_results(args.out, {"machine": info, "context": args.context, "rounds": args.rounds,
                                    "kv_cache_dtype": args.kv_cache_dtype,
                                    "threads": args.threads, "rows": rows, "time": time.time()})


if __name__ == "__main__":
    main()
