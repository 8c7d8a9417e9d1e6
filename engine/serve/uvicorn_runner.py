"""uvicorn as kvlife runs it: a listening socket, a server that leaves signals to its caller, starting
it in a task group, serving any ASGI app for a block, and freezing a started process's heap.
(`engine.serve.server` runs the engine's app with these; the API process, `api_front`, its own.)"""

from __future__ import annotations

import contextlib
import gc
import socket
from collections.abc import AsyncIterator

import anyio
import uvicorn
from anyio.abc import TaskGroup
from starlette.applications import Starlette

from engine.serve.settings import ServerSettings

__all__ = ["bind_socket", "freeze_startup_objects", "running_app", "start_serving", "uvicorn_server"]


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` decides what a signal means."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port); port 0 picks a free one. Raises OSError.

    NOTE: TCP_NODELAY on the listener, which the accepted connections inherit: uvicorn writes a
    response's head and body separately, and with Nagle's algorithm on, the body then waits for
    the client's delayed ACK (about 40 ms on Linux) on every response and every stream chunk."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_server(app: Starlette, settings: ServerSettings) -> _Server:
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False,
                            timeout_graceful_shutdown=int(settings.graceful_timeout) or 1)
    return _Server(config)


async def start_serving(tg: TaskGroup, server: _Server, sock: socket.socket, done: anyio.Event) -> None:
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
async def running_app(app: Starlette, host: str = "127.0.0.1", port: int = 0, *,
                      settings: ServerSettings | None = None) -> AsyncIterator[str]:
    """Serve any ASGI `app` with uvicorn in this task group; yields the base URL (asyncio only)."""
    sock = bind_socket(host, port)
    server = uvicorn_server(app, settings or ServerSettings())
    done = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            await start_serving(tg, server, sock, done)
            try:
                yield f"http://{host}:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()  # uvicorn closes it on a clean shutdown, not when cancelled


def freeze_startup_objects() -> None:
    """Move what exists once the engine runs (the model, the pools, the modules: hundreds of thousands of
    objects) out of the collector's sight, as a process that owns its heap may (`gc.freeze`).

    NOTE: measured under the 64-client benchmark (docs/http.md, Performance): without it a full
    collection ran about every 9 s and scanned all of them on the event loop's thread, holding the GIL
    (the engine stopped with it) for 0.18-0.22 s each."""
    gc.collect()
    gc.freeze()
