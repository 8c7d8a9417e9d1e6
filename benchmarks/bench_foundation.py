"""Foundation benchmark: the page allocator and the prefix cache against SGLang and vLLM, side by side.

    python benchmarks/bench_foundation.py [--repeat 3] [--peers-python PATH] [--quick]
        [--out bench-results/foundation.json]

The workloads are /work/shared/ANCHORS.md's (see `foundation_workloads.py`
for their exact definition and `foundation_kvlife.py` / `foundation_peers.py`
for each row). Every row runs in its own process, all rows of a repeat in
one order that rotates between repeats, and each ratio is taken between rows
of the same repeat; the table prints the median and the range over repeats.

Peers run under `--peers-python`, the interpreter of a separate environment
where SGLang and vLLM are installed (never the project's)::

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install torch numpy
    /tmp/peers/bin/pip install --no-deps sglang vllm   # then what their imports ask for

A peer that cannot run here is reported with the reason, and the anchor
sheet's figure is printed beside ours, marked [anchor].
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import add_device_option, fmt, header, loadavg, machine_info, median_range  # noqa: E402

ALLOCATOR_ROWS = ["kvlife PageAllocator", "kvlife page-table rows (hook as it should)", "kvlife machine + KVHook", "sglang PagedTokenToKVPoolAllocator (page 16)",
                  "sglang TokenToKVPoolAllocator (page 1)", "vllm v1 BlockPool (page 16)", "python list"]
PREFIX_ROWS = ["kvlife radix (hook arrays)", "kvlife machine + KVHook", "sglang RadixCache (page 16)"]
ANCHOR_ALLOC = {"sglang PagedTokenToKVPoolAllocator (page 16)": 11_740,
                "sglang TokenToKVPoolAllocator (page 1)": 4_222,
                "vllm v1 BlockPool (page 16)": 54_241, "python list": 304_830}
ANCHOR_PREFIX = {"sglang RadixCache (page 16)": (3_346, 0.582)}
VLLM, SGLANG_PAGED = "vllm v1 BlockPool (page 16)", "sglang PagedTokenToKVPoolAllocator (page 16)"
SGLANG_RADIX = "sglang RadixCache (page 16)"


def run_row(python: str, workload: str, adapter: str, quick: bool, device: str = "cpu") -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, str(ROOT / "benchmarks" / "foundation_workloads.py"), workload, adapter, "--out", out.name,
               "--device", device]
        proc = subprocess.run(cmd + (["--quick"] if quick else []), cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        text = Path(out.name).read_text()
    if proc.returncode or not text:
        return {"adapter": adapter, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(text)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--peers-python", default="/tmp/peers/bin/python",
                        help="python of the environment with sglang and vllm (not the project's)")
    parser.add_argument("--quick", action="store_true", help="a tenth of each workload (smoke run)")
    parser.add_argument("--out", default="bench-results/foundation.json")
    add_device_option(parser)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as every row does
    info = machine_info(args.device)
    print(header(info), flush=True)
    peers = Path(args.peers_python).exists()
    runs: dict[str, list[dict]] = {"allocator": [], "prefix": []}
    for rep in range(args.repeat):
        for workload, rows in (("allocator", ALLOCATOR_ROWS), ("prefix", PREFIX_ROWS)):
            order = rows[rep % len(rows):] + rows[: rep % len(rows)]
            results = {}
            for adapter in order:
                is_peer = adapter.startswith(("sglang", "vllm"))
                if is_peer and not peers:
                    results[adapter] = {"adapter": adapter, "error": f"no peer environment at {args.peers_python}"}
                    continue
                results[adapter] = run_row(args.peers_python if is_peer else sys.executable, workload, adapter,
                                           args.quick, args.device)
            runs[workload].append(results)
            print(f"  repeat {rep + 1} {workload}: load {loadavg()}", flush=True)
    info["load_at_end"] = loadavg()
    summary = {"allocator": summarize(runs["allocator"], "lifecycles_per_s", ALLOCATOR_ROWS, [VLLM, SGLANG_PAGED]),
               "prefix": summarize(runs["prefix"], "requests_per_s", PREFIX_ROWS, [SGLANG_RADIX])}
    print_tables(summary, info)
    results = {"machine": info, "runs": runs, "summary": summary, "quick": args.quick,
               "peers_python": args.peers_python}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return results


def summarize(runs: list[dict], rate: str, rows: list[str], references: list[str]) -> dict:
    out = {}
    for adapter in rows:
        ok = [r[adapter] for r in runs if "error" not in r[adapter]]
        entry = {"errors": [r[adapter]["error"] for r in runs if "error" in r[adapter]]}
        if ok:
            for key in (rate, "alloc_us_mean", "free_us_mean", "hit_rate"):
                if key in ok[0]:
                    entry[key] = median_range([r[key] for r in ok])
            for key in ("rejects_double_free", "pages_leaked", "leak_check"):
                if key in ok[0]:
                    entry[key] = sorted({str(r[key]) for r in ok})
            for ref in references:
                ratios = [r[adapter][rate] / r[ref][rate] for r in runs
                          if "error" not in r[adapter] and "error" not in r[ref]]
                if ratios:
                    entry[f"x {ref}"] = median_range(ratios)
        out[adapter] = entry
    return out


def print_tables(summary: dict, info: dict) -> None:
    print(f"\n{header(info)}; load at end {info['load_at_end']}")
    print("\nallocator workload: lifecycles/s, median (range) over repeats; x = ratio within each repeat")
    print(f"{'allocator':<46} | {'lifecycles/s':>26} | {'alloc us':>18} | {'free us':>20} | {'x vLLM':>16} | "
          f"{'x SGLang paged':>19} | double free rejected | leaked")
    for adapter, e in summary["allocator"].items():
        if "lifecycles_per_s" not in e:
            anchor = ANCHOR_ALLOC.get(adapter)
            note = f"; anchor {anchor:,}/s [anchor]" if anchor else ""
            print(f"{adapter:<46} | not run here: {e['errors'][:1]}{note}")
            continue
        print(f"{adapter:<46} | {fmt(e['lifecycles_per_s']):>26} | {fmt(e['alloc_us_mean'], 2):>18} | "
              f"{fmt(e['free_us_mean'], 2):>20} | {fmt(e.get('x ' + VLLM), 2):>16} | "
              f"{fmt(e.get('x ' + SGLANG_PAGED), 2):>19} | {'/'.join(e['rejects_double_free']):>20} | "
              f"{'/'.join(e['pages_leaked'])}")
    print("\nprefix workload: requests/s and hit rate, median (range) over repeats")
    print(f"{'prefix cache':<46} | {'requests/s':>24} | {'hit rate':>22} | {'x SGLang radix':>18} | leak check")
    for adapter, e in summary["prefix"].items():
        if "requests_per_s" not in e:
            anchor = ANCHOR_PREFIX.get(adapter)
            note = f"; anchor {anchor} [anchor]" if anchor else ""
            print(f"{adapter:<46} | not run here: {e['errors'][:1]}{note}")
            continue
        print(f"{adapter:<46} | {fmt(e['requests_per_s']):>24} | {fmt(e['hit_rate'], 3):>22} | "
              f"{fmt(e.get('x ' + SGLANG_RADIX), 2):>18} | {'/'.join(e['leak_check'])}")


if __name__ == "__main__":
    main()
