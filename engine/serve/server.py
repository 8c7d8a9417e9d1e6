"""The HTTP server: an ASGI app (Starlette) over the public Engine API, served by uvicorn.

    app = create_app(engine)                       # mount it anywhere ASGI runs
    exit_code = await serve(EngineConfig(), "127.0.0.1", 30000)

Routes (bodies and answers in docs/http.md):

    POST /generate              SGLang-style generation; `stream` gives server-sent events
    POST /v1/completions        the OpenAI completions subset
    POST /v1/chat/completions   OpenAI chat, prompts rendered with the model's chat template
    GET  /v1/models             the served model
    POST /abort                 abort by request id (404 if unknown or already finished)
    GET  /health                readiness: 200 only while the engine can admit (no API key needed)
    GET  /live                  liveness: 200 while the engine's loop is alive (no API key needed)
    GET  /health_generate       progress under load, a one-token probe when idle: 200 or 503
    GET  /model_info, /server_info (and their /get_ names), POST /flush_cache: for routers
    GET  /metrics               Prometheus text, vLLM's names with a `kvlife:` prefix
    GET  /debug/memory          `memory_report()` as JSON, with owners
    POST /open_session, /close_session   sessions whose KV is kept between turns (routes_sessions.py)
    POST /tokenize, /detokenize          vLLM's shapes (routes_tokens.py)

Routes live by concern in routes_generation.py and routes_ops.py; every
error (unknown routes and wrong methods included) is JSON in OpenAI's shape
(http_errors.py); with `ServerSettings.api_key` every route but /health and /live
needs the key (auth.py). A client that disconnects, while its request is
queued, running or streaming, aborts it: the stream is abandoned and the
engine releases the request like any other.

`serve` owns the process: it binds, runs engine and server (once the engine
runs, it moves the objects that exist out of the collector's sight:
`gc.freeze`), and on SIGTERM
or SIGINT stops accepting, leaves the engine (every request in flight
finishes with SHUTDOWN, so each SSE client gets a final event), logs the
final leak-check verdict and returns 0 (1 if the leak check failed). If the
engine's loop dies it stops the same way and returns 1 (`server.engine_dead`),
so a supervisor restarts it. With `ServerSettings.kv_events` it publishes KV
cache events while it serves (engine.kv_events). It does not configure
logging: the caller (the CLI) does, once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from starlette.applications import Starlette

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineDead, InvalidConfig
from engine.serve.context import ServerContext
from engine.serve.routes_generation import generation_routes
from engine.serve.routes_ops import ops_routes
from engine.serve.routes_routers import router_routes
from engine.serve.routes_sessions import session_routes
from engine.serve.routes_tokens import token_routes
from engine.serve.settings import ServerSettings
from engine.serve.uvicorn_runner import bind_socket, freeze_startup_objects, running_app, start_serving, uvicorn_server
from resources import LeakError

if TYPE_CHECKING:
    from engine.serve.api_process import FrontProcess

__all__ = ["ServerSettings", "create_app", "running_app", "running_server", "serve"]

log = structlog.get_logger("kvlife.http")


def create_app(engine: Engine, settings: ServerSettings | None = None) -> Starlette:
    """The ASGI app serving `engine` (which the caller runs, inside `async with engine`)."""
    settings = settings or ServerSettings()
    ctx = ServerContext.build(engine, settings)
    return ctx.app([*generation_routes(ctx), *ops_routes(ctx), *session_routes(ctx), *token_routes(ctx),
                    *router_routes(ctx)])


@contextlib.asynccontextmanager
async def kv_events(engine: Engine, settings: ServerSettings) -> AsyncIterator[Any]:
    """Publish `engine`'s KV cache events while the block runs if `settings.kv_events` is set (yields the
    publisher, else None); an endpoint that cannot be opened is an InvalidConfig naming it."""
    if settings.kv_events is None:
        yield None
        return
    try:
        from engine.kv_events.publisher import KVEventPublisher, publishing
    except ImportError as exc:
        raise InvalidConfig("ServerSettings.kv_events", "None unless the `kv-events` extra is installed "
                            "(pip install 'kvlife[kv-events]')", str(exc)) from None
    cm = publishing(engine, settings.kv_events)
    try:
        publisher: KVEventPublisher = await cm.__aenter__()
    except OSError as exc:
        raise InvalidConfig("KVEventsConfig.endpoint", f"an endpoint this process can open ({exc})",
                            settings.kv_events.endpoint) from None
    try:
        yield publisher
    finally:
        await cm.__aexit__(None, None, None)


@contextlib.asynccontextmanager
async def running_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, *,
                         settings: ServerSettings | None = None) -> AsyncIterator[str]:
    """Serve a running `engine` in this task group; yields the base URL (asyncio only)."""
    settings = settings or ServerSettings()
    app = create_app(engine, settings)
    async with kv_events(engine, settings) as publisher:
        app.state.kvlife.kv_events = publisher
        async with running_app(app, host, port, settings=settings) as url:
            yield url


class _ToStructlog(logging.Handler):
    """uvicorn's stdlib log records as structlog events, so every line is JSON."""

    def emit(self, record: logging.LogRecord) -> None:
        structlog.get_logger(record.name).log(record.levelno, "server.uvicorn", message=record.getMessage())


async def serve(config: EngineConfig, host: str, port: int, *, settings: ServerSettings | None = None) -> int:
    """Run engine and server until SIGTERM or SIGINT; 0 if the final leak check is clean, else 1.

    Raises OSError if (host, port) cannot be bound, and whatever building the engine raises
    (InvalidConfig, ...), before anything runs. uvicorn's own records are forwarded to
    structlog at warning and above (info and above when the root level is debug)."""
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.handlers[:] = [_ToStructlog()]
    uvicorn_log.setLevel(logging.INFO if structlog.get_logger().is_enabled_for(logging.DEBUG) else logging.WARNING)
    uvicorn_log.propagate = False
    settings = settings or ServerSettings()
    sock = bind_socket(host, port)
    async with contextlib.AsyncExitStack() as stack:
        try:
            engine = Engine(config)
            app = create_app(engine, settings)
            app.state.kvlife.kv_events = await stack.enter_async_context(kv_events(engine, settings))
            front = await _api_process(stack, engine, settings, sock) if settings.api_process else None
            own_sock = bind_socket("127.0.0.1", 0) if front is not None else sock
        except BaseException:
            sock.close()
            raise
        try:
            return await _serve(engine, app, settings, host, own_sock, config, front, sock.getsockname()[1])
        finally:
            sock.close()


async def _api_process(stack: contextlib.AsyncExitStack, engine: Engine, settings: ServerSettings,
                       sock: socket.socket) -> FrontProcess:
    """The API process for `sock` (started by `_serve` once the engine runs), with the bridge it talks
    to; both outlive the engine's run, so the streams' last events reach their clients."""
    from engine.serve.api_bridge import api_bridge
    from engine.serve.api_process import FrontProcess
    from engine.serve.remote_engine import EngineDescription

    bridge = await stack.enter_async_context(api_bridge(engine))
    front = FrontProcess(EngineDescription.of(engine), settings, sock, bridge)
    stack.push_async_callback(front.close, settings.graceful_timeout + 5)
    return front


async def _serve(engine: Engine, app: Starlette, settings: ServerSettings, host: str, sock: socket.socket,
                 config: EngineConfig, front: FrontProcess | None, public_port: int) -> int:
    """Run until a signal, the engine's death, or the HTTP server's (or the API process's) own end.
    `sock` is the engine's own server's: the public one, or loopback under an API process (`front`)."""
    server = uvicorn_server(app, settings)
    stop, done = anyio.Event(), anyio.Event()
    engine_error: BaseException | None = None

    async def watch_signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if stop.is_set():
                    server.force_exit = True  # a second signal: stop waiting for connections
                log.info("server.stopping", signal=signal.Signals(signum).name,
                         in_flight=sum(engine.requests_by_state().values()))
                stop.set()

    def stop_accepting() -> None:
        if front is not None:
            front.stop()
        app.state.kvlife.draining = True
        server.should_exit = True

    async def watch_engine() -> None:
        while engine.errored is None:  # NOTE: polled; a dead loop stops the server within this period
            await anyio.sleep(0.2)
        log.error("server.engine_dead", error=repr(engine.errored))

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_signals)
        try:
            async with engine:
                freeze_startup_objects()
                await start_serving(tg, server, sock, done)
                if front is not None:
                    await front.start(f"http://127.0.0.1:{sock.getsockname()[1]}", tg)
                log.info("server.started", host=host, port=public_port, model=config.model,
                         role=config.disaggregation, hisparse=config.hisparse is not None,
                         api_key=settings.api_key is not None)
                async with anyio.create_task_group() as waiters:
                    async def until(event: anyio.Event) -> None:
                        await event.wait()
                        waiters.cancel_scope.cancel()

                    async def until_after(watch: Any) -> None:
                        await watch()
                        waiters.cancel_scope.cancel()

                    waiters.start_soon(until, stop)
                    waiters.start_soon(until, done)
                    if front is not None:
                        waiters.start_soon(until, front.exited)
                    waiters.start_soon(until_after, watch_engine)
                if engine.errored is not None:
                    engine_error = EngineDead(engine.errored)
                elif not stop.is_set():
                    engine_error = RuntimeError("the HTTP server (or its API process) stopped on its own")
                stop_accepting()  # leaving the engine then ends every request in flight with SHUTDOWN
        except Exception as exc:  # noqa: BLE001 - a leak at exit, or the engine failed: reported below
            engine_error = exc
        stop_accepting()
        with anyio.move_on_after(settings.graceful_timeout + 5):
            await done.wait()
        tg.cancel_scope.cancel()
    sock.close()
    return _final_verdict(engine, engine_error)


def _final_verdict(engine: Engine, engine_error: BaseException | None) -> int:
    try:
        report = engine.check_memory()
    except LeakError as exc:
        log.error("server.leak_check", verdict="leak", problems=exc.problems)
        return 1
    pools = {name: {"capacity": s.capacity, "free": s.free, "evictable": s.evictable, "held": s.held,
                    "quarantined": s.quarantined} for name, s in report.pools.items()}
    if engine_error is not None and not isinstance(engine_error, LeakError):
        log.error("server.engine_failed", error=repr(engine_error))
        log.info("server.leak_check", verdict="clean", pools=pools)
        return 1
    log.info("server.leak_check", verdict="clean", pools=pools)
    log.info("server.stopped", requests=engine.stats.submitted, tokens=engine.stats.tokens_generated)
    return 0
