"""The HTTP server: an ASGI app (Starlette) over the public Engine API, served by uvicorn.

    app = create_app(engine)                       # mount it anywhere ASGI runs
    exit_code = await serve(EngineConfig(), "127.0.0.1", 30000)

Routes (bodies and answers in docs/http.md):

    POST /generate          SGLang-style generation; `stream` gives server-sent events
    POST /v1/completions    the OpenAI completions subset; GET /v1/models
    POST /abort             abort by request id (404 if unknown or already finished)
    GET  /health            liveness, makes no request
    GET  /health_generate   `engine.health_check()` through the whole path: 200 or 503
    GET  /metrics           Prometheus text (engine.serve.metrics.EngineCollector)
    GET  /debug/memory      `memory_report()` as JSON, with owners

Bad bodies are rejected by engine.serve.schemas before the engine is called
(400 naming the field and the limit, 413 for a body over the bound); a full
queue answers 503 with Retry-After. A client that disconnects, while its
request is queued, running or streaming, aborts it: the stream is abandoned
and the engine releases the request like any other.

`serve` owns the process: it binds, runs engine and server, and on SIGTERM
or SIGINT stops accepting, leaves the engine (every request in flight
finishes with SHUTDOWN, so each SSE client gets a final event), logs the
final leak-check verdict and returns 0 (1 if the leak check failed).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineClosed, EngineOverloaded, HealthCheckFailed, InvalidRequest
from engine.serve.generation import EventStream, Generation, HTTPError, completion_events, completion_json
from engine.serve.generation import generate_events, generate_json, run_to_end
from engine.serve.schemas import Limits, parse_abort, parse_completion, parse_generate, parse_json
from engine.logging import configure_logging
from engine.serve.metrics import EngineCollector
from resources import LeakError

log = structlog.get_logger("kvlife.http")


@attrs.frozen
class ServerSettings:
    """Bounds and timeouts of the HTTP layer (the engine's own are in EngineConfig)."""

    max_body_bytes: int = attrs.field(default=1 << 20, validator=attrs.validators.ge(1))
    #: None: max_context - 1
    max_prompt_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.ge(1)))
    #: generation requests at once; None: max_running + max_queued
    max_inflight: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    health_timeout: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    retry_after_s: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    served_model_name: str | None = None
    graceful_timeout: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))


def _error(status: int, message: str, *, field: str | None = None, limit: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}.get(status,
                                                                                                   "server_error")
    body = {"error": {"message": message, "type": kind, "code": status, "field": field, "limit": limit}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: Engine, settings: ServerSettings | None = None) -> Starlette:
    """The ASGI app serving `engine` (which the caller runs, inside `async with engine`)."""
    settings = settings or ServerSettings()
    limits = Limits.for_engine(engine, max_prompt_tokens=settings.max_prompt_tokens,
                               model_name=settings.served_model_name)
    max_inflight = settings.max_inflight or engine.config.max_running + engine.config.max_queued
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    state = {"inflight": 0, "draining": False}
    retry = {"Retry-After": str(settings.retry_after_s)}

    def unavailable(message: str) -> JSONResponse:
        return _error(503, message, headers=retry)

    async def read_json(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise HTTPError(413, f"body must be at most {settings.max_body_bytes} bytes", "body",
                            f"at most {settings.max_body_bytes} bytes")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > settings.max_body_bytes:
                    raise HTTPError(413, f"body must be at most {settings.max_body_bytes} bytes", "body",
                                    f"at most {settings.max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise HTTPError(499, "the client disconnected while sending the body") from None
        return parse_json(b"".join(chunks))

    async def generation_endpoint(request: Request, openai: bool) -> Response:
        if state["draining"]:
            return unavailable("the server is shutting down")
        try:
            raw = await read_json(request)
            if openai:
                body, model = parse_completion(raw, limits, engine.tokenizer)
                if model != limits.model_name:
                    return _error(404, f"model {model!r} is not served here (serving {limits.model_name!r})",
                                  field="model", limit=f"{limits.model_name!r}")
            else:
                body, model = parse_generate(raw, limits, engine.tokenizer), limits.model_name
            if state["inflight"] >= max_inflight:
                return unavailable(f"{max_inflight} requests already in flight; retry later")
            generation = Generation(engine, body, route=request.url.path, openai=openai)
        except InvalidRequest as exc:
            field = "rid" if exc.field == "request_id" else exc.field
            return _error(400, str(exc).replace(exc.field, field, 1), field=field, limit=exc.limit)
        except HTTPError as exc:
            return _error(exc.status, exc.message, field=exc.field, limit=exc.limit)
        except EngineOverloaded as exc:
            return unavailable(f"the engine's queue is full ({exc}); retry later")
        except EngineClosed:
            return unavailable("the engine is not running")
        state["inflight"] += 1
        generation.on_close = lambda: state.__setitem__("inflight", state["inflight"] - 1)
        if body.stream:
            events = completion_events(generation, model, body.include_usage) if openai else generate_events(generation)
            return EventStream(events, generation.close)
        if not await run_to_end(generation, request.receive):
            return Response(status_code=499)  # the client left; nobody reads this
        return JSONResponse(completion_json(generation, model) if openai else generate_json(generation))

    async def generate(request: Request) -> Response:
        return await generation_endpoint(request, openai=False)

    async def completions(request: Request) -> Response:
        return await generation_endpoint(request, openai=True)

    async def abort(request: Request) -> Response:
        try:
            rid = parse_abort(await read_json(request))
        except InvalidRequest as exc:
            return _error(400, str(exc), field=exc.field, limit=exc.limit)
        except HTTPError as exc:
            return _error(exc.status, exc.message, field=exc.field, limit=exc.limit)
        if not await engine.abort(rid):
            return _error(404, f"no request {rid!r} in flight", field="rid")
        log.info("request.abort_requested", request_id=rid)
        return JSONResponse({"rid": rid, "aborted": True})

    async def models(request: Request) -> Response:
        card = {"id": limits.model_name, "object": "model", "created": 0, "owned_by": "kvlife",
                "max_model_len": limits.max_context}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if state["draining"] or not engine.running:
            return JSONResponse({"status": "stopping" if state["draining"] else "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def health_generate(request: Request) -> Response:
        try:
            await engine.health_check(timeout=settings.health_timeout)
        except HealthCheckFailed as exc:
            log.warning("health.failed", reason=str(exc))
            return JSONResponse({"status": "unhealthy", "reason": str(exc)}, status_code=503)
        except (EngineClosed, EngineOverloaded, InvalidRequest) as exc:
            return JSONResponse({"status": "unhealthy", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def debug_memory(request: Request) -> Response:
        return JSONResponse(engine.memory_report().as_dict())

    app = Starlette(routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/abort", abort, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/debug/memory", debug_memory, methods=["GET"]),
    ])
    app.state.kvlife = state  # NOTE: `serve` sets state["draining"] on SIGTERM
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` decides what a signal means."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port); port 0 picks a free one. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _uvicorn_server(app: Starlette, settings: ServerSettings) -> _Server:
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False,
                            timeout_graceful_shutdown=int(settings.graceful_timeout) or 1)
    return _Server(config)


async def _start(tg: Any, server: _Server, sock: socket.socket, done: anyio.Event) -> None:
    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:
            done.set()

    tg.start_soon(run)
    with anyio.fail_after(30):
        while not server.started and not done.is_set():
            await anyio.sleep(0.01)
    if not server.started:
        raise RuntimeError("the HTTP server did not start")


@contextlib.asynccontextmanager
async def running_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, *,
                         settings: ServerSettings | None = None) -> AsyncIterator[str]:
    """Serve a running `engine` in this task group; yields the base URL (asyncio only)."""
    settings = settings or ServerSettings()
    sock = bind_socket(host, port)
    server = _uvicorn_server(create_app(engine, settings), settings)
    done = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            await _start(tg, server, sock, done)
            try:
                yield f"http://{host}:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()  # uvicorn closes it on a clean shutdown, not when cancelled


class _ToStructlog(logging.Handler):
    """uvicorn's stdlib log records as structlog events, so every line is JSON."""

    def emit(self, record: logging.LogRecord) -> None:
        structlog.get_logger(record.name).log(record.levelno, "server.uvicorn", message=record.getMessage())


async def serve(config: EngineConfig, host: str, port: int, *, log_json: bool = True, log_level: str = "info",
                settings: ServerSettings | None = None) -> int:
    """Run engine and server until SIGTERM or SIGINT; 0 if the final leak check is clean, else 1."""
    configure_logging(log_level, json=log_json)
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.handlers[:] = [_ToStructlog()]
    uvicorn_log.setLevel(logging.WARNING if log_level != "debug" else logging.INFO)
    uvicorn_log.propagate = False
    settings = settings or ServerSettings()
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        log.error("server.bind_failed", host=host, port=port, error=str(exc))
        return 1
    try:
        engine = Engine(config)
        app = create_app(engine, settings)
    except BaseException:
        sock.close()
        raise
    server = _uvicorn_server(app, settings)
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
        app.state.kvlife["draining"] = True
        server.should_exit = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_signals)
        try:
            async with engine:
                await _start(tg, server, sock, done)
                log.info("server.started", host=host, port=sock.getsockname()[1], model=config.model,
                         role=config.disaggregation, hisparse=config.hisparse is not None)
                async with anyio.create_task_group() as waiters:
                    async def until(event: anyio.Event) -> None:
                        await event.wait()
                        waiters.cancel_scope.cancel()

                    waiters.start_soon(until, stop)
                    waiters.start_soon(until, done)
                if not stop.is_set():
                    engine_error = RuntimeError("the HTTP server stopped on its own")
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
