"""The API process of `kvlife serve --api-process`: it owns the public socket, parses, tokenizes,
frames and writes the generation routes' answers, and sends each request to the engine's process
(`engine.serve.remote_engine`); every other route is passed to the engine's own server on loopback.

    engine.serve.api_front.main()    # with a pickled FrontHandoff on stdin: engine.serve.api_process starts it

Why a second process: the engine's steps and the HTTP layer's Python otherwise take turns on one
GIL (docs/http.md, "Third pass"). Here the socket writes, chunk framing and request parsing run on
another core, and the engine's process does for the HTTP clients what it does for embedded ones.

It exits 0 once SIGTERM has drained its connections, and on its own once the engine's process is
gone (after the open streams got their error). SIGINT is ignored: the engine's process, which a
terminal's Ctrl-C reaches too, decides when the API process stops.
"""

from __future__ import annotations

import pickle
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

import anyio
import attrs
import httpx
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.logging import configure_logging
from engine.serve.context import ServerContext
from engine.serve.http_errors import HTTPError
from engine.serve.remote_engine import EngineDescription, RemoteEngine
from engine.serve.routes_generation import generation_routes
from engine.serve.settings import ServerSettings
from engine.serve.uvicorn_runner import freeze_startup_objects, uvicorn_server

__all__ = ["FrontHandoff", "front_app", "main"]

log = structlog.get_logger("kvlife.api_front")

#: seconds a passed-through route may take past `ServerSettings.health_timeout` before it is a 504
PASS_THROUGH_SLACK_S = 30.0

#: not passed on: they describe one hop (RFC 9110, 7.6.1), and the body is re-framed
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                          "proxy-connection", "content-length", "host"})


@attrs.frozen
class FrontHandoff:
    """What the engine's process gives the API process on its standard input (pickled)."""

    described: EngineDescription
    settings: ServerSettings
    listen_fd: int  # the public listening socket, bound by the engine's process and inherited
    bridge_path: str  # engine.serve.api_bridge's Unix socket
    engine_url: str  # the engine's own server, on loopback: every route but generation's
    log_level: str
    log_json: bool


def _passed_on(client: httpx.AsyncClient, retry_after_s: int) -> Callable[[Request], Awaitable[Response]]:
    async def pass_on(request: Request) -> Response:
        """The engine's server's answer to the same request (its API key check included); 504 if it
        takes longer than the client's timeout, 503 if it cannot be reached."""
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_HEADERS]
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            answer = await client.request(request.method, target, headers=headers, content=body)
        except httpx.TimeoutException:
            return HTTPError(504, "the engine's process did not answer in time").response()
        except httpx.TransportError as exc:
            return HTTPError(503, f"the engine's process cannot be reached ({exc.__class__.__name__})",
                             headers={"Retry-After": str(retry_after_s)}).response()
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
        return Response(answer.content, status_code=answer.status_code, headers=kept)
    return pass_on


def front_app(remote: RemoteEngine, settings: ServerSettings, client: httpx.AsyncClient) -> Starlette:
    """Generation routes here; anything else (ops, sessions, tokens, router routes, unknown paths: their
    404 and 405 included) answered by the engine's server, status, headers and body as it gave them."""
    ctx = ServerContext.build(remote, settings)
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return ctx.app([*generation_routes(ctx),
                    Route("/{path:path}", _passed_on(client, settings.retry_after_s), methods=methods)])


async def run_front(handoff: FrontHandoff) -> int:
    sock = socket.socket(fileno=handoff.listen_fd)
    connection = await anyio.connect_unix(handoff.bridge_path)
    remote = RemoteEngine(handoff.described, connection)
    # NOTE: the slowest route passed through is /health_generate, bounded by health_timeout
    timeout = handoff.settings.health_timeout + PASS_THROUGH_SLACK_S
    async with httpx.AsyncClient(base_url=handoff.engine_url, timeout=timeout) as client:
        app = front_app(remote, handoff.settings, client)
        server = uvicorn_server(app, handoff.settings)

        def stop() -> None:
            app.state.kvlife.draining = True
            server.should_exit = True

        async with anyio.create_task_group() as tg:
            async def carry() -> None:
                await remote.run()
                log.info("api_front.engine_gone", cause=repr(remote.errored))
                stop()

            async def on_sigterm() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        if server.should_exit:
                            server.force_exit = True
                        stop()

            tg.start_soon(carry)
            tg.start_soon(on_sigterm)
            freeze_startup_objects()  # as the engine's process does (engine.serve.server)

            async def say_serving() -> None:
                while not server.started:
                    await anyio.sleep(0.01)
                remote.serving()

            tg.start_soon(say_serving)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
    return 0


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    handoff: FrontHandoff = pickle.load(sys.stdin.buffer)
    configure_logging(handoff.log_level, json=handoff.log_json)
    try:
        import uvloop  # noqa: F401 - the faster event loop, when installed
    except ImportError:
        options = {}
    else:
        options = {"use_uvloop": True}
    return anyio.run(run_front, handoff, backend="asyncio", backend_options=options)

