"""`serve_prefill`: a prefill server process with its HTTP routes (needs the `serve` extra).

    exit_code = await serve_prefill(EngineConfig(), PrefillServerConfig(bootstrap_port=31001),
                                    "127.0.0.1", 30001)

Routes:

    GET /health         200 while the server runs (503 while it stops), with its links
    GET /metrics        Prometheus text: pools, leak checks, kvlife:transfer_* (transfer_metrics.py)
    GET /debug/memory   the memory report with owners, the leak checks and the links

On SIGTERM or SIGINT it closes every link (each decode is told, so its jobs
on this prefill fail at once), lets the prefill runtime finish and release
what it started, logs the final leak check and returns 0 (1 if it found a leak).

Its ASGI and uvicorn plumbing is engine.serve.server's.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.config import EngineConfig
from engine.prefill_server import PrefillServer
from engine.disagg.link.settings import PrefillServerConfig
from engine.logging import configure_logging
from engine.serve.server import bind_socket
from engine.serve.transfer_metrics import TransferCollector
from resources import LeakError

log = structlog.get_logger("kvlife.http")
POOL_FIELDS = ("capacity", "free", "evictable", "held", "quarantined")


class PrefillCollector:
    """The prefill server's pools, leak checks and worker requests (kvlife:* names, as the decode's)."""

    def __init__(self, server: PrefillServer, *, prefix: str = "kvlife:") -> None:
        self.server = server
        self.prefix = prefix

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        p, server = self.prefix, self.server
        report = server.memory_report()
        for field in POOL_FIELDS:
            gauge = GaugeMetricFamily(f"{p}pool_{field}", f"Pool units {field}, per pool.", labels=["pool", "unit"])
            for name, pool in sorted(report.pools.items()):
                gauge.add_metric([name, pool.unit], getattr(pool, field))
            yield gauge
        for name, value, doc in (("leak_checks", server.leak_checks, "Leak checks run (each time it went idle)."),
                                 ("leak_check_failures", server.leak_check_failures, "Leak checks that found a leak.")):
            counter = CounterMetricFamily(f"{p}{name}", doc)
            counter.add_metric([], value)
            yield counter
        requests = GaugeMetricFamily(f"{p}prefill_requests", "Prefill requests not yet released.")
        requests.add_metric([], server.live_requests)
        yield requests


def prefill_app(server: PrefillServer) -> Starlette:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PrefillCollector(server))
    registry.register(TransferCollector(server.stats, model_name=server.config.model))
    state = {"draining": False}

    async def health(request: Request) -> Response:
        body = {"status": "stopping" if state["draining"] else "ok", "role": "prefill",
                "links": server.stats.links_up()}
        return JSONResponse(body, status_code=503 if state["draining"] else 200)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def debug_memory(request: Request) -> Response:
        return JSONResponse(server.debug())

    app = Starlette(routes=[Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
                            Route("/debug/memory", debug_memory, methods=["GET"])])
    app.state.kvlife = state
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


async def serve_prefill(config: EngineConfig, settings: PrefillServerConfig, host: str, port: int, *,
                        log_json: bool = True, log_level: str = "info", faults: Any = None,
                        test_points: Any = None, on_ready: Callable[[PrefillServer, int], None] | None = None) -> int:
    """Run a prefill server and its HTTP routes until SIGTERM/SIGINT; 0 if the last leak check is clean."""
    configure_logging(log_level, json=log_json)
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        log.error("server.bind_failed", host=host, port=port, error=str(exc))
        return 1
    server = PrefillServer(config, settings, faults=faults, test_points=test_points)
    app = prefill_app(server)
    http = _Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False))
    stop = anyio.Event()

    async def watch_signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_signals)
            async with server:
                tg.start_soon(http.serve, [sock])
                with anyio.fail_after(30):
                    while not http.started:
                        await anyio.sleep(0.01)
                http_port = sock.getsockname()[1]
                log.info("server.started", role="prefill", host=host, port=http_port,
                         bootstrap_port=server.bootstrap_port, model=config.model)
                if on_ready is not None:
                    on_ready(server, http_port)
                await stop.wait()
                app.state.kvlife["draining"] = True
                http.should_exit = True
            tg.cancel_scope.cancel()
    finally:
        sock.close()
    try:
        report = server.check_memory()
    except LeakError as exc:
        log.error("server.leak_check", verdict="leak", problems=exc.problems)
        return 1
    log.info("server.leak_check", verdict="clean", pools={n: s.held for n, s in report.pools.items()})
    return 0
