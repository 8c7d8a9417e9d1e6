"""Engine benchmark: kvlife against transformers `generate()` and the floor, one checkpoint, one process.

    python benchmarks/bench_engine.py [--batches 1 8 32 128] [--repeat 3] [--threads 1]
        [--new-tokens 64] [--prompt-len 128] [--native-kernels auto] [--inline-step-ms MS] [--decode-steps K]
        [--out bench-results/engine.json] [--quick]

1. One checkpoint, written by transformers' `save_pretrained`: the anchor tiny
   Llama (hidden 256, 4 layers, 4 heads / 4 KV heads, MLP 1024, vocab
   32,000, untied, fp32), random weights from `torch.manual_seed(0)`.
2. Loaded into transformers (`LlamaForCausalLM.from_pretrained`) and into
   kvlife (`EngineConfig(model=DIR)`) in this process; both run with the same
   torch thread count (`--threads`, printed).
3. Per batch size B: B seeded random prompts of `--prompt-len` tokens, greedy,
   `--new-tokens` new tokens each (transformers: no EOS, `min_new_tokens`;
   kvlife: `ignore_eos`), and the same with one new token. *e2e tok/s* =
   B * new tokens / wall time (prefill included); *decode tok/s* =
   B * (new tokens - 1) / (wall(new tokens) - wall(1)), the same arithmetic for
   both; *step ms* = that difference / (new tokens - 1).
4. The floor: the same weights through nothing but the matmuls a decode step
   needs (per layer q/k/v, o, gate/up, down, then the LM head), back to back
   on a [B, hidden] input, no attention, no norms, no Python around them but
   the loop; in the checkpoint's layout (`F.linear`), in the packed layout
   (`torch.mm` on [in, out]) and in oneDNN's blocked layout (where it applies:
   what kvlife's default `weight_layout` uses on CPU), the fastest quoted.
   Beside it, the attention a decode step cannot avoid: per layer the
   queries over contiguous K and V of the mean decode context (prompt +
   new / 2), the faster of SDPA and matmul-softmax-matmul, and the time to read
   those K/V bytes once at the run's sum bandwidth (1 GiB): what no attention
   can beat (`engine_floor.py`). `--native-kernels` sets kvlife's
   `EngineConfig.native_kernels` (default "auto": its CPU kernels on).
   `--kv-cache-dtype bfloat16` stores kvlife's KV cache in bfloat16 (the
   model still computes in float32; transformers' cache stays float32, so
   greedy ids may differ where two logits lie within that rounding: the
   table counts them), and the K/V-read bound counts 2 bytes an element.
5. Memory bandwidth, in the same run: a copy and a sum of a 64 MiB tensor
   (in the last-level cache here) and of a 1 GiB one.

Repeats are interleaved (transformers, kvlife, floor, rotating the order each
repeat) and every ratio is taken within one repeat; the table prints the
median and the range over repeats. Greedy ids are compared on every repeat.
kvlife's own split of a decode step comes from the runner's step timings:
*engine work* = the mean decode interval (from the end of one decode step of
every row to the end of the next) minus the mean forward pass and sampling of
those steps, as a share of that interval. (Before decode runs,
`--decode-steps`, it was taken from the median gap between tokens, printed
as *ITL*; a run streams its tokens in bursts, so that median says nothing of
it.) Prints the tables and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import (add_device_option, bandwidth, fmt, header, loadavg, machine_info,  # noqa: E402
                                median_range, write_results)
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.logging import configure_logging  # noqa: E402
from benchmarks.engine_floor import ANCHOR, Floor  # noqa: E402

PAGE = 16


def write_checkpoint(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**ANCHOR, torch_dtype="float32")).eval()
    model.save_pretrained(directory)
    return directory


def make_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, ANCHOR["vocab_size"]) for _ in range(length)] for _ in range(batch)]


# ------------------------------------------------------------ transformers
class HFGenerate:
    def __init__(self, directory: Path, device: str = "cpu") -> None:
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.device = torch.device(device)
        self.model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).to(self.device).eval()

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        from transformers import GenerationConfig

        ids = torch.tensor(prompts, device=self.device)
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            wall = time.perf_counter() - t0
        return wall, out[:, ids.shape[1]:].tolist()


# ------------------------------------------------------------------ kvlife
#: bytes of one K or V element in each `--kv-cache-dtype` (the checkpoint is float32)
KV_BYTES = {"auto": 4, "float32": 4, "float16": 2, "bfloat16": 2}


def engine_config(directory: Path, batch: int, prompt_len: int, new_tokens: int, device: str = "cpu",
                  native_kernels: str = "auto", inline_step_ms: float | None = None,
                  decode_steps: int = 1, kv_cache_dtype: str = "auto") -> EngineConfig:
    per_request = -(-(prompt_len + new_tokens) // PAGE) + 1
    return EngineConfig(model=str(directory), device=device, max_running=batch, num_kv_pages=batch * per_request + 2,
                        max_context=prompt_len + new_tokens + PAGE, max_prefill_tokens=4096,
                        prefix_cache=False, leak_check="raise", use_entry_points=False,
                        native_kernels=native_kernels, decode_steps=decode_steps, kv_cache_dtype=kv_cache_dtype,
                        **({} if inline_step_ms is None else {"inline_step_ms": inline_step_ms}))


async def complete_all(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """Every prompt submitted at once, greedy, `new_tokens` each: the wall time and the final outputs."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outputs: list = [None] * len(prompts)

    async def one(i: int) -> None:
        outputs[i] = await engine.complete(prompts[i], params)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - t0, outputs


async def kvlife_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    runner = engine.parts.runner
    runner.timings = []
    itl_before = engine.stats.itl.total
    wall, outputs = await complete_all(engine, prompts, new_tokens)
    await engine.wait_idle(30)
    engine.check_memory()
    new_itl = engine.stats.itl.total - itl_before
    itl = list(engine.stats.itl.samples)[-new_itl:] if new_itl else []
    timings = runner.timings
    decode = [t for t in timings if t.decode_only and t.batch == len(prompts)]
    runner.timings = None
    # a decode step's interval: from the end of the step before it (also a decode step of every row)
    # to its own end; a decode run's first step holds the loop's work of the whole run (a run streams
    # its tokens in bursts, so the gaps between tokens would say nothing of it)
    full = [t.decode_only and t.batch == len(prompts) for t in timings]
    paired = [i for i in range(1, len(timings)) if full[i] and full[i - 1]]
    intervals = [timings[i].ended - timings[i - 1].ended for i in paired]
    return {
        "wall_s": wall,
        "ids": [o.token_ids for o in outputs],
        "itl_ms": 1e3 * statistics.median(itl) if itl else None,
        "interval_ms": 1e3 * statistics.mean(intervals) if intervals else None,
        "prepare_ms": 1e3 * statistics.median(t.prepare_s for t in decode) if decode else None,
        "forward_ms": 1e3 * statistics.median(t.forward_s for t in decode) if decode else None,
        "forward_mean_ms": 1e3 * statistics.mean(timings[i].forward_s for i in paired) if paired else None,
    }


# ------------------------------------------------------------------- floor
# ------------------------------------------------------------------- main
async def bench_batch(args, directory: Path, hf: HFGenerate, floor: Floor, batch: int) -> dict:
    prompts = make_prompts(batch, args.prompt_len)
    n = args.new_tokens
    runs = []
    kvlife = ["kvlife", "runs"] if args.decode_steps > 1 else ["kvlife"]
    async with contextlib.AsyncExitStack() as stack:
        engines = {who: await stack.enter_async_context(Engine(engine_config(
            directory, batch, args.prompt_len, n, args.device, args.native_kernels, args.inline_step_ms,
            args.decode_steps if who == "runs" else 1, args.kv_cache_dtype))) for who in kvlife}
        for engine in engines.values():
            await kvlife_run(engine, prompts[:1], 2)  # warm-up, every engine
        hf.run(prompts[:1], 2)
        for rep in range(args.repeat):
            order = ["hf", *kvlife, "floor"]
            order = order[rep % len(order):] + order[: rep % len(order)]
            run: dict = {"order": order, "load": loadavg()}
            for who in order:
                if who == "hf":
                    wall_1, _ = hf.run(prompts, 1)
                    wall_n, ids = hf.run(prompts, n)
                    run["hf"] = {"wall_1_s": wall_1, "wall_s": wall_n, "ids": ids}
                elif who == "floor":
                    run["floor"] = floor.run(batch, args.prompt_len + n // 2, kv_bytes=KV_BYTES[args.kv_cache_dtype])
                else:
                    one = await kvlife_run(engines[who], prompts, 1)
                    run[who] = await kvlife_run(engines[who], prompts, n)
                    run[who]["wall_1_s"] = one["wall_s"]
            for who in ("hf", *kvlife):
                r = run[who]
                r["e2e_tok_s"] = batch * n / r["wall_s"]
                r["step_ms"] = 1e3 * (r["wall_s"] - r["wall_1_s"]) / (n - 1)
                r["decode_tok_s"] = batch / r["step_ms"] * 1e3
            for who in kvlife:  # "kvlife": every step planned; "runs": decode runs (--decode-steps)
                kv, key = run[who], "" if who == "kvlife" else "_runs"
                run["greedy_equal" + key] = sum(a == b for a, b in zip(kv["ids"], run["hf"]["ids"]))
                run["x_hf_e2e" + key] = kv["e2e_tok_s"] / run["hf"]["e2e_tok_s"]
                run["x_hf_decode" + key] = kv["decode_tok_s"] / run["hf"]["decode_tok_s"]
                run["x_floor" + key] = run["floor"]["step_ms"] / kv["step_ms"]
                floor_ms = run["floor"]["step_ms"]
                run["x_floor_attention" + key] = (floor_ms + run["floor"]["attention_ms"]) / kv["step_ms"]
                run["x_floor_kv_read" + key] = (floor_ms + run["floor"]["kv_read_ms"]) / kv["step_ms"]
                if kv["forward_mean_ms"] is not None and kv["interval_ms"]:  # NOTE: two means: a run's steps vary
                    run["engine_work_share" + key] = 1 - kv["forward_mean_ms"] / kv["interval_ms"]
            if "runs" in run:
                run["runs_x_plain_decode"] = run["runs"]["decode_tok_s"] / run["kvlife"]["decode_tok_s"]
            for who in ("hf", *kvlife):
                del run[who]["ids"]
            runs.append(run)
            print(f"  batch {batch} repeat {rep + 1}: x HF e2e {run['x_hf_e2e']:.2f}, decode {run['x_hf_decode']:.2f}, "
                  f"x floor {run['x_floor']:.2f}, greedy equal {run['greedy_equal']}/{batch}, load {run['load']}"
                  + (f"; decode runs: x floor {run['x_floor_runs']:.2f}, greedy equal {run['greedy_equal_runs']}"
                     if "runs" in run else ""), flush=True)
    return summarize(batch, runs)


def summarize(batch: int, runs: list[dict]) -> dict:
    def stat(get):
        values = [get(r) for r in runs]
        values = [v for v in values if v is not None]
        return median_range(values) if values else None

    return {
        "batch": batch,
        "hf_e2e_tok_s": stat(lambda r: r["hf"]["e2e_tok_s"]),
        "kvlife_e2e_tok_s": stat(lambda r: r["kvlife"]["e2e_tok_s"]),
        "x_hf_e2e": stat(lambda r: r["x_hf_e2e"]),
        "hf_decode_tok_s": stat(lambda r: r["hf"]["decode_tok_s"]),
        "kvlife_decode_tok_s": stat(lambda r: r["kvlife"]["decode_tok_s"]),
        "x_hf_decode": stat(lambda r: r["x_hf_decode"]),
        "hf_step_ms": stat(lambda r: r["hf"]["step_ms"]),
        "kvlife_step_ms": stat(lambda r: r["kvlife"]["step_ms"]),
        "floor_step_ms": stat(lambda r: r["floor"]["step_ms"]),
        "floor_linear_ms": stat(lambda r: r["floor"]["linear_ms"]),
        "floor_packed_ms": stat(lambda r: r["floor"]["packed_ms"]),
        "floor_onednn_ms": stat(lambda r: r["floor"].get("onednn_ms")),
        "x_floor": stat(lambda r: r["x_floor"]),
        "floor_attention_ms": stat(lambda r: r["floor"]["attention_ms"]),
        "x_floor_attention": stat(lambda r: r["x_floor_attention"]),
        "floor_kv_read_ms": stat(lambda r: r["floor"]["kv_read_ms"]),
        "x_floor_kv_read": stat(lambda r: r["x_floor_kv_read"]),
        "kvlife_itl_ms": stat(lambda r: r["kvlife"]["itl_ms"]),
        "kvlife_interval_ms": stat(lambda r: r["kvlife"]["interval_ms"]),
        "kvlife_prepare_ms": stat(lambda r: r["kvlife"]["prepare_ms"]),
        "kvlife_forward_ms": stat(lambda r: r["kvlife"]["forward_ms"]),
        "engine_work_share": stat(lambda r: r.get("engine_work_share")),
        "greedy_equal": [r["greedy_equal"] for r in runs],
        # decode runs (--decode-steps K > 1): the same figures for an engine with decode_steps=K
        "runs_step_ms": stat(lambda r: r["runs"]["step_ms"] if "runs" in r else None),
        "runs_interval_ms": stat(lambda r: r["runs"]["interval_ms"] if "runs" in r else None),
        "runs_forward_mean_ms": stat(lambda r: r["runs"]["forward_mean_ms"] if "runs" in r else None),
        "kvlife_forward_mean_ms": stat(lambda r: r["kvlife"]["forward_mean_ms"]),
        "x_hf_decode_runs": stat(lambda r: r.get("x_hf_decode_runs")),
        "x_floor_runs": stat(lambda r: r.get("x_floor_runs")),
        "x_floor_kv_read_runs": stat(lambda r: r.get("x_floor_kv_read_runs")),
        "engine_work_share_runs": stat(lambda r: r.get("engine_work_share_runs")),
        "runs_x_plain_decode": stat(lambda r: r.get("runs_x_plain_decode")),
        "greedy_equal_runs": [r["greedy_equal_runs"] for r in runs if "greedy_equal_runs" in r],
        "runs": runs,
    }


def print_tables(rows: list[dict], info: dict, bw: dict, floor_mib: float) -> None:
    print(f"\n{header(info)}; load at end {info['load_at_end']}")
    print(f"bandwidth: copy {bw['copy_64MiB_GBps']:.1f} GB/s (64 MiB), {bw['copy_1GiB_GBps']:.1f} GB/s (1 GiB); "
          f"sum {bw['sum_64MiB_GBps']:.1f} / {bw['sum_1GiB_GBps']:.1f} GB/s; decode weights {floor_mib:.1f} MiB")
    print("\nnew tokens/s, median (range) over repeats; ratios taken within each repeat")
    print(f"{'batch':>5} | {'HF e2e':>20} | {'kvlife e2e':>20} | {'x HF e2e':>16} | {'HF decode':>20} | "
          f"{'kvlife decode':>20} | {'x HF decode':>16} | greedy equal")
    for r in rows:
        print(f"{r['batch']:>5} | {fmt(r['hf_e2e_tok_s']):>20} | {fmt(r['kvlife_e2e_tok_s']):>20} | "
              f"{fmt(r['x_hf_e2e'], 2):>16} | {fmt(r['hf_decode_tok_s']):>20} | {fmt(r['kvlife_decode_tok_s']):>20} | "
              f"{fmt(r['x_hf_decode'], 2):>16} | {'/'.join(map(str, r['greedy_equal']))} of {r['batch']}")
    print("\ndecode step, ms: HF and kvlife from wall(n) - wall(1); floor = the matmuls alone, the fastest layout; "
          "engine work = kvlife's mean decode interval (one decode step's end to the next's) minus the mean "
          "forward + sampling; ITL = the median gap between tokens")
    print(f"{'batch':>5} | {'HF step':>18} | {'kvlife step':>18} | {'floor':>18} | {'x floor':>16} | "
          f"{'kvlife ITL':>18} | {'interval':>18} | {'forward':>18} | {'prepare':>14} | {'engine work':>18}")
    for r in rows:
        share = r["engine_work_share"]
        share_s = "-" if share is None else (f"{100 * share['median']:.1f}% ({100 * share['min']:.1f}-"
                                             f"{100 * share['max']:.1f})")
        print(f"{r['batch']:>5} | {fmt(r['hf_step_ms'], 2):>18} | {fmt(r['kvlife_step_ms'], 2):>18} | "
              f"{fmt(r['floor_step_ms'], 2):>18} | {fmt(r['x_floor'], 2):>16} | {fmt(r['kvlife_itl_ms'], 2):>18} | "
              f"{fmt(r['kvlife_interval_ms'], 2):>18} | "
              f"{fmt(r['kvlife_forward_ms'], 2):>18} | {fmt(r['kvlife_prepare_ms'], 2):>14} | {share_s:>18}")
    if rows and rows[0]["runs_step_ms"] is not None:
        print("\ndecode runs (an engine with --decode-steps, alternated with the one above in every repeat): "
              "engine work from each engine's own mean decode interval and mean forward; x plain = its decode tok/s "
              "over the plain engine's in the same repeat")
        print(f"{'batch':>5} | {'step ms':>18} | {'x HF decode':>16} | {'x floor':>16} | {'interval':>18} | "
              f"{'fwd mean':>8} | {'engine work':>18} | {'plain engine work':>18} | {'x plain':>16} | greedy equal")
        for r in rows:
            share = (r["engine_work_share_runs"], r["engine_work_share"])
            shares = ["-" if v is None else f"{100 * v['median']:.1f}% ({100 * v['min']:.1f}-{100 * v['max']:.1f})"
                      for v in share]
            print(f"{r['batch']:>5} | {fmt(r['runs_step_ms'], 2):>18} | {fmt(r['x_hf_decode_runs'], 2):>16} | "
                  f"{fmt(r['x_floor_runs'], 2):>16} | {fmt(r['runs_interval_ms'], 2):>18} | "
                  f"{r['runs_forward_mean_ms']['median']:>8.2f} | {shares[0]:>18} | {shares[1]:>18} | "
                  f"{fmt(r['runs_x_plain_decode'], 2):>16} | "
                  f"{'/'.join(map(str, r['greedy_equal_runs']))} of {r['batch']}")
    print("\nthe floor by weight layout, ms (median over repeats): F.linear [out, in] / torch.mm [in, out] / oneDNN blocked")
    for r in rows:
        layouts = [r["floor_linear_ms"], r["floor_packed_ms"], r["floor_onednn_ms"]]
        print(f"{r['batch']:>5} | " + " / ".join("-" if v is None else f"{v['median']:.2f}" for v in layouts))
    print("\nthe floor with attention: + torch's attention over contiguous K/V of the mean decode context, or + "
          "reading that K/V once at the sum bandwidth (1 GiB); best reachable x floor = floor / (floor + either)")
    print(f"{'batch':>5} | {'attention ms':>18} | {'x (floor + attention)':>22} | {'best, attention':>15} | "
          f"{'K/V read ms':>11} | {'x (floor + K/V read)':>20} | {'best, K/V read':>14}")
    for r in rows:
        fl, at, read = (r[k]["median"] for k in ("floor_step_ms", "floor_attention_ms", "floor_kv_read_ms"))
        print(f"{r['batch']:>5} | {fmt(r['floor_attention_ms'], 2):>18} | {fmt(r['x_floor_attention'], 2):>22} | "
              f"{fl / (fl + at):>15.2f} | {read:>11.2f} | {fmt(r['x_floor_kv_read'], 2):>20} | "
              f"{fl / (fl + read):>14.2f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every engine")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out", default="bench-results/engine.json")
    parser.add_argument("--inline-step-ms", type=float, default=None,
                        help="EngineConfig.inline_step_ms for kvlife (default: the engine's; 0: tokens alone decide)")
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="EngineConfig.decode_steps for kvlife (default 1: every step planned; K: decode runs)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_BYTES),
                        help="EngineConfig.kv_cache_dtype for kvlife (auto: float32, the model's; bfloat16 halves the "
                             "K/V bytes a step reads, and the floor's K/V-read bound follows)")
    parser.add_argument("--native-kernels", default="auto", choices=["auto", "on", "off"],
                        help="EngineConfig.native_kernels for kvlife (docs/models.md)")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 2 repeats, 16 new tokens (smoke run)")
    add_device_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.repeat, args.new_tokens = [1, 8], 2, 16
    torch.set_num_threads(args.threads)
    configure_logging("warning")
    info = machine_info(args.device)
    print(header(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_checkpoint(Path(tmp) / "anchor-llama")
        hf, floor = HFGenerate(directory, args.device), Floor(directory, args.device)
        bw = bandwidth()
        floor.read_gbps = bw["sum_1GiB_GBps"]
        rows = [anyio.run(bench_batch, args, directory, hf, floor, batch) for batch in args.batches]
    bw_end = bandwidth()
    info["load_at_end"] = loadavg()
    print_tables(rows, info, bw, floor.nbytes / 2**20)
    results = {"machine": info, "bandwidth_start": bw, "bandwidth_end": bw_end,
               "workload": {"model": ANCHOR, "dtype": "float32", "prompt_len": args.prompt_len,
                            "new_tokens": args.new_tokens, "repeat": args.repeat, "threads": args.threads,
                            "native_kernels": args.native_kernels, "inline_step_ms": args.inline_step_ms,
                            "decode_steps": args.decode_steps, "kv_cache_dtype": args.kv_cache_dtype,
                            "floor_weight_bytes": floor.nbytes},
               "rows": rows}
    return write_results(args.out, results)


if __name__ == "__main__":
    main()
