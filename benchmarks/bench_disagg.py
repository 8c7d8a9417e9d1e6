"""Disaggregation benchmark: a decode engine (this process) and prefill servers started
with the real command (`kvlife serve --disaggregation prefill`), on 127.0.0.1.

    python benchmarks/bench_disagg.py [--quick] [--parts transfer workload failures] [--job-tokens 2048 [8192 ...]]
        [--out bench-results/disagg.json]

1. Transfer throughput: N jobs of P tokens of KV (`--job-tokens`, 2048: 8 MiB a job; several sizes: this part once
   per size, in turn; the null model: no compute,
   the tiny model's shapes), submitted at once, from submission to landed in
   the decode's pages (the real path: frames, the prefill runtime, gloo),
   against a bare gloo send/recv of the same bytes, one message per job,
   between two processes, each job from a buffer of its own into a buffer of
   its own (as each job's KV leaves and lands in pages of its own). Also
   reported: the ratio against bare gloo through one buffer reused by every
   job on each side (cache-warm: faster on a small machine; the baseline
   before stop 34). Two real paths, each with its own prefill server:
   "direct" (the default: sent from the prefill's KV pages, received into
   the decode's) and "staged" (both sides through staging: a gather and a
   scatter more, the path before the direct one). Rounds of the four
   alternate (`--rounds`, 15), and each ratio is the median of the per-round
   ratios (with its quartiles: single rounds swing 2x on a loaded machine).
   Also the CPU time each side spent per job during the rounds (all threads
   of the decode process and of the prefill server; of the bare receiver and
   sender), each path's by thread group (the event loop, gloo's socket
   threads, the link's threads, the step thread, the rest: `proc_cpu.py`),
   and the cores busy (both sides' CPU
   per second of the rounds): on a machine with no idle core, the ratio
   follows the CPU per job.
2. TTFT and end-to-end throughput of the tiny model on one workload: the single
   engine, the decode role with its in-process prefill worker, and decode + one
   remote prefill server.
3. Dead peers: the only prefill SIGKILLed (and, separately, SIGSTOPped) while
   16 long prompts are in flight, with KV for half of them at once: when each
   request answers after the signal, and how long a lone request sent after
   that takes to fail; then the same kill with two prefills (failover: the
   dead one's jobs move to the other, and every request should finish).

Prints a table, writes JSON (figures, settings, the load average before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import anyio
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.disagg.link.settings import RemotePrefill
from engine.logging import configure_logging

from bare_gloo import BareGloo
from proc_cpu import GROUPS, cpu_s, group_deltas, thread_times

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
LINK = dict(keepalive=0.25, first_timeout=20.0, chunk_slack=1.0, connect_timeout=20.0, reconnect_interval=0.2)


#: the torch device every engine of the run uses (--device)
DEVICE = "cpu"


def _engine_fields(model: str, prompt: int, new: int, batch: int) -> dict:
    pages = batch * (-(-(prompt + new) // 16) + 1) + 16
    return dict(model=model, device=DEVICE, page_size=16, num_kv_pages=pages, max_running=batch, max_context=prompt + new + 16,
                max_prefill_tokens=max(prompt, 512), prefix_cache=False, use_entry_points=False, fence_timeout=60.0)


def _cli_flags(fields: dict) -> list[str]:
    flags = []
    for name in ("model", "device", "page_size", "num_kv_pages", "max_running", "max_context", "max_prefill_tokens",
                 "fence_timeout"):
        flags += [f"--{name.replace('_', '-')}", str(fields[name])]
    return flags + ["--no-prefix-cache", "--transfer-keepalive", str(LINK["keepalive"]),
                    "--transfer-first-timeout", str(LINK["first_timeout"]), "--transfer-chunk-slack",
                    str(LINK["chunk_slack"])]


class Prefill:
    """`kvlife serve --disaggregation prefill` in a child process (killed by pid on exit)."""

    def __init__(self, fields: dict, *, link: dict | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        extra = [flag for name, value in (link or {}).items()
                 for flag in (f"--{'disaggregation' if name == 'transport' else 'transfer'}-{name.replace('_', '-')}",
                              str(value))]
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--disaggregation", "prefill",
                                      "--disaggregation-bootstrap-port", "0", "--port", "0", "--log-level",
                                      "info", *_cli_flags(fields), *extra], stderr=self.log,
                                     stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + 60
        while True:
            with open(self.log.name) as f:
                started = next((json.loads(line) for line in f if '"transfer.prefill_started"' in line), None)
            if started is not None:
                self.address = f"127.0.0.1:{started['bootstrap_port']}"
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the prefill server did not start: {open(self.log.name).read()[-2000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _remote(fields: dict, *peers: str, **link) -> EngineConfig:
    return EngineConfig(**fields, leak_check="raise", disaggregation="decode",
                        remote_prefill=RemotePrefill(peers=peers, **{**LINK, **link}))


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for _ in range(n)]


async def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    outs: list = []
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            async def one(p=prompt) -> None:
                outs.append(await engine.complete(p, params))
            tg.start_soon(one)
    return time.perf_counter() - started, outs


# --------------------------------------------------------------- 1. throughput
#: the transfer part's paths: the default (each side sends from / receives into its pages where it can), and
#: every job through staging on both sides (a gather on the prefill, a scatter on the decode: the path before)
PATHS: dict[str, dict] = {"direct": {}, "direct_gloo": {"transport": "gloo"}, "staged": {"direct_min_run_bytes": 1 << 62}}
#: the bare gloo baselines: each job from and into memory of its own, as a transfer moves them (the ratio's
#: baseline), and every job from and into one buffer, cache-warm on both sides (the baseline before stop 34)
BARE = {"bare": True, "bare_reused": False}


async def bench_transfer(jobs: int, tokens: int, rounds: int, chunk_bytes: int) -> dict:
    """Rounds of each path and of bare gloo, alternating, so each ratio compares the same moment."""
    fields = _engine_fields("null", tokens, 1, jobs)
    prefills: dict[str, Prefill] = {}
    bares: dict[str, BareGloo] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            engines = {}
            for name, link in PATHS.items():
                prefills[name] = Prefill(fields, link=link)
                config = _remote(fields, prefills[name].address, max_chunk_bytes=chunk_bytes, **link)
                engines[name] = await stack.enter_async_context(Engine(config))
            nbytes = tokens * _bytes_per_token(engines["direct"])
            for name, distinct in BARE.items():
                bares[name] = BareGloo(jobs, nbytes, rounds + 1, distinct=distinct)
            params = SamplingParams(max_new_tokens=1, ignore_eos=True)
            for engine in engines.values():
                await _run(engine, _prompts(2, tokens, 0), params)  # warm-up
            for bare in bares.values():
                bare.round()
            real: dict[str, list[float]] = {name: [] for name in PATHS}
            plain: dict[str, list[float]] = {name: [] for name in BARE}
            #: CPU seconds spent in the rounds: (decode or receiver, prefill or sender), per path and bare
            cpu = {name: [0.0, 0.0] for name in (*PATHS, *BARE)}
            #: the same for each path by thread group (`proc_cpu.GROUPS`), and the rounds' wall seconds
            by_thread = {name: ({g: 0.0 for g in GROUPS}, {g: 0.0 for g in GROUPS}) for name in PATHS}
            walls = {name: 0.0 for name in (*PATHS, *BARE)}
            for r in range(rounds):
                for name, engine in engines.items():
                    client = engine.parts.prefill_client
                    before = client.stats.snapshot()["bytes"]
                    prompts = _prompts(jobs, tokens, r + 1)
                    pids = (None, prefills[name].proc.pid)
                    spent = [(cpu_s(pid), thread_times(pid)) for pid in pids]
                    wall, outs = await _run(engine, prompts, params)
                    for side, pid in enumerate(pids):
                        cpu[name][side] += cpu_s(pid) - spent[side][0]
                        for group, seconds in group_deltas(spent[side][1], thread_times(pid)).items():
                            by_thread[name][side][group] += seconds
                    walls[name] += wall
                    moved = client.stats.snapshot()["bytes"] - before
                    assert moved == jobs * nbytes, "every job moved its KV"
                    real[name].append(moved / wall)
                for name, bare in bares.items():
                    spent = cpu_s(), cpu_s(bare.child.pid)
                    plain[name].append(bare.round())
                    cpu[name][0] += cpu_s() - spent[0]
                    cpu[name][1] += cpu_s(bare.child.pid) - spent[1]
                    walls[name] += jobs * nbytes / plain[name][-1]
            for engine in engines.values():
                engine.check_memory()
    finally:
        for prefill in prefills.values():
            prefill.close()
        for bare in bares.values():
            bare.close()
    per_job = {name: [round(c * 1000 / (rounds * jobs), 2) for c in spent] for name, spent in cpu.items()}
    #: CPU seconds of both processes per wall second of the rounds (2.0: both cores of this VM, all the time)
    cores = {name: round(sum(cpu[name]) / walls[name], 2) for name in walls}

    def against(got: list[float], base: list[float]) -> tuple[float, list[float]]:
        ratios = [g / b for g, b in zip(got, base)]
        return statistics.median(ratios), ratios

    paths = {}
    for name, got in real.items():
        ratio, ratios = against(got, plain["bare"])
        reused, _ = against(got, plain["bare_reused"])
        paths[name] = {"GBps": statistics.median(got) / 1e9, "ratio": ratio, "ratios": ratios,
                       "ratio_vs_reused": reused, "cpu_ms_per_job": per_job[name], "cores_busy": cores[name],
                       "cpu_ms_per_job_by_thread": [{g: round(c * 1000 / (rounds * jobs), 2) for g, c in side.items()}
                                                    for side in by_thread[name]]}
    return {"jobs": jobs, "tokens": tokens, "job_bytes": nbytes, "chunk_bytes": chunk_bytes,
            "real_GBps": paths["direct"]["GBps"], "bare_GBps": statistics.median(plain["bare"]) / 1e9,
            "bare_reused_GBps": statistics.median(plain["bare_reused"]) / 1e9,
            "ratio": paths["direct"]["ratio"], "ratios": paths["direct"]["ratios"],
            "ratio_vs_reused": paths["direct"]["ratio_vs_reused"], "paths": paths,
            "bare_cpu_ms_per_job": per_job["bare"], "bare_reused_cpu_ms_per_job": per_job["bare_reused"],
            "bare_cores_busy": cores["bare"], "bare_reused_cores_busy": cores["bare_reused"]}


def _bytes_per_token(engine: Engine) -> int:
    kv = engine.parts.kv_buffers
    return sum(t[0].numel() * t.element_size() for t in (*kv.k, *kv.v))


# ------------------------------------------------------------- 2. TTFT and e2e
async def bench_workload(requests: int, prompt: int, new: int) -> dict:
    fields = _engine_fields("tiny", prompt, new, requests)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    prompts = _prompts(requests, prompt, 42)
    results = {}
    for name, role in (("single", "none"), ("in-process", "decode")):
        async with Engine(EngineConfig(**fields, leak_check="raise", disaggregation=role)) as engine:
            await _run(engine, prompts[:2], params)
            results[name] = _summary(*await _run(engine, prompts, params), new)
    prefill = Prefill(fields)
    try:
        async with Engine(_remote(fields, prefill.address)) as engine:
            await _run(engine, prompts[:2], params)
            results["remote"] = _summary(*await _run(engine, prompts, params), new)
            engine.check_memory()
    finally:
        prefill.close()
    return {"requests": requests, "prompt": prompt, "new_tokens": new, **results}


def _summary(wall: float, outs: list, new: int) -> dict:
    ttft = sorted(o.time_to_first_token for o in outs)
    return {"ttft_p50_ms": 1000 * ttft[len(ttft) // 2], "ttft_p95_ms": 1000 * ttft[int(len(ttft) * 0.95) - 1],
            "tokens_per_s": len(outs) * new / wall, "wall_s": wall}


# ------------------------------------------------------------ 3. dead peers
async def bench_failure(how: str, prefills: int, requests: int, prompt: int, cap: float) -> dict:
    """A prefill SIGKILLed (or SIGSTOPped) while `requests` long prompts are in flight, with KV for only half of
    them at once (the rest wait in QUEUED): when each request answers after the signal (or not within `cap`
    seconds), then one lone request sent after they all ended. With 2 prefills the first one is signalled."""
    fields = {**_engine_fields("tiny", prompt, 4, requests // 2), "max_running": requests}
    servers = [Prefill(fields) for _ in range(prefills)]
    prefill = servers[0]
    answers: list[tuple[str, float]] = []
    try:
        async with Engine(_remote(fields, *(s.address for s in servers))) as engine:
            client = engine.parts.prefill_client
            params = SamplingParams(max_new_tokens=4, ignore_eos=True)
            signalled = 0.0

            async def one(p) -> None:
                with anyio.move_on_after(cap):  # NOTE: the scope's end abandons the stream, which aborts it
                    out = await engine.complete(p, params)
                    answers.append((out.finish_reason.name, time.perf_counter() - signalled))

            async with anyio.create_task_group() as tg:
                for p in _prompts(requests, prompt, 7):
                    tg.start_soon(one, p)
                while client.stats.snapshot()["jobs"]["ok"] < 1:  # the prefill is busy with the rest
                    await anyio.sleep(0.001)
                signalled = time.perf_counter()
                os.kill(prefill.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            await engine.wait_idle(30)
            engine.check_memory()
            lone_started = time.perf_counter()
            lone = "no answer"
            with anyio.move_on_after(cap):
                lone = (await engine.complete(_prompts(1, prompt, 99)[0], params)).finish_reason.name
            lone_s = time.perf_counter() - lone_started
            await engine.wait_idle(30)
            engine.check_memory()
            failovers = sum(client.stats.snapshot().get("failovers", {}).values())
    finally:
        for server in servers:
            server.close()
    after = sorted(t for _, t in answers)
    failed = [t for reason, t in answers if reason == "TRANSFER_FAILED"]
    return {"how": how, "prefills": prefills, "failovers": failovers, "requests": requests, "prompt": prompt,
            "cap_s": cap, "answered": len(answers), "transfer_failed": len(failed),
            "finished_ok": sum(1 for r, _ in answers if r in ("LENGTH", "STOP")),
            "no_answer": requests - len(answers), "p50_ms": 1000 * after[len(after) // 2] if after else None,
            "max_ms": 1000 * after[-1] if after else None, "lone": lone, "lone_ms": 1000 * lone_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--out", default="bench-results/disagg.json")
    parser.add_argument("--chunk-mib", type=float, default=16.0, help="max_chunk_bytes of the transfer part, MiB")
    parser.add_argument("--job-tokens", type=int, nargs="+", default=[2048],
                        help="tokens of KV per job of the transfer part (the tiny model's shapes: 4 KiB a token); "
                             "several: the transfer part once per size, in turn")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the transfer part (each path and bare gloo)")
    parser.add_argument("--parts", nargs="+", default=["transfer", "workload", "failures"])
    parser.add_argument("--cap", type=float, default=90.0, help="failures: seconds a request may take to answer")
    parser.add_argument("--device", default="cpu", help="torch device the engines run on: cpu (default), cuda, cuda:1 ... (docs/gpu.md)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(1)
    configure_logging("error")
    load_before = os.getloadavg()
    quick = args.quick
    chunk = int(args.chunk_mib * (1 << 20))
    by_size = [anyio.run(bench_transfer, 8 if quick else 16, tokens, 2 if quick else args.rounds, chunk)
               for tokens in args.job_tokens] if "transfer" in args.parts else []
    workload = anyio.run(bench_workload, 16 if quick else 32, 256, 16 if quick else 32) \
        if "workload" in args.parts else None
    failures = [anyio.run(bench_failure, how, prefills, 16, 1024, args.cap)
                for how, prefills in (("kill", 1), ("stop", 1), ("kill", 2))] if "failures" in args.parts else []
    load_after = os.getloadavg()
    _report(by_size, workload, failures, load_before, load_after)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": args.device, "transfer": by_size[0] if by_size else None, "transfer_by_size": by_size,
                   "workload": workload, "failures": failures, "link": LINK,
                   "load_before": load_before, "load_after": load_after, "cpus": os.cpu_count()}, f, indent=2)


def _report(by_size, workload, failures, load_before, load_after) -> None:
    for t in by_size:
        bare_cpu, reused_cpu = t["bare_cpu_ms_per_job"], t["bare_reused_cpu_ms_per_job"]
        print(f"transfer: {t['jobs']} jobs x {t['job_bytes'] / 2**20:.0f} MiB in {t['chunk_bytes'] / 2**20:g} MiB "
              f"chunks, bare gloo {t['bare_GBps']:.2f} GB/s (CPU ms per job: receiver {bare_cpu[0]:.2f}, sender "
              f"{bare_cpu[1]:.2f}; cores busy {t['bare_cores_busy']:.2f}); through one reused buffer "
              f"{t['bare_reused_GBps']:.2f} GB/s (receiver {reused_cpu[0]:.2f}, sender {reused_cpu[1]:.2f})")
        for name, path in t["paths"].items():
            quartiles = statistics.quantiles(path["ratios"], n=4) if len(path["ratios"]) > 1 else [path["ratio"]] * 3
            decode, prefill = path["cpu_ms_per_job"]
            print(f"  {name:>7} path {path['GBps']:.2f} GB/s  ratio {path['ratio']:.2f} (quartiles {quartiles[0]:.2f}"
                  f"-{quartiles[2]:.2f}; {path['ratio_vs_reused']:.2f} against the reused buffer); CPU ms per job: "
                  f"decode {decode:.2f}, prefill {prefill:.2f}")
            threads = "; ".join(f"{side} " + ", ".join(f"{g} {ms:.2f}" for g, ms in groups.items())
                                for side, groups in zip(("decode", "prefill"), path["cpu_ms_per_job_by_thread"]))
            print(f"          by thread: {threads}; cores busy {path['cores_busy']:.2f}")
            print(f"          per round: {', '.join(f'{r:.2f}' for r in path['ratios'])}")
    w = workload
    if w is not None:
        print(f"workload: {w['requests']} requests, {w['prompt']}-token prompts, {w['new_tokens']} new tokens")
        print(f"{'':>10} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'tok/s':>8}")
        for name in ("single", "in-process", "remote"):
            r = w[name]
            print(f"{name:>10} {r['ttft_p50_ms']:>12.1f} {r['ttft_p95_ms']:>12.1f} {r['tokens_per_s']:>8.0f}")
    for f in failures:
        times = "-" if f["max_ms"] is None else f"p50 {f['p50_ms']:.0f} ms, max {f['max_ms']:.0f} ms"
        print(f"{f['how']} 1 of {f.get('prefills', 1)} prefill(s) under {f['requests']} x {f['prompt']}-token prompts: "
              f"{f['transfer_failed']} TRANSFER_FAILED, {f['finished_ok']} finished, {f['no_answer']} no answer in "
              f"{f['cap_s']:g} s, {f.get('failovers', 0)} jobs moved; answers after the signal: {times}; "
              f"a lone request after: {f['lone']} in {f['lone_ms']:.0f} ms")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
