"""The engine's side of `kvlife serve --api-process`: requests from the API process become
`Engine.generate` calls in this process, and their outputs go back in one frame per loop turn.

    async with api_bridge(engine) as bridge:   # a Unix socket in a private directory: bridge.path
        ...                                     # start the API process; await bridge.serving

Each submitted request is an ordinary stream of this engine whose outputs are forwarded as the loop
produces them (`RequestStream.forward`: no task per request, none woken per token); its release is
the engine's, on every path. When the API process says a client left (`abandon`), or the connection
to it ends, the stream is abandoned, which aborts the request. Nothing here holds memory of the
engine's pools.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import attrs
import structlog
from anyio.abc import ByteStream, TaskGroup

from engine import Engine, RequestOutput, RequestStream, SamplingParams
from engine.serve.api_wire import FrameReader, Message, pack_error, pack_output, send_frame

__all__ = ["Bridge", "api_bridge", "serve_connection"]

log = structlog.get_logger("kvlife.api_bridge")


class _Outbox:
    """Messages for the API process, written together by one task once per loop turn."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._messages: list[Message] = []
        self._wake = anyio.Event()

    def put(self, message: Message) -> None:
        self._messages.append(message)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            messages, self._messages = self._messages, []
            await send_frame(self._stream, messages)


def _deliver(key: int, outbox: _Outbox, streams: dict[int, RequestStream]
             ) -> Callable[[RequestOutput | Exception | None], None]:
    """The stream's outputs straight into the outbox, on the loop, as the loop produces them."""
    def deliver(item: RequestOutput | Exception | None) -> None:
        if item is None:
            outbox.put(("end", key, None))
        elif isinstance(item, Exception):  # EngineDead, or its grammar refused: the route says which
            outbox.put(("end", key, pack_error(item)))
        else:
            outbox.put(("out", key, pack_output(item)))
            return
        streams.pop(key, None)
    return deliver


async def _say_ready(key: int, stream: RequestStream, outbox: _Outbox) -> None:
    """A constrained request: tell the API process once its grammar compiled (or why it did not)."""
    try:
        await stream.ready()
    except Exception as exc:  # noqa: BLE001 - refused before it held anything: the route maps it
        outbox.put(("ready", key, pack_error(exc)))
        return
    outbox.put(("ready", key, None))


async def serve_connection(engine: Engine, connection: ByteStream, ready: anyio.Event | None = None) -> None:
    """Serve one API process until it disconnects; every request it left open is then aborted. `ready`
    is set when it says it serves (its ("serving",) message)."""
    outbox = _Outbox(connection)
    streams: dict[int, RequestStream] = {}  # NOTE: held here: a stream nobody holds abandons its request
    reader = FrameReader(connection)

    def submit(tg: TaskGroup, key: int, token_ids: list[int], params: SamplingParams, request_id: str,
               priority: int, deadline: float | None, session: str | None, resume: list[int] | None) -> None:
        try:
            stream = engine.generate(token_ids, params, request_id=request_id, priority=priority, deadline=deadline,
                                     session=session, resume_output_ids=resume)
        except Exception as exc:  # noqa: BLE001 - refused before it held anything: the route maps it
            outbox.put(("accepted", key, pack_error(exc)))
            return
        outbox.put(("accepted", key, None))
        streams[key] = stream
        stream.forward(_deliver(key, outbox, streams))
        if params.constraint is not None:
            tg.start_soon(_say_ready, key, stream, outbox)

    async def write_until_broken() -> None:
        try:
            await outbox.run()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            tg.cancel_scope.cancel()

    async with connection, anyio.create_task_group() as tg:
        tg.start_soon(write_until_broken)
        try:
            while True:
                for message in await reader.receive():
                    if message[0] == "submit":
                        submit(tg, *message[1:])
                    elif message[0] == "abandon":
                        stream = streams.pop(message[1], None)
                        if stream is not None:
                            stream.abandon()  # the engine aborts it; its release is the hooks'
                    elif message[0] == "serving" and ready is not None:
                        ready.set()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            log.info("api_bridge.disconnected", open_requests=len(streams))
        finally:
            for stream in list(streams.values()):
                stream.abandon()
            streams.clear()
            tg.cancel_scope.cancel()


@attrs.define
class Bridge:
    path: str  # the Unix socket the API process dials
    serving: anyio.Event  # set once the API process accepts HTTP connections


@contextlib.asynccontextmanager
async def api_bridge(engine: Engine) -> AsyncIterator[Bridge]:
    """Listen for the API process on a Unix socket in a fresh private directory."""
    with tempfile.TemporaryDirectory(prefix="kvlife-api-") as directory:
        bridge = Bridge(str(Path(directory) / "engine.sock"), anyio.Event())
        listener = await anyio.create_unix_listener(bridge.path)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, lambda connection: serve_connection(engine, connection, bridge.serving))
            try:
                yield bridge
            finally:
                tg.cancel_scope.cancel()
