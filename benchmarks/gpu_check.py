"""GPU check: CUDA against CPU outputs, CUDA graphs on and off, host syncs per decode step.

    python benchmarks/gpu_check.py --device cuda --out bench-results/gpu_check

Run by benchmarks/gpu_check.sh (docs/gpu.md), which also runs the tests and the
benchmarks on the device. For each case (a dense model, an MoE model, HiSparse,
the in-process decode role) the same prompts are decoded greedily, with each
token's logprob, by:

    cpu fp32                      the reference
    device fp32, graphs on        tokens should equal the reference
    device bf16, graphs on / off  graphs must not change what a step computes
    cpu bf16                      bf16 rounding on the host, for scale
    device fp32 / bf16 with decode runs (`decode_steps=4`; graphs on / off)
                                  runs must not change what the steps compute
    device / cpu fp32 with a bf16 KV cache (`kv_cache_dtype`)
                                  the device's rounding of the cache against the host's

and the first token's logprob differences are reported. Then one engine per
case decodes a batch while every step runs under torch's sync debug mode: the
syncs of each decode step are counted (the design allows one: the read-back;
HiSparse adds one per layer), and a profile of the run counts copies from
pageable host memory (each one a hidden sync; the design has none).

Prints a table and writes gpu_check.json and gpu_check.md under --out. Exit
status 0 when every check holds, 1 otherwise; a case that raises is reported
as failed with its error and the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import loadavg, machine_info  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.logging import configure_logging  # noqa: E402
from hisparse import HiSparseConfig  # noqa: E402

NEW_TOKENS = 12
HISPARSE = HiSparseConfig(top_k=32, device_buffer_size=48, recent_window=4, index_dim=16)
CASES: dict[str, dict[str, Any]] = {
    "dense": {"model": "tiny"},
    "moe": {"model": "tiny-moe"},
    "hisparse": {"model": "tiny", "hisparse": HISPARSE},
    "decode-role": {"model": "tiny", "disaggregation": "decode"},
}
#: what each check must reach (fractions of sequences whose greedy ids are equal, logprob gaps)
MIN_FP32_EQUAL = 0.75
MIN_GRAPHS_EQUAL = 0.75
MAX_FP32_LOGPROB_GAP = 2e-3
MAX_BF16_LOGPROB_GAP = 0.25


def prompts(case: str) -> list[list[int]]:
    length = 80 if case == "hisparse" else 24  # HiSparse: longer than top_k, so selection runs
    return [[(13 * i + 7 * j) % 250 + 1 for j in range(length + 3 * i)] for i in range(6)]


def config(case: str, device: str, dtype: str, graphs: bool, decode_steps: int = 1,
           kv_cache_dtype: str = "auto") -> EngineConfig:
    return EngineConfig(**CASES[case], device=device, dtype=dtype, cuda_graphs=graphs, page_size=16,
                        num_kv_pages=256, max_running=8, max_context=512, max_prefill_tokens=256,
                        prefix_cache=False, use_entry_points=False, leak_check="raise", decode_steps=decode_steps,
                        kv_cache_dtype=kv_cache_dtype)


async def decode(cfg: EngineConfig, batch: list[list[int]]) -> dict:
    """Greedy ids and per-token logprobs of every prompt (all at once), and the graph state."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ids: list[list[int]] = [[] for _ in batch]
    logprobs: list[list[float]] = [[] for _ in batch]
    async with Engine(cfg) as engine:

        async def one(i: int) -> None:
            async with engine.generate(batch[i], params) as stream:
                async for out in stream:
                    ids[i].extend(out.new_token_ids)
                    logprobs[i].extend(e.logprob for e in out.logprobs or ())

        async with anyio.create_task_group() as tg:
            for i in range(len(batch)):
                tg.start_soon(one, i)
        await engine.wait_idle(30)
        engine.check_memory()
        graphs = engine.parts.runner.graphs
        state = {"captured": 0 if graphs is None else len(graphs._graphs),
                 "disabled": None if graphs is None else graphs.disabled,
                 "replays": 0 if graphs is None else graphs.replays}
    return {"ids": ids, "logprobs": logprobs, "graphs": state}


def compare(a: dict, b: dict) -> dict:
    equal = sum(x == y for x, y in zip(a["ids"], b["ids"], strict=True)) / len(a["ids"])
    first_gap = max(abs(x[0] - y[0]) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    return {"equal_sequences": equal, "first_logprob_gap": first_gap}


def parity(case: str, device: str) -> dict:
    batch = prompts(case)
    runs = {
        "cpu_fp32": config(case, "cpu", "float32", False),
        "dev_fp32_graphs": config(case, device, "float32", True),
        "dev_bf16_graphs": config(case, device, "bfloat16", True),
        "dev_bf16_eager": config(case, device, "bfloat16", False),
        "cpu_bf16": config(case, "cpu", "bfloat16", False),
    }
    if case != "hisparse":  # decode runs: the same steps, several per plan (HiSparse refuses them)
        runs["dev_fp32_graphs_runs"] = config(case, device, "float32", True, decode_steps=4)
        runs["dev_bf16_eager_runs"] = config(case, device, "bfloat16", False, decode_steps=4)
        # a float32 model over a bfloat16 KV cache (HiSparse refuses it too)
        runs["dev_fp32_kvbf16"] = config(case, device, "float32", True, kv_cache_dtype="bfloat16")
        runs["cpu_fp32_kvbf16"] = config(case, "cpu", "float32", False, kv_cache_dtype="bfloat16")
    out = {name: anyio.run(decode, cfg, batch) for name, cfg in runs.items()}
    result = {
        "fp32_device_vs_cpu": compare(out["dev_fp32_graphs"], out["cpu_fp32"]),
        "bf16_graphs_vs_eager": compare(out["dev_bf16_graphs"], out["dev_bf16_eager"]),
        "bf16_device_vs_cpu": compare(out["dev_bf16_graphs"], out["cpu_bf16"]),
        "graphs": {name: run["graphs"] for name, run in out.items()},
    }
    if "dev_fp32_graphs_runs" in out:
        result["runs_vs_steps"] = min(compare(out["dev_fp32_graphs_runs"], out["dev_fp32_graphs"])["equal_sequences"],
                                      compare(out["dev_bf16_eager_runs"], out["dev_bf16_eager"])["equal_sequences"])
        result["kv_bf16_device_vs_cpu"] = compare(out["dev_fp32_kvbf16"], out["cpu_fp32_kvbf16"])
    graphs_used = case == "hisparse" or out["dev_bf16_graphs"]["graphs"]["replays"] > 0 or device == "cpu"
    result["ok"] = bool(
        result["fp32_device_vs_cpu"]["equal_sequences"] >= MIN_FP32_EQUAL
        and result["fp32_device_vs_cpu"]["first_logprob_gap"] <= MAX_FP32_LOGPROB_GAP
        and result["bf16_graphs_vs_eager"]["equal_sequences"] >= MIN_GRAPHS_EQUAL
        and result["bf16_device_vs_cpu"]["first_logprob_gap"] <= MAX_BF16_LOGPROB_GAP
        and result.get("runs_vs_steps", 1.0) >= MIN_GRAPHS_EQUAL
        and result.get("kv_bf16_device_vs_cpu", {}).get("first_logprob_gap", 0.0) <= MAX_BF16_LOGPROB_GAP
        and graphs_used)
    return result


async def _count_syncs(cfg: EngineConfig, batch: list[list[int]]) -> dict:
    """Syncs per step under torch's sync debug mode, by step kind, and pageable copies in a profile."""
    per_step: list[tuple[bool, int]] = []
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    async with Engine(cfg) as engine:
        runner = engine.parts.runner
        original = runner.step

        def step(seqs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = original(seqs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            per_step.append((all(s.num_tokens == 1 for s in seqs), syncs))
            return out

        runner.step = step
        await _complete_all(engine, batch, params)  # warm-up: allocator, kernels
        per_step.clear()
        await _complete_all(engine, batch, params)
        await engine.wait_idle(30)
    decode = [n for is_decode, n in per_step if is_decode]
    return {"decode_steps": len(decode), "syncs_per_decode_step_max": max(decode, default=None),
            "syncs_per_decode_step_mean": sum(decode) / len(decode) if decode else None,
            "other_steps": len(per_step) - len(decode)}


async def _complete_all(engine: Engine, batch: list[list[int]], params: SamplingParams) -> None:
    async with anyio.create_task_group() as tg:
        for p in batch:
            tg.start_soon(engine.complete, p, params)


async def _profiled(cfg: EngineConfig, batch: list[list[int]]) -> dict:
    """Pageable host copies and sync calls in a profile of one run of the batch (after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    steps = 0
    async with Engine(cfg) as engine:
        await _complete_all(engine, batch, params)
        original = engine.parts.runner.step

        def counted(seqs):
            nonlocal steps
            steps += 1
            return original(seqs)

        engine.parts.runner.step = counted
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            await _complete_all(engine, batch, params)
        await engine.wait_idle(30)
    counts: dict[str, int] = {}
    for event in prof.events():
        name = event.name
        if "Pageable" in name or name in SYNC_CALLS or name == "cudaStreamWaitEvent":
            counts[name] = counts.get(name, 0) + 1
    syncs = sum(n for name, n in counts.items() if name in SYNC_CALLS)
    return {"steps": steps, "events": counts, "syncs_per_step": syncs / steps if steps else None,
            "pageable": sum(n for name, n in counts.items() if "Pageable" in name)}


#: CUDA runtime calls that make the host wait
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def syncs(case: str, device: str) -> dict:
    cfg = config(case, device, "bfloat16", True)
    batch = prompts(case)
    result: dict[str, Any] = {"graphs_on": anyio.run(_count_syncs, cfg, batch)}
    if case == "dense":
        result["graphs_off"] = anyio.run(_count_syncs, config(case, device, "bfloat16", False), batch)
    try:
        result["profile"] = anyio.run(_profiled, cfg, batch)
    except Exception as exc:  # noqa: BLE001 - the profiler may be unavailable on a machine
        result["profile"] = f"unavailable: {exc!r}"
    layers = 4
    # the read-back; HiSparse: one selection per layer (every decode row of the check is scored)
    allowed = 1 + (layers if case == "hisparse" else 0)
    result["allowed_per_decode_step"] = allowed
    profile = result["profile"]
    if isinstance(profile, dict):  # NOTE: the profile counts every host wait of every step, prefill included
        result["ok"] = profile["pageable"] == 0 and profile["syncs_per_step"] is not None \
            and profile["syncs_per_step"] <= allowed + 0.5
    else:
        worst = result["graphs_on"]["syncs_per_decode_step_max"]
        result["ok"] = worst is not None and worst <= allowed
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench-results/gpu_check")
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args(argv)
    configure_logging("error")
    torch.set_num_threads(4)
    info = machine_info(args.device)
    if args.device.startswith("cuda"):
        info["cuda"] = torch.version.cuda
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(torch.device(args.device))))
    results: dict[str, Any] = {"machine": info, "cases": {}}
    for case in args.cases:
        entry: dict[str, Any] = {}
        for part, fn in (("parity", parity), ("syncs", syncs)):
            if part == "syncs" and not args.device.startswith("cuda"):
                continue
            t0 = time.perf_counter()
            try:
                entry[part] = fn(case, args.device)
            except Exception as exc:  # noqa: BLE001 - report it and go on with the next case
                entry[part] = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
            entry[part]["seconds"] = round(time.perf_counter() - t0, 1)
            print(f"{case} {part}: {'ok' if entry[part].get('ok') else 'FAILED'} "
                  f"({entry[part]['seconds']} s, load {loadavg()})", flush=True)
        results["cases"][case] = entry
    results["ok"] = all(part.get("ok") for entry in results["cases"].values() for part in entry.values())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    table = render(results)
    (out / "gpu_check.md").write_text(table)
    print(table)
    return 0 if results["ok"] else 1


def render(results: dict) -> str:
    info = results["machine"]
    lines = [f"GPU check on {info.get('device')} (torch {info['torch']}, CUDA {info.get('cuda')}), "
             f"load {info['load_at_start']} at start", "",
             "| case | fp32 dev=cpu seqs | fp32 1st-logprob gap | bf16 graphs=eager seqs | bf16 dev-cpu 1st gap "
             "| decode runs = steps seqs | kv bf16 dev=cpu seqs / 1st gap | graphs captured / replays "
             "| syncs per decode step: debug mode max / profile per step / allowed | pageable copies | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, entry in results["cases"].items():
        p, s = entry.get("parity", {}), entry.get("syncs", {})
        if "error" in p:
            lines.append(f"| {case} | error: {p['error'][:80]} | | | | | | | | | no |")
            continue
        graphs = p["graphs"]["dev_bf16_graphs"]
        on = s.get("graphs_on", {})
        profile = s.get("profile")
        pageable = profile["pageable"] if isinstance(profile, dict) else "-"
        per_step = profile.get("syncs_per_step") if isinstance(profile, dict) else None
        profiled = "-" if per_step is None else f"{per_step:.2f}"
        ok = p.get("ok") and s.get("ok", True)
        kv = p.get("kv_bf16_device_vs_cpu")
        kv_cell = "-" if kv is None else f"{kv['equal_sequences']:.2f} / {kv['first_logprob_gap']:.3f}"
        lines.append(
            f"| {case} | {p['fp32_device_vs_cpu']['equal_sequences']:.2f} | "
            f"{p['fp32_device_vs_cpu']['first_logprob_gap']:.2e} | {p['bf16_graphs_vs_eager']['equal_sequences']:.2f} | "
            f"{p['bf16_device_vs_cpu']['first_logprob_gap']:.3f} | "
            f"{'-' if 'runs_vs_steps' not in p else format(p['runs_vs_steps'], '.2f')} | {kv_cell} | "
            f"{graphs['captured']} / {graphs['replays']} | "
            f"{on.get('syncs_per_decode_step_max', '-')} / {profiled} / {s.get('allowed_per_decode_step', '-')} | "
            f"{pageable} | "
            f"{'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
