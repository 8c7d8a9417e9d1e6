"""HTTP server benchmark: a bounded streaming load on loopback, and the embedded API on the same workload.

    python benchmarks/bench_http.py [--seconds 30] [--warmup 3] [--clients 64] [--out bench-results/http.json]

1. `kvlife serve` runs in its own process on 127.0.0.1 (an ephemeral port,
   JSON logs at info into bench-results/http-server.log).
2. `--clients` streaming clients (httpx, one connection each) loop for
   `--seconds`: POST /generate with `stream: true`, a fresh random prompt of
   `--prompt-tokens` each time, `--new-tokens` greedy tokens (ignore_eos).
   Time to first token is measured by the client, from sending the request
   to the first SSE event that carries a token. An error is any status but
   200, a stream without its final event, or a finish reason other than
   "length". The first `--warmup` seconds are not measured (the first waves
   pay for the process's first forward passes); then requests/s counts the
   requests that finish within the `--seconds` window, and the latency
   percentiles the requests that start within it. Errors count throughout.
3. GET /health_generate and /metrics after the load, then SIGTERM: the
   server's logged leak-check verdict and its exit code are reported.
4. The same clients, same workload and duration, through `Engine.generate`
   in this process; the ratio is HTTP requests/s over embedded requests/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import anyio
import httpx

from engine import Engine, EngineConfig, SamplingParams
from engine.logging import configure_logging
from engine.runtime.stats import percentile

ENGINE_ARGS = {"max_running": 64, "num_kv_pages": 1024, "page_size": 16, "max_context": 512}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


class Window:
    """The measured window [start, end) after the warm-up, and what fell in it."""

    def __init__(self, warmup: float, seconds: float) -> None:
        now = time.perf_counter()
        self.start, self.end = now + warmup, now + warmup + seconds
        self.wall_start = time.time() + warmup  # for matching the server's log timestamps
        self.seconds = seconds
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.finished = 0
        self.errors = 0

    def record(self, started: float, first: float) -> None:
        done = time.perf_counter()
        if self.start <= done < self.end:
            self.finished += 1
        if self.start <= started < self.end:
            self.ttft.append(first)
            self.latency.append(done - started)


def _summary(name: str, window: Window) -> dict:
    latencies, ttfts = window.latency, window.ttft
    return {
        "name": name,
        "requests": window.finished,
        "requests_per_s": window.finished / window.seconds,
        "ttft_p50_ms": 1000 * (percentile(ttfts, 50) or 0.0),
        "ttft_p99_ms": 1000 * (percentile(ttfts, 99) or 0.0),
        "latency_p50_ms": 1000 * (percentile(latencies, 50) or 0.0),
        "errors": window.errors,
        "seconds": window.seconds,
    }


async def _http_client(client: httpx.AsyncClient, rng: random.Random, args, out: Window) -> None:
    while time.perf_counter() < out.end:
        body = {"input_ids": _prompt(rng, args.prompt_tokens), "stream": True,
                "sampling_params": {"max_new_tokens": args.new_tokens, "ignore_eos": True}}
        start = time.perf_counter()
        first = None
        final = None
        try:
            async with client.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    out.errors += 1
                    await response.aread()
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if first is None and event["token_ids"]:
                        first = time.perf_counter() - start
                    if event["finished"]:
                        final = event
        except httpx.HTTPError:
            out.errors += 1
            continue
        if final is None or final["meta_info"]["finish_reason"] != "length" or first is None:
            out.errors += 1
            continue
        out.record(start, first)


def _start_server(log_path: Path) -> tuple[subprocess.Popen, int]:
    argv = [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--log-level", "info"]
    for name, value in ENGINE_ARGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    log_file = open(log_path, "w")  # noqa: SIM115 - the child writes it; closed with the process
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file)
    log_file.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if '"server.started"' in line:
                return process, json.loads(line)["port"]
        if process.poll() is not None:
            raise RuntimeError(f"kvlife serve exited with {process.returncode}; see {log_path}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"kvlife serve did not start within 60 s; see {log_path}")


async def run_http(args, log_path: Path) -> dict:
    process, port = _start_server(log_path)
    try:
        limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits) as client:
            out = Window(args.warmup, args.seconds)
            async with anyio.create_task_group() as tg:
                for i in range(args.clients):
                    tg.start_soon(_http_client, client, random.Random(i), args, out)
            health = (await client.get("/health_generate")).status_code
            metrics = (await client.get("/metrics")).text
        process.send_signal(signal.SIGTERM)
        exit_code = await anyio.to_thread.run_sync(lambda: process.wait(60))
    finally:
        if process.poll() is None:
            process.kill()
    logs = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    verdicts = [e for e in logs if e.get("event") == "server.leak_check"]
    # the server's own view of TTFT (request.summary), for requests that finished in the window
    server_ttft = [e["time_to_first_token"] for e in logs if e.get("event") == "request.summary"
                   and e["time_to_first_token"] is not None
                   and out.wall_start <= datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                   < out.wall_start + out.seconds]
    failures = next((float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("kvlife:leak_check_failures_total")), None)
    result = _summary("http", out)
    result.update(health_generate_status=health, server_exit_code=exit_code,
                  leak_check_verdict=verdicts[-1]["verdict"] if verdicts else "missing",
                  idle_leak_check_failures=failures,
                  server_ttft_p50_ms=1000 * (percentile(server_ttft, 50) or 0.0),
                  server_ttft_p99_ms=1000 * (percentile(server_ttft, 99) or 0.0))
    return result


async def run_embedded(args) -> dict:
    config = EngineConfig(**ENGINE_ARGS, leak_check="log")
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    async with Engine(config) as engine:

        async def client(rng: random.Random, out: Window) -> None:
            while time.perf_counter() < out.end:
                start = time.perf_counter()
                first = final = None
                async with engine.generate(_prompt(rng, args.prompt_tokens), params) as stream:
                    async for output in stream:
                        if first is None and output.new_token_ids:
                            first = time.perf_counter() - start
                        final = output
                if final is None or final.finish_reason.value != "length" or first is None:
                    out.errors += 1
                    continue
                out.record(start, first)

        out = Window(args.warmup, args.seconds)
        async with anyio.create_task_group() as tg:
            for i in range(args.clients):
                tg.start_soon(client, random.Random(i), out)
        await engine.wait_idle(30)
        try:
            engine.check_memory()
            verdict = "clean"
        except Exception:  # noqa: BLE001 - reported
            verdict = "leak"
    result = _summary("embedded", out)
    result["leak_check_verdict"] = verdict
    return result


def _table(http: dict, embedded: dict) -> str:
    rows = ["| path | requests | requests/s | TTFT p50 (ms) | TTFT p99 (ms) | errors | leak check |",
            "|---|---|---|---|---|---|---|"]
    for r in (http, embedded):
        rows.append(f"| {r['name']} | {r['requests']} | {r['requests_per_s']:.1f} | {r['ttft_p50_ms']:.1f} | "
                    f"{r['ttft_p99_ms']:.1f} | {r['errors']} | {r['leak_check_verdict']} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="measured load per path (default 30)")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured load first (default 3)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="bench-results/http.json")
    parser.add_argument("--skip-embedded", action="store_true", help="HTTP only (no ratio)")
    args = parser.parse_args()
    configure_logging("warning")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    http = anyio.run(run_http, args, out.parent / "http-server.log", backend="asyncio")
    embedded = None if args.skip_embedded else anyio.run(run_embedded, args, backend="asyncio")
    report = {"workload": {"clients": args.clients, "seconds": args.seconds, "warmup": args.warmup,
                           "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "engine": ENGINE_ARGS, "model": "tiny",
                           "cpus": os.cpu_count()},
              "http": http, "embedded": embedded,
              "http_over_embedded": None if embedded is None else http["requests_per_s"] / embedded["requests_per_s"]}
    out.write_text(json.dumps(report, indent=2))
    if embedded is not None:
        print(_table(http, embedded))
        print(f"HTTP / embedded throughput: {report['http_over_embedded']:.2f}")
    else:
        print(json.dumps(http, indent=2))
    ok = http["errors"] == 0 and http["leak_check_verdict"] == "clean" and http["server_exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
