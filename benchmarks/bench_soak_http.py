"""HTTP soak with disconnect storms: a decode server with a remote prefill, nothing may grow.

    python benchmarks/bench_soak_http.py [--requests 6000] [--clients 32] [--model tiny]
                                         [--storm-every 10] [--device cpu] [--api-process]
                                         [--out bench-results/soak_http.json]

Two real processes on 127.0.0.1: `kvlife serve --disaggregation prefill` and
`kvlife serve --disaggregation decode --prefill 127.0.0.1:<its bootstrap port>`
(each on ports from port 0, JSON logs into bench-results/soak-http-*.log).
`--clients` httpx clients send `--requests` requests to the decode's OpenAI
routes: short prompts (4-48 tokens from a few shared prefixes, so both prefix
caches fill and evict), 1-16 new tokens. Of each round of `--clients`
requests: 60% stream to the end, 10% are non-streaming, 15% disconnect
mid-stream (the client closes the connection after its first chunk), 15%
give up a non-streaming request after a random 0-50 ms (the connection closed
under the server). Every `--storm-every`-th round is a storm: every client of
the round disconnects after its first chunk, at about the same moment.

Reported: requests/s; outcomes (an HTTP error other than the client's own
disconnect is counted and printed); resident memory of both processes after
warm-up (the first tenth of the requests) and at the end, once idle (growth
must stay under 1%); both servers' memory reports once idle (every pool whole:
nothing held, nothing quarantined, each adds up), the decode's live requests
(zero), the idle leak checks' failures, and each server's leak-check verdict
and exit code after SIGTERM. With `--api-process` the decode server runs its
HTTP layer in a second process (docs/http.md, "The API process"), whose
resident memory is held to the same 1%.
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
from collections import Counter
from pathlib import Path

import anyio
import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.machine import add_device_option, header, loadavg, machine_info, write_results  # noqa: E402

ENGINE = ["--page-size", "8", "--num-kv-pages", "512", "--max-running", "32", "--max-prefill-tokens", "256",
          "--transfer-keepalive", "1", "--fence-timeout", "30", "--no-plugins"]
PREFIXES = [[7 + (j * 13 + k) % 200 for k in range(24)] for j in range(4)]
KINDS = ["stream"] * 12 + ["plain"] * 2 + ["disconnect"] * 3 + ["give_up"] * 3  # of 20


class Server:
    """One `kvlife serve` child (killed by its pid if still running when the run ends)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.log = log_dir / f"soak-http-{name}.log"
        with open(self.log, "w") as log_file:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", *argv],
                                         stdout=subprocess.DEVNULL, stderr=log_file,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.started = self._wait_for("server.started")
        self.url = f"http://127.0.0.1:{self.started['port']}"

    def _wait_for(self, event: str) -> dict:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            found = self.events(event)
            if found:
                return found[0]
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name}: exited with {self.proc.returncode}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.log.name}: no {event} within 90 s")

    def events(self, event: str) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()
                if line.startswith("{") and f'"{event}"' in line]

    def rss_mib(self) -> float:
        return _rss_mib(self.proc.pid)

    def api_pid(self) -> int | None:
        """Its API process (`--api-process`), if it has one."""
        started = self.events("server.api_process")
        return started[0]["pid"] if started else None

    def stop(self) -> dict:
        """SIGTERM; the exit code and the leak-check verdict it logged."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = "did not exit in 60 s"
        verdicts = self.events("server.leak_check")
        return {"exit_code": code, "leak_check": verdicts[-1]["verdict"] if verdicts else "missing"}

    def kill(self) -> None:
        api = self.api_pid()
        if api is not None and Path(f"/proc/{api}").exists():
            os.kill(api, signal.SIGKILL)
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _body(rng: random.Random, stream: bool) -> dict:
    prompt = rng.choice(PREFIXES)[: rng.randint(4, 24)] + [rng.randrange(5, 250) for _ in range(rng.randint(0, 24))]
    return {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(1, 16), "temperature": 0.7,
            "seed": rng.randrange(1 << 30), "stream": stream}


async def _one(http: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
    """One request of `kind`; its outcome."""
    try:
        if kind in ("stream", "disconnect"):
            async with http.stream("POST", "/v1/completions", json=_body(rng, True)) as answer:
                if answer.status_code != 200:
                    return f"http {answer.status_code}"
                async for line in answer.aiter_lines():
                    if kind == "disconnect" and line.startswith("data: {"):
                        return "disconnected"  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        return "ok"
                return "stream ended without [DONE]"
        if kind == "give_up":
            with anyio.move_on_after(rng.uniform(0, 0.05)):
                answer = await http.post("/v1/completions", json=_body(rng, False))
                return "ok" if answer.status_code == 200 else f"http {answer.status_code}"
            return "gave up"
        answer = await http.post("/v1/completions", json=_body(rng, False))
        if answer.status_code != 200:
            return f"http {answer.status_code}"
        return "ok" if answer.json()["choices"][0]["finish_reason"] in ("length", "stop") else "bad finish"
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}"


async def _soak(url: str, args, on_warm) -> tuple[Counter, float]:
    outcomes: Counter = Counter()
    warm_at = args.requests // 10
    done = 0
    started = time.monotonic()
    for first in range(0, args.requests, args.clients):
        round_index = first // args.clients
        storm = args.storm_every and round_index % args.storm_every == args.storm_every - 1
        count = min(args.clients, args.requests - first)

        async def client(i: int) -> None:
            rng = random.Random(first + i)
            kind = "disconnect" if storm else KINDS[rng.randrange(len(KINDS))]
            # a fresh connection each request: a disconnect closes it
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                outcomes[(kind, await _one(http, kind, rng))] += 1

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(client, i)
        before, done = done, done + count
        if before < warm_at <= done:
            on_warm()
    return outcomes, time.monotonic() - started


async def _idle_report(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        with anyio.fail_after(120):
            while not (report := (await http.get("/debug/memory")).json())["idle"]:
                await anyio.sleep(0.1)
            await anyio.sleep(1.5)  # an idle leak check has run since
            return (await http.get("/debug/memory")).json()


def _whole(report: dict) -> bool:
    return all(p["adds_up"] and p["held"] == 0 and p["quarantined"] == 0 for p in report["pools"].values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--storm-every", type=int, default=10, help="every N-th round all clients disconnect (0: none)")
    parser.add_argument("--api-process", action="store_true",
                        help="the decode server's HTTP layer in a process of its own (its memory is watched too)")
    parser.add_argument("--out", default="bench-results/soak_http.json")
    add_device_option(parser)
    args = parser.parse_args()
    info = machine_info(args.device)
    print(header(info))
    log_dir = Path(args.out).parent
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    try:
        prefill = Server("prefill", ["--disaggregation", "prefill", "--disaggregation-bootstrap-port", "0",
                                     "--model", args.model, "--device", args.device, *ENGINE], log_dir)
        servers.append(prefill)
        decode = Server("decode", ["--disaggregation", "decode", "--prefill",
                                   f"127.0.0.1:{prefill.started['bootstrap_port']}", "--model", args.model,
                                   "--device", args.device, *ENGINE, *(["--api-process"] if args.api_process else [])],
                        log_dir)
        servers.append(decode)
        api = decode.api_pid()
        warm: dict[str, float] = {}

        def memory() -> dict[str, float]:
            rss = {"prefill": prefill.rss_mib(), "decode": decode.rss_mib()}
            return rss if api is None else {**rss, "decode-api": _rss_mib(api)}

        def on_warm() -> None:
            warm.update(memory())

        outcomes, wall = anyio.run(_soak, decode.url, args, on_warm)
        reports = {"decode": anyio.run(_idle_report, decode.url), "prefill": anyio.run(_idle_report, prefill.url)}
        end = memory()
        exits = {"prefill": prefill.stop(), "decode": decode.stop()}
    finally:
        for server in servers:
            server.kill()
    growth = {name: 100 * (end[name] - warm[name]) / warm[name] for name in end}
    failures = {f"{kind}: {what}": n for (kind, what), n in outcomes.items()
                if what not in ("ok", "disconnected", "gave up")}
    results = {
        "machine": info, "args": vars(args), "load_at_end": loadavg(), "seconds": wall,
        "requests_per_s": args.requests / wall, "outcomes": {f"{k}: {w}": n for (k, w), n in outcomes.items()},
        "failures": failures, "rss_mib_after_warmup": warm, "rss_mib_at_end": end, "rss_growth_percent": growth,
        "pools_whole": {name: _whole(r) for name, r in reports.items()},
        "decode_live_requests": reports["decode"]["live_requests"],
        "prefill_idle_leak_check_failures": reports["prefill"]["leak_checks"]["failures"],
        "exits": exits,
    }
    print(f"{args.requests:,} requests from {args.clients} clients in {wall:.1f} s: "
          f"{results['requests_per_s']:,.0f} req/s (load {loadavg()} at end)")
    print("| outcome | requests |\n|---|---|")
    for key, n in sorted(results["outcomes"].items()):
        print(f"| {key} | {n:,} |")
    print("\n| process | RSS after warm-up (MiB) | RSS at end (MiB) | growth | pools whole | exit | leak check |")
    print("|---|---|---|---|---|---|---|")
    for name in end:
        server = name.split("-")[0]  # the API process has the decode server's pools, exit and verdict
        print(f"| {name} | {warm[name]:.1f} | {end[name]:.1f} | {growth[name]:+.2f}% | "
              f"{results['pools_whole'][server]} | {exits[server]['exit_code']} | {exits[server]['leak_check']} |")
    write_results(args.out, results)
    ok = (not failures and all(results["pools_whole"].values()) and results["decode_live_requests"] == 0
          and all(e == {"exit_code": 0, "leak_check": "clean"} for e in exits.values())
          and results["prefill_idle_leak_check_failures"] == 0 and max(growth.values()) < 1.0)
    print("verdict:", "pass" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
