"""The anchor allocator and prefix-cache workloads, and an adapter per allocator or cache.

Runs standalone (numpy, torch and the standard library only, plus the
package under test), so the same harness drives kvlife in the project's
environment and SGLang or vLLM in a separate one, one process per row::

    python benchmarks/foundation_workloads.py allocator ADAPTER [--quick] [--out FILE]
    python benchmarks/foundation_workloads.py prefix ADAPTER [--quick] [--out FILE]

`bench_foundation.py` starts these processes in one run order and prints the
table. Workloads, as /work/shared/ANCHORS.md defines them (seed 0):

allocator: 20,000 lifecycles, prompts uniform in [16, 2048] tokens, 1-64
    decode tokens, 32 live (each step fills free slots, every live request
    decodes one token, a request that produced its last token finishes), a
    262,144-token pool, page 16. ADMIT = one allocation of ceil(prompt / 16)
    pages; a decode token that starts a page = one allocation of one page;
    FINISH = one free of all the request's pages, the concatenation of its
    page lists timed as part of the free.
prefix: 5,000 requests: one of 50 system prompts (lengths uniform in
    [256, 1024], Zipf popularity, exponent 1.0) + a random suffix of [16, 512]
    tokens + [1, 64] decode tokens; 16 live; a 65,536-token pool at page 16.
    Match at admission (the prompt minus its last token), lock, allocate the
    rest (evicting as needed), grow at page boundaries, insert the whole pages
    and unlock at finish. Hit rate = cached prompt tokens / prompt tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

PAGE = 16
ALLOC_POOL_TOKENS = 262_144
PREFIX_POOL_TOKENS = 65_536


# ------------------------------------------------------------------ workloads
def allocator_specs(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(16, 2048), rng.randint(1, 64)) for _ in range(n)]


def prefix_specs(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, decode tokens) per request."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 32000) for _ in range(rng.randint(256, 1024))] for _ in range(50)]
    picks = rng.choices(range(50), weights=[1.0 / (k + 1) for k in range(50)], k=n)
    specs = []
    for k in picks:
        suffix = [rng.randrange(1, 32000) for _ in range(rng.randint(16, 512))]
        specs.append((systems[k] + suffix, [rng.randrange(1, 32000) for _ in range(rng.randint(1, 64))]))
    return specs


def run_allocator(adapter, specs, live: int = 32) -> dict:
    """Every lifecycle through `adapter` (admit, grow at page starts, finish);
    the time of each call and the leak count."""
    perf = time.perf_counter
    page = adapter.page_size
    alloc_t = free_t = 0.0
    n_alloc = n_free = 0
    pending = iter(specs)
    running: list[list] = []  # [handle, tokens in KV, decode tokens left]
    gc.collect()
    gc.disable()
    start = perf()
    exhausted = False
    while True:
        while len(running) < live and not exhausted:
            spec = next(pending, None)
            if spec is None:
                exhausted = True
                break
            prompt, decode = spec
            t0 = perf()
            handle = adapter.admit(prompt)
            alloc_t += perf() - t0
            n_alloc += 1
            running.append([handle, prompt, decode])
        if not running:
            break
        still = []
        for req in running:
            if req[1] % page == 0:  # the new token starts a page
                t0 = perf()
                adapter.grow(req[0])
                alloc_t += perf() - t0
                n_alloc += 1
            req[1] += 1
            req[2] -= 1
            if req[2]:
                still.append(req)
                continue
            t0 = perf()
            adapter.finish(req[0])
            free_t += perf() - t0
            n_free += 1
        running = still
    elapsed = perf() - start
    gc.enable()
    return {"lifecycles": len(specs), "lifecycles_per_s": len(specs) / elapsed, "wall_s": elapsed,
            "alloc_us_mean": alloc_t / n_alloc * 1e6, "free_us_mean": free_t / n_free * 1e6,
            "alloc_calls": n_alloc, "free_calls": n_free, "pages_leaked": adapter.leaked(),
            "rejects_double_free": adapter.rejects_double_free()}


class PageLists:
    """Admit / grow / finish over a plain allocator: ADMIT = alloc(ceil(prompt /
    page)), a decode page = alloc(1), FINISH = free(the chunks) (the adapter's
    `free` concatenates them, inside the timed call)."""

    page_size = PAGE

    def admit(self, prompt: int) -> list:
        chunk = self.alloc(-(-prompt // self.page_size))
        assert chunk is not None, "the pool never runs short in this workload"
        return [chunk]

    def grow(self, chunks: list) -> None:
        chunks.append(self.alloc(1))

    def finish(self, chunks: list) -> None:
        self.free(chunks)


def run_prefix(adapter, specs, live: int = 16) -> dict:
    """Every request through `adapter` (match + lock + allocate, grow, insert + unlock + free)."""
    perf = time.perf_counter
    pending = iter(specs)
    running: list[list] = []  # [handle, tokens in KV, decode tokens left]
    hit = total = 0
    gc.collect()
    gc.disable()
    start = perf()
    exhausted = False
    while True:
        while len(running) < live and not exhausted:
            spec = next(pending, None)
            if spec is None:
                exhausted = True
                break
            prompt, decode = spec
            handle, cached = adapter.admit(prompt, decode)
            hit += cached
            total += len(prompt)
            running.append([handle, len(prompt), len(decode)])
        if not running:
            break
        still = []
        for req in running:
            if req[1] % PAGE == 0:
                adapter.grow(req[0])
            req[1] += 1
            req[2] -= 1
            if req[2]:
                still.append(req)
            else:
                adapter.finish(req[0])
        running = still
    elapsed = perf() - start
    gc.enable()
    return {"requests": len(specs), "requests_per_s": len(specs) / elapsed, "wall_s": elapsed,
            "hit_rate": hit / total, **adapter.check()}


# ------------------------------------------------------------ the adapters
def load_adapter(kind: str, name: str):
    if name.startswith("kvlife"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from benchmarks import foundation_kvlife as module
    elif name.startswith("sglang"):
        from benchmarks import foundation_peers as module
    elif name.startswith("vllm"):
        from benchmarks import foundation_peers as module
    else:
        module = sys.modules[__name__]
    return module.ADAPTERS[kind][name]


class ListAllocator(PageLists):
    """The floor: a Python list of free page ids, no checks at all."""

    def __init__(self) -> None:
        self.capacity = ALLOC_POOL_TOKENS // PAGE
        self._free = list(range(self.capacity, 0, -1))

    def alloc(self, n: int):
        if n > len(self._free):
            return None
        pages = self._free[-n:]
        del self._free[-n:]
        return pages

    def free(self, chunks) -> None:
        self._free.extend(p for chunk in chunks for p in chunk)

    def leaked(self) -> int:
        return self.capacity - len(self._free)

    def rejects_double_free(self) -> bool:
        return False


ADAPTERS = {"allocator": {"python list": ListAllocator}, "prefix": {}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=["allocator", "prefix"])
    parser.add_argument("adapter")
    parser.add_argument("--quick", action="store_true", help="a tenth of the workload")
    parser.add_argument("--out")
    parser.add_argument("--device", default="cpu", help="device of kvlife's token table (peers ignore it)")
    args = parser.parse_args(argv)
    os.environ["KVLIFE_BENCH_DEVICE"] = args.device
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    torch.set_num_threads(1)
    scale = 10 if args.quick else 1
    try:
        adapter = load_adapter(args.workload, args.adapter)()
    except Exception as exc:  # a peer that does not import here: say why
        result = {"adapter": args.adapter, "error": f"{type(exc).__name__}: {exc}"}
    else:
        if args.workload == "allocator":
            result = run_allocator(adapter, allocator_specs(20_000 // scale))
        else:
            result = run_prefix(adapter, prefix_specs(5_000 // scale))
        result["adapter"] = args.adapter
    result["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
