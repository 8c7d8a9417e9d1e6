"""What every benchmark states beside its figures: the machine, torch's
threads and the load while it ran.

The development VMs are shared (2 cores, several sessions), so a figure
without the load it was measured under means little; ratios measured in one
run, side by side, are what the benchmarks quote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages, as /proc/loadavg gives them."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """`--device`: the torch device the benchmark's engines (and its baselines) run on."""
    parser.add_argument("--device", default="cpu",
                        help="torch device the engines run on: cpu (default), cuda, cuda:1 ... (docs/gpu.md)")


def device_name(device: str) -> str:
    """What `device` is: the GPU's name on CUDA, else the device string."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def machine_info(device: str = "cpu") -> dict:
    return {
        "device": device_name(device),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "load_at_start": loadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def header(info: dict) -> str:
    """One line for the top of a benchmark's printout."""
    on = "" if info.get("device", "cpu") == "cpu" else f"on {info['device']}, "
    return (f"{on}{info['cpu']}, {info['cpus']} CPUs, torch {info['torch']}, {info['torch_threads']} torch thread(s), "
            f"load {info['load_at_start']} at start")


def median_range(values: list[float]) -> dict:
    ordered = sorted(values)
    n = len(ordered)
    mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"median": mid, "min": ordered[0], "max": ordered[-1], "runs": n}


def fmt(stat: dict | None, digits: int = 0) -> str:
    """``median (min-max)`` of a `median_range` result."""
    if stat is None:
        return "-"
    return f"{stat['median']:,.{digits}f} ({stat['min']:,.{digits}f}-{stat['max']:,.{digits}f})"


def write_results(path: str, results: dict) -> dict:
    """Write `results` as JSON to `path` (its folder made if missing), say so, and return them."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return results


def bandwidth() -> dict:
    """GB/s of a copy (bytes read + written) and a sum (bytes read), 64 MiB and 1 GiB."""
    out = {}
    for label, nbytes in (("64MiB", 64 << 20), ("1GiB", 1 << 30)):
        a = torch.ones(nbytes // 4)
        b = torch.empty_like(a)
        copy, total = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            b.copy_(a)
            copy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            a.sum()
            total.append(time.perf_counter() - t0)
        out[f"copy_{label}_GBps"] = 2 * nbytes / statistics.median(copy) / 1e9
        out[f"sum_{label}_GBps"] = nbytes / statistics.median(total) / 1e9
        del a, b
    return out
