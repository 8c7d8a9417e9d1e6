"""The engine as the API process sees it (`kvlife serve --api-process`): what the generation routes
read of an `Engine` (its config, model config, context bound and tokenizer, and `generate`), with
each request carried to the engine's process over `engine.serve.api_wire`.

    remote = RemoteEngine(described, connection)   # described: what the engine's process sent
    async with anyio.create_task_group() as tg:
        tg.start_soon(remote.run)
        stream = remote.generate(token_ids, params, request_id="r1")
        await stream.accepted()                     # raises what the engine refused it with
        async for output in stream: ...

Streams are the engine's own `RequestStream` class over a local channel, so a route reads them as
it reads an embedded engine's. Abandoning one tells the engine's process, which aborts the request
there; the memory stays the engine's business. If the connection ends, every open stream ends with
`EngineDead` and new requests are refused with `EngineClosed`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import anyio
import attrs
from anyio.abc import ByteStream

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import EngineClosed, EngineDead, EngineOverloaded
from engine.serve.api_wire import FrameReader, Message, OutputViews, send_frame, unpack_error
from engine import RequestStream

__all__ = ["EngineDescription", "RemoteEngine", "RemoteStream"]

#: seconds the engine's process has to answer a submission (it answers at once unless its loop is stuck):
#: past it, the request is abandoned and refused as EngineOverloaded (a 503 with Retry-After)
ANSWER_TIMEOUT_S = 30.0

#: how a connection ends: the peer closed it, broke it, or sent half a frame
_GONE = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


@attrs.frozen
class EngineDescription:
    """What the API process needs to parse and validate requests as the engine's process would."""

    config: EngineConfig
    model_config: object  # engine.model.ModelConfig: the routes read its vocab_size
    max_context: int
    tokenizer: object  # engine.model.tokenizer.Tokenizer: the routes encode and decode with it

    @classmethod
    def of(cls, engine: Engine) -> EngineDescription:
        return cls(engine.config, engine.model_config, engine.max_context, engine.tokenizer)


class RemoteStream(RequestStream):
    """A request stream whose request lives in another process: `accepted()` waits for the engine's
    answer to the submission (and raises its refusal: InvalidRequest, EngineOverloaded, EngineClosed)."""

    def __init__(self, request_id: str, abandon: Callable[[], None], *, n: int) -> None:
        super().__init__(request_id, None, abandon, n=n)
        self._answered = anyio.Event()
        self._refusal: Exception | None = None

    def mark_ready_once(self, refused: Exception | None = None) -> None:
        """mark_ready, unless it was (the stream's end may bring a refusal before the "ready" does)."""
        if self._ready is not None and not self._ready.is_set():
            self.mark_ready(refused)

    def answer(self, refusal: Exception | None) -> None:
        self._refusal = refusal
        self._answered.set()

    async def accepted(self) -> None:
        with anyio.move_on_after(ANSWER_TIMEOUT_S):
            await self._answered.wait()
        if not self._answered.is_set():
            self.abandon()
            raise EngineOverloaded(f"the engine's process did not take the request within {ANSWER_TIMEOUT_S:g} s")
        if self._refusal is not None:
            self.abandon()
            raise self._refusal


@attrs.define
class _Open:
    stream: RemoteStream
    views: OutputViews


class RemoteEngine:
    def __init__(self, described: EngineDescription, connection: ByteStream) -> None:
        self.config = described.config
        self.model_config = described.model_config
        self.max_context = described.max_context
        self.tokenizer = described.tokenizer
        self.errored: BaseException | None = None
        self._connection = connection
        self._open: dict[int, _Open] = {}
        self._next_key = 0
        self._outgoing: list[Message] = []
        self._wake: anyio.Event | None = None

    def generate(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                 priority: int = 0, deadline: float | None = None, session: str | None = None,
                 resume_output_ids: Sequence[int] | None = None) -> RemoteStream:
        """Send the request to the engine's process; the stream's `accepted()` says whether it took it."""
        if self.errored is not None:
            raise EngineClosed(f"the engine's process is gone ({self.errored})")
        key, self._next_key = self._next_key, self._next_key + 1
        request_id = request_id or uuid.uuid4().hex
        stream = RemoteStream(request_id, lambda: self._abandon(key), n=params.n)
        if params.constraint is not None:
            stream.hold()
        self._open[key] = _Open(stream, OutputViews())
        self._send(("submit", key, list(prompt), params, request_id, priority, deadline, session,
                    None if resume_output_ids is None else list(resume_output_ids)))
        return stream

    def serving(self) -> None:
        """Tell the engine's process that this one accepts HTTP connections now."""
        self._send(("serving",))

    def _abandon(self, key: int) -> None:
        if self._open.pop(key, None) is not None and self.errored is None:
            self._send(("abandon", key))

    def _send(self, message: Message) -> None:
        self._outgoing.append(message)
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """Carry requests and outputs until the connection ends; then end every open stream."""
        cause: BaseException = anyio.EndOfStream()
        try:
            async with self._connection, anyio.create_task_group() as tg:
                async def write() -> None:
                    nonlocal cause
                    try:
                        await self._write()
                    except _GONE as exc:
                        cause = exc
                        tg.cancel_scope.cancel()

                tg.start_soon(write)
                try:
                    await self._read()
                except _GONE as exc:
                    cause = exc
                tg.cancel_scope.cancel()
        finally:  # also when cancelled: nothing will answer the open streams any more
            self._lost(cause)

    async def _write(self) -> None:
        while True:
            if not self._outgoing:
                self._wake = anyio.Event()
                await self._wake.wait()
            messages, self._outgoing = self._outgoing, []
            await send_frame(self._connection, messages)

    async def _read(self) -> None:
        reader = FrameReader(self._connection)
        while True:
            for kind, key, value in await reader.receive():
                entry = self._open.get(key)
                if entry is None:  # abandoned here: whatever was already on the way is dropped
                    continue
                if kind == "out":
                    entry.stream.feed(entry.views.unpack(value))
                elif kind == "accepted":
                    refusal = unpack_error(value)
                    if refusal is not None:
                        del self._open[key]
                    entry.stream.answer(refusal)
                elif kind == "ready":
                    entry.stream.mark_ready(unpack_error(value))
                else:  # "end"
                    error = unpack_error(value)
                    entry.stream.mark_ready_once(error)  # a grammar refused: its "ready" may come after
                    if error is not None:
                        entry.stream.feed(error)
                    entry.stream.end()
                    del self._open[key]

    def _lost(self, cause: BaseException) -> None:
        self.errored = cause
        dead = EngineDead(ConnectionError(f"the connection to the engine's process ended ({cause!r})"))
        for entry in self._open.values():
            entry.stream.answer(EngineClosed("the engine's process is gone"))
            entry.stream.mark_ready_once()
            entry.stream.feed(dead)
            entry.stream.end()
        self._open.clear()
