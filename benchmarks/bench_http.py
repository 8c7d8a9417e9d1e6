"""HTTP server vs embedded API: the same 64-client streaming workload, in the same run.

    python benchmarks/bench_http.py [--seconds 15] [--warmup 3] [--rounds 2] [--clients 64]
        [--prompt-tokens 32] [--new-tokens 32] [--vary-lengths] [--threads 1] [--inline-step-tokens N] [--inline-step-ms MS]
        [--stream-interval N] [--api-process]
        [--out bench-results/http.json]

1. `kvlife serve` starts once, in its own process on 127.0.0.1 (an ephemeral
   port, its defaults otherwise: JSON logs at info, one `request.summary`
   line per request, into bench-results/http-server.log), with the engine
   options in ENGINE_ARGS and `--threads` torch threads. With `--api-process`
   the server runs its HTTP layer in a second process (docs/http.md, "The
   API process"); its CPU is reported as "api", the engine's process's as
   "server".
2. Each round measures both paths, alternating which goes first: `--clients`
   streaming clients loop for `--warmup` + `--seconds`, each request a fresh
   random `--prompt-tokens` prompt and `--new-tokens` greedy tokens
   (ignore_eos; `--vary-lengths` draws each output length uniformly from
   [n/2, 3n/2], the same draws for both paths). HTTP: `POST /generate` with `stream: true`, one keep-alive
   connection per client, read by a small HTTP/1.1 client on asyncio streams
   (chunked transfer decoding and SSE parsing, every event JSON-decoded);
   httpx's own per-chunk work took about half a core, which on a 2-core
   machine is taken from the server being measured. Embedded: the same
   clients through `Engine.generate` in this process, reading the token ids
   (the embedded client does strictly less work than the HTTP one). Both
   processes freeze their startup objects out of the collector's sight
   (`gc.freeze()`) once the engine runs, as `kvlife serve` does.
3. Requests/s counts the requests finishing inside the measured window
   (whole requests: clients that run in step finish in waves, so it moves
   in steps of clients / seconds); tokens/s the streamed tokens reaching
   the clients inside it (no such steps: the finer ratio of the two);
   TTFT (request sent to the first event carrying a token) and latency
   percentiles the requests starting in it. An error is any status but 200,
   a stream without its final event, or a finish reason other than length.
   CPU seconds per second are measured for the server process, the client
   process, and (embedded) this process, over the window.
4. After the rounds: GET /health_generate and /metrics, SIGTERM; the
   server's logged leak-check verdict and exit code are reported. The
   ratios (HTTP requests/s over embedded, HTTP TTFT p99 over embedded) are
   the medians over rounds; each round's figures are in the JSON too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx

from engine import Engine, EngineConfig, SamplingParams
from engine.logging import configure_logging
from engine.runtime.stats import percentile

from proc_cpu import thread_cpu_s

ENGINE_ARGS = {"max_running": 64, "num_kv_pages": 1024, "page_size": 16, "max_context": 512}


def _request(rng: random.Random, args) -> tuple[list[int], int]:
    """A fresh random prompt and its output length: `--new-tokens`, or with `--vary-lengths` uniform in
    [new_tokens / 2, 3 * new_tokens / 2] (the same mean); the same draws for both paths."""
    prompt = [rng.randrange(0, 256) for _ in range(args.prompt_tokens)]
    n = args.new_tokens
    return prompt, rng.randint(max(1, n // 2), n + n // 2) if args.vary_lengths else n


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of process `pid`: its main thread, and all its other threads (`proc_cpu`)."""
    groups = thread_cpu_s(pid)
    return {"main": groups["loop"], "other": sum(seconds for group, seconds in groups.items() if group != "loop")}


class Window:
    """The measured window [start, end) after the warm-up, and what fell in it."""

    def __init__(self, warmup: float, seconds: float) -> None:
        now = time.perf_counter()
        self.start, self.end = now + warmup, now + warmup + seconds
        self.seconds = seconds
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.finished = 0
        self.errors = 0
        self.tokens = 0  # streamed tokens that reached the client inside the window

    def count_tokens(self, at: float, n: int) -> None:
        if self.start <= at < self.end:
            self.tokens += n

    def record(self, started: float, first: float) -> None:
        done = time.perf_counter()
        if self.start <= done < self.end:
            self.finished += 1
        if self.start <= started < self.end:
            self.ttft.append(first)
            self.latency.append(done - started)


async def _cpu_over(window: Window, pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process's main thread and other threads used over the window."""
    await anyio.sleep(max(0.0, window.start - time.perf_counter()))
    before = {name: _thread_cpu(pid) for name, pid in pids.items()}
    await anyio.sleep(max(0.0, window.end - time.perf_counter()))
    return {f"{name}_{part}": seconds - before[name][part] for name, pid in pids.items()
            for part, seconds in _thread_cpu(pid).items()}


def _summary(name: str, window: Window, cpu: dict[str, float]) -> dict:
    """The window's figures; CPU as seconds per second and as milliseconds per finished request."""
    return {
        "name": name,
        "requests": window.finished,
        "requests_per_s": round(window.finished / window.seconds, 2),
        "tokens_per_s": round(window.tokens / window.seconds, 1),
        "ttft_p50_ms": round(1000 * (percentile(window.ttft, 50) or 0.0), 1),
        "ttft_p99_ms": round(1000 * (percentile(window.ttft, 99) or 0.0), 1),
        "latency_p50_ms": round(1000 * (percentile(window.latency, 50) or 0.0), 1),
        "errors": window.errors,
        "cpu_s_per_s": {k: round(v / window.seconds, 3) for k, v in cpu.items()},
        "cpu_ms_per_request": {k: round(1000 * v / max(window.finished, 1), 2) for k, v in cpu.items()},
    }


async def _stream_once(reader, writer, host: str, body: bytes) -> tuple[int, list[dict]]:
    """One POST /generate on a keep-alive connection: (status, decoded SSE events)."""
    writer.write(b"POST /generate HTTP/1.1\r\nhost: " + host.encode() + b"\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    if b"transfer-encoding: chunked" not in headers:
        length = int(headers.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        return status, []
    events, pending = [], b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return status, events
        pending += data[:-2]
        *complete, pending = pending.split(b"\n\n")
        for event in complete:
            if event.startswith(b"data: {"):
                events.append((time.perf_counter(), json.loads(event[6:])))


async def _http_client(port: int, rng: random.Random, args, out: Window) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < out.end:
            prompt, new_tokens = _request(rng, args)
            body = json.dumps({"input_ids": prompt, "stream": True,
                               "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}).encode()
            start = time.perf_counter()
            status, events = await _stream_once(reader, writer, f"127.0.0.1:{port}", body)
            first = next((t - start for t, e in events if e["token_ids"]), None)
            for t, e in events:
                out.count_tokens(t, len(e["token_ids"]))
            final = events[-1][1] if events and events[-1][1]["finished"] else None
            if status != 200 or final is None or final["meta_info"]["finish_reason"] != "length" or first is None:
                out.errors += 1
                continue
            out.record(start, first)
    finally:
        writer.close()


async def measure_http(args, port: int, server_pid: int) -> dict:
    out = Window(args.warmup, args.seconds)
    cpu: dict = {}
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            pids = {"server": server_pid, "client": os.getpid()}
            children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
            if children:  # --api-process: the HTTP layer's own process
                pids["api"] = int(children[0])
            cpu.update(await _cpu_over(out, pids))

        tg.start_soon(watch)
        for i in range(args.clients):
            tg.start_soon(_http_client, port, random.Random(i), args, out)
    return _summary("http", out, cpu)


async def measure_embedded(args) -> dict:
    config = EngineConfig(**ENGINE_ARGS, leak_check="log", use_entry_points=False)
    cpu: dict = {}
    async with Engine(config) as engine:
        gc.collect()  # NOTE: as `kvlife serve` does once its engine runs: full collections skip the startup objects
        gc.freeze()

        async def client(rng: random.Random, out: Window) -> None:
            while time.perf_counter() < out.end:
                start = time.perf_counter()
                first = final = None
                prompt, new_tokens = _request(rng, args)
                params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
                async with engine.generate(prompt, params) as stream:
                    async for output in stream:
                        if output.new_token_ids:
                            now = time.perf_counter()
                            out.count_tokens(now, len(output.new_token_ids))
                            if first is None:
                                first = now - start
                        final = output
                if final is None or final.finish_reason.value != "length" or first is None:
                    out.errors += 1
                    continue
                out.record(start, first)

        out = Window(args.warmup, args.seconds)
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                cpu.update(await _cpu_over(out, {"process": os.getpid()}))

            tg.start_soon(watch)
            for i in range(args.clients):
                tg.start_soon(client, random.Random(i), out)
        await engine.wait_idle(30)
        verdict = "clean" if engine.stats.leak_check_failures == 0 else "leak"
    result = _summary("embedded", out, cpu)
    result["leak_check_verdict"] = verdict
    return result


def _start_server(args, log_path: Path) -> tuple[subprocess.Popen, int]:
    argv = [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--no-plugins"]
    for name, value in ENGINE_ARGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    argv += ["--stream-interval", str(args.stream_interval)] + (["--api-process"] if args.api_process else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if '"server.started"' in line:
                return process, json.loads(line)["port"]
        if process.poll() is not None:
            raise RuntimeError(f"kvlife serve exited with {process.returncode}; see {log_path}")
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    raise RuntimeError(f"kvlife serve did not start within 60 s; see {log_path}")


async def _finish_server(process: subprocess.Popen, port: int, log_path: Path) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        health = (await client.get("/health_generate")).status_code
        metrics = (await client.get("/metrics")).text
    process.send_signal(signal.SIGTERM)
    exit_code = await anyio.to_thread.run_sync(lambda: process.wait(60))
    logs = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    verdicts = [e for e in logs if e.get("event") == "server.leak_check"]
    failures = next((float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("kvlife:leak_check_failures_total")), None)
    return {"health_generate_status": health, "server_exit_code": exit_code,
            "leak_check_verdict": verdicts[-1]["verdict"] if verdicts else "missing",
            "idle_leak_check_failures": failures}


def _table(rounds: list[dict]) -> str:
    rows = ["| round | path | requests/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | latency p50 (ms) | errors "
            "| CPU ms per request (main thread / others) |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        for path in (r["http"], r["embedded"]):
            ms = path["cpu_ms_per_request"]
            cpu = ", ".join(f"{p} {ms[p + '_main']:.2f} / {ms[p + '_other']:.2f}" for p in ("server", "api", "client",
                                                                                          "process")
                            if p + "_main" in ms)
            rows.append(f"| {i} | {path['name']} | {path['requests_per_s']:.1f} | {path['tokens_per_s']:.0f} | "
                        f"{path['ttft_p50_ms']:.1f} | "
                        f"{path['ttft_p99_ms']:.1f} | {path['latency_p50_ms']:.1f} | {path['errors']} | {cpu} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="measured load per path and round (default 15)")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured load first (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating which path goes first")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--vary-lengths", action="store_true",
                        help="output lengths uniform in [n/2, 3n/2] instead of all n (clients fall out of step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, server and embedded (default 1)")
    parser.add_argument("--inline-step-tokens", type=int, default=None,
                        help="EngineConfig.inline_step_tokens for the server and the embedded engine alike "
                             "(default: the engine's)")
    parser.add_argument("--inline-step-ms", type=float, default=None,
                        help="EngineConfig.inline_step_ms for both alike (default: the engine's)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the server's --stream-interval: tokens per event after a sequence's first (default 1)")
    parser.add_argument("--api-process", action="store_true",
                        help="the server's --api-process: its HTTP layer in a process of its own")
    parser.add_argument("--out", default="bench-results/http.json")
    parser.add_argument("--device", default="cpu",
                        help="torch device the engines run on: cpu (default), cuda, cuda:1 ... (docs/gpu.md)")
    args = parser.parse_args()
    configure_logging("warning")
    import torch

    torch.set_num_threads(args.threads)
    ENGINE_ARGS["device"] = args.device  # the server and the embedded engine alike
    if args.inline_step_tokens is not None:
        ENGINE_ARGS["inline_step_tokens"] = args.inline_step_tokens
    if args.inline_step_ms is not None:
        ENGINE_ARGS["inline_step_ms"] = args.inline_step_ms
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / "http-server.log"
    load_before = os.getloadavg()
    process, port = _start_server(args, log_path)
    rounds = []
    try:
        for i in range(args.rounds):
            order = ["http", "embedded"] if i % 2 == 0 else ["embedded", "http"]
            result = {}
            for path in order:
                if path == "http":
                    result[path] = anyio.run(measure_http, args, port, process.pid, backend="asyncio")
                else:
                    result[path] = anyio.run(measure_embedded, args, backend="asyncio")
            rounds.append(result)
        server = anyio.run(_finish_server, process, port, log_path, backend="asyncio")
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    ratios = [r["http"]["requests_per_s"] / r["embedded"]["requests_per_s"] for r in rounds]
    ttft_ratios = [r["http"]["ttft_p99_ms"] / r["embedded"]["ttft_p99_ms"] for r in rounds]
    token_ratios = [r["http"]["tokens_per_s"] / r["embedded"]["tokens_per_s"] for r in rounds]
    report = {
        "machine": {"cpus": os.cpu_count(), "load_average_before": load_before, "python": platform.python_version(),
                    "torch": torch.__version__, "torch_threads": args.threads},
        "workload": {"clients": args.clients, "seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds,
                     "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "vary_lengths": args.vary_lengths, "engine": ENGINE_ARGS, "stream_interval": args.stream_interval,
                     "model": "tiny", "route": "POST /generate, stream",
                     "api_process": args.api_process},
        "rounds": rounds, "server": server,
        "http_over_embedded_throughput": round(statistics.median(ratios), 3),
        "http_over_embedded_ttft_p99": round(statistics.median(ttft_ratios), 3),
        "http_over_embedded_tokens": round(statistics.median(token_ratios), 3),
        "load_average_after": os.getloadavg(),
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"{args.clients} streaming clients, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"{args.seconds:g} s per path per round; {os.cpu_count()} CPUs, load {load_before[0]:.2f} before, "
          f"{report['load_average_after'][0]:.2f} after, "
          f"{args.threads} torch thread(s)")
    print(_table(rounds))
    print(f"HTTP / embedded: throughput {report['http_over_embedded_throughput']:.2f}x, "
          f"TTFT p99 {report['http_over_embedded_ttft_p99']:.2f}x, streamed tokens/s "
          f"{report['http_over_embedded_tokens']:.2f}x (medians over {args.rounds} rounds); "
          f"server: leak check {server['leak_check_verdict']}, exit {server['server_exit_code']}")
    errors = sum(r[p]["errors"] for r in rounds for p in ("http", "embedded"))
    ok = errors == 0 and server["leak_check_verdict"] == "clean" and server["server_exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
