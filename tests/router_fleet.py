"""Real processes for the gateway tests: `kvlife serve` instances and SGLang Model Gateway in front.

The gateway is `sglang-router==0.3.2` (its `smg` binary), installed by `.ci/run` in its own virtual
environment (`.ci-router-venv`); the tests find it through ``KVLIFE_SMG`` (the binary's path) or that
known path, and fail loudly when neither exists. Everything binds and dials 127.0.0.1 (the gateway
and its metrics port too; its defaults bind every interface); every child is killed by its pid when
the fleet closes, even when a test fails. Logs go to files, read back as JSON lines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
SMG_VERSION = "0.3.2"
STARTUP = 90.0  # python + torch, and the gateway's worker registration, on a loaded 2-core machine


def find_smg() -> str:
    """The gateway's binary: $KVLIFE_SMG, else .ci-router-venv/bin/smg; a test failure if neither exists."""
    path = os.environ.get("KVLIFE_SMG") or str(ROOT / ".ci-router-venv" / "bin" / "smg")
    if not os.access(path, os.X_OK):
        pytest.fail(f"SGLang Model Gateway not found at {path!r}: install sglang-router=={SMG_VERSION} in its own "
                    f"virtual environment (.ci/run makes .ci-router-venv) or point KVLIFE_SMG at its smg binary")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Child:
    """A child process whose stdout and stderr go to a log file; killed by pid in `kill`."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or dict(os.environ),
                                         start_new_session=True)
        self.pid = self.proc.pid

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            tail = "\n".join(self.lines()[-20:])
            raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{tail}")


class KvlifeServer(Child):
    """`kvlife serve` on 127.0.0.1, a free port, the tiny model, JSON logs at debug (request ids visible)."""

    def __init__(self, log: Path, *extra: str) -> None:
        argv = [sys.executable, "-m", "engine.cli.main", "--log-level", "debug", "serve", "--host", "127.0.0.1",
                "--port", "0", "--model", "tiny", "--page-size", "16", "--num-kv-pages", "512", "--max-running", "8",
                *extra]
        super().__init__(argv, log, env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.url = ""

    def ready(self) -> KvlifeServer:
        deadline = time.monotonic() + STARTUP
        while not self.url:
            self.check_alive("kvlife serve")
            started = self.events("server.started")
            if started:
                self.url = f"http://127.0.0.1:{started[0]['port']}"
            elif time.monotonic() > deadline:
                raise TimeoutError("kvlife serve did not start")
            else:
                time.sleep(0.1)
        return self

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.lines():
            if line.startswith("{") and f'"{name}"' in line:
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(event)
        return found

    def summaries(self) -> dict[str, dict[str, Any]]:
        """request id -> its request.summary (requests that finished here)."""
        return {e["request_id"]: e for e in self.events("request.summary")}

    def submitted(self) -> set[str]:
        """Ids of every request that entered this engine (request.transition into QUEUED)."""
        return {e["request_id"] for e in self.events("request.transition") if e.get("dst") == "QUEUED"}

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if not s.labels.keys() - {"model_name"}}


class Gateway(Child):
    """`smg launch` on 127.0.0.1 (its metrics port too) in front of `workers`, with `policy`."""

    def __init__(self, log: Path, workers: list[str], policy: str = "cache_aware") -> None:
        self.port, self.metrics_port = free_port(), free_port()
        argv = [find_smg(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--worker-urls", *workers, "--policy", policy, "--log-level", "warn",
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
                # a retry of a request cut by a dead worker goes elsewhere: its circuit opens at the first failure
                "--cb-failure-threshold", "1", "--retry-initial-backoff-ms", "100"]
        super().__init__(argv, log)
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers

    def ready(self) -> Gateway:
        deadline = time.monotonic() + STARTUP
        while True:
            self.check_alive("the gateway")
            try:
                healthy = {w["url"] for w in httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
                           if w["is_healthy"]}
                if healthy >= set(self.workers):
                    return self
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not register {self.workers}")
            time.sleep(0.2)

    def healthy_workers(self) -> set[str]:
        return {w["url"] for w in httpx.get(f"{self.url}/workers", timeout=5).json()["workers"] if w["is_healthy"]}
