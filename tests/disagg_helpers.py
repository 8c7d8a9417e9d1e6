"""Prefill server children and remote-prefill configs for the disaggregation tests.

Everything binds and dials 127.0.0.1; ports come from port 0; every child
is killed by its pid when the test (or module) that started it ends, even
when it fails. Test points are keys in one TCPStore (see disagg_child.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import torch.distributed as dist

from engine.disagg.link.settings import RemotePrefill
from helpers import small_config

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disagg_child.py")
STARTUP = 60.0  # a python + torch start on a loaded 2-core machine
#: the link's bounds in tests: 2 s of silence ends a link, a chunk gets size / 100 MB/s + 1 s
LINK = dict(keepalive=0.5, first_timeout=2.0, chunk_slack=1.0, connect_timeout=5.0)
FENCE_TIMEOUT = 10.0
ENGINE = dict(page_size=4, num_kv_pages=256, max_running=8, max_context=256, max_prefill_tokens=64,
              use_entry_points=False)
SECRET = "kvlife-test-secret"


class PointStore:
    """The test's TCPStore (the master, on a free port)."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=STARTUP),
                                   wait_for_workers=False)
        self.port = self.store.port

    def set(self, key: str) -> None:
        self.store.set(key, "1")

    def wait(self, key: str, timeout: float = 10.0) -> None:
        self.store.wait([key], datetime.timedelta(seconds=timeout))

    def has(self, key: str) -> bool:
        return self.store.check([key])


class PrefillChild:
    """One prefill server process (tests/disagg_child.py)."""

    _count = 0

    def __init__(self, store: PointStore, *, engine: dict | None = None, settings: dict | None = None) -> None:
        PrefillChild._count += 1
        self.name = f"p{os.getpid()}-{PrefillChild._count}"
        self.store = store
        config = {**ENGINE, "fence_timeout": FENCE_TIMEOUT, **(engine or {})}
        link = {**LINK, **(settings or {})}
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, CHILD, str(store.port), self.name, json.dumps(config),
                                      json.dumps(link)], env=env, stdout=subprocess.DEVNULL)
        self.pid = self.proc.pid
        self.bootstrap = self.http = 0

    def ready(self) -> PrefillChild:
        deadline = time.monotonic() + STARTUP
        key = f"ready/{self.name}"
        while not self.store.has(key):
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefill child exited with {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError("prefill child did not start")
            time.sleep(0.02)
        info = json.loads(self.store.store.get(key))
        self.bootstrap, self.http = info["bootstrap"], info["http"]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.bootstrap}"

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def debug(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{self.http}/debug/memory", timeout=5.0).json()

    def wait_idle(self, timeout: float = 5.0) -> dict[str, Any]:
        """The child's /debug/memory once it is idle and has run its leak check since the last job."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.debug()
            if report["idle"] and report["leak_checks"]["idle_checked"]:
                return report
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill child not idle: {report}")
            time.sleep(0.02)


@contextlib.contextmanager
def prefill_children(store: PointStore):
    """`start(**kwargs)` starts a ready PrefillChild; every one started is killed by its pid on exit
    (resumed first, in case a test stopped it), whatever happened."""
    children: list[PrefillChild] = []

    def start(**kwargs: Any) -> PrefillChild:
        child = PrefillChild(store, **kwargs)
        children.append(child)
        return child.ready()

    try:
        yield start
    finally:
        for child in children:
            child.signal(signal.SIGCONT)
            child.kill()


@pytest.fixture(scope="module")
def points() -> PointStore:
    """The module's test-point store (import it, with `spawn`, into a test module to use them)."""
    return PointStore()


@pytest.fixture
def spawn(points: PointStore):
    """`spawn(**kwargs)`: a ready prefill child, killed by its pid when the test ends."""
    with prefill_children(points) as start:
        yield start


def started_event(log_path: str, proc: subprocess.Popen, event: str = "server.started") -> dict:
    """The first JSON log line of `event` that a `kvlife serve` child wrote to `log_path`."""
    deadline = time.monotonic() + STARTUP
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        with open(log_path) as f:
            for line in f:
                if f'"{event}"' in line:
                    return json.loads(line)
        time.sleep(0.05)
    raise TimeoutError(f"no {event} from the server")


#: `kvlife serve` options for the tests' small engine and fast link bounds
SERVE_SMALL = ["--page-size", "4", "--num-kv-pages", "256", "--max-running", "8", "--max-context", "256",
               "--max-prefill-tokens", "64"]
SERVE_FAST = ["--transfer-keepalive", "0.5", "--transfer-first-timeout", "2", "--transfer-chunk-slack", "1",
              "--fence-timeout", "10"]


def assert_child_whole(report: dict[str, Any]) -> None:
    """Every pool of a prefill child adds up and holds nothing; its idle leak checks were clean."""
    for name, pool in report["pools"].items():
        assert pool["adds_up"] and pool["held"] == 0, (name, pool)
    assert report["leak_checks"]["failures"] == 0, report["leak_checks"]


def remote_config(*peers: str, secret: str | None = None, **overrides: Any):
    """A small decode engine config whose prefill servers are `peers`."""
    named = ("reconnect_interval", "max_chunk_bytes", "direct_min_run_bytes", "transport")
    link = {**LINK, "reconnect_interval": 0.1, **{k: overrides.pop(k) for k in list(overrides) if k in LINK or k in named}}
    remote = RemotePrefill(peers=peers, secret=secret, **link)
    fields = {**ENGINE, "fence_timeout": FENCE_TIMEOUT, **overrides}
    return small_config(disaggregation="decode", remote_prefill=remote, **fields)


def os_thread_names(pid: int | None = None) -> list[str]:
    """The names the kernel keeps for each live thread of process `pid` (None: this one)."""
    names = []
    task = f"/proc/{os.getpid() if pid is None else pid}/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass  # it ended between the listing and the read
    return names


def socket_threads() -> int:
    """This process's threads of the socket transport (`kvlife-sock-tx` / `-rx`), by their OS names."""
    return sum(name.startswith("kvlife-sock-") for name in os_thread_names())


def client(engine):
    """The decode engine's remote prefill client."""
    return engine.parts.prefill_client
