"""RequestStream: one submission's outputs, as an async iterator, and the channel
that carries them from the loop.

Closing the stream, leaving `async with stream`, cancelling the task that
iterates it, or dropping it unfinished all abort the request it was created
for (and no other, even one that reuses its id): a client that left must
never keep memory busy. With `SamplingParams(n=k)` the stream carries the
outputs of all k sequences (`RequestOutput.index`) and ends after the k-th
final one. If the engine's loop dies, the stream raises `EngineDead`; a
request refused after `generate` returned (its grammar did not compile)
raises `InvalidRequest` before any output.

NOTE: `OutputChannel` is a deque and a wake-up event instead of an anyio
memory object stream: both ends live on the event loop's thread (the loop
writes, one client reads), and a send is then an append, which matters at
one send per token of every running request. For the same reason a channel
makes its wake-up events from the running library's own event class (the
class of the first `anyio.Event` it made), not through `anyio.Event`, which
looks the library up on every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from engine.outputs import RequestOutput

__all__ = ["OutputChannel", "RequestStream"]

log = structlog.get_logger("kvlife.stream")


class OutputChannel:
    """Outputs from the loop (the only writer) to one RequestStream (the only reader)."""

    __slots__ = ("_items", "_waiter", "_event_type", "closed", "reader_gone", "final_only", "forward")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: anyio.Event | None = None
        #: the running async library's event class, from the first wait on (module docstring)
        self._event_type: type[anyio.Event] | None = None
        self.closed = False  # the writer is done: the reader ends after the items left
        self.reader_gone = False  # the reader left: nothing is delivered any more
        #: the reader wants final outputs only (`Engine.complete`): chunks are dropped, never queued,
        #: so the reader is not woken once per token for outputs it would discard
        self.final_only = False
        #: the reader takes each item as it is sent, on the sender's thread, and None at the close
        #: (`RequestStream.forward`): nothing is queued and no task wakes
        self.forward: Callable[[RequestOutput | Exception | None], None] | None = None

    def send(self, item: Any) -> bool:
        """Queue `item`; False if the reader has left (or the channel is closed)."""
        if self.reader_gone or self.closed:
            return False
        if self.final_only and isinstance(item, RequestOutput) and not item.finished:
            return True
        if self.forward is not None:
            return self._forward(item)
        self._items.append(item)
        self._wake()
        return True

    def close(self) -> None:
        if self.forward is not None and not self.closed and not self.reader_gone:
            self._forward(None)
        self.closed = True
        self._wake()

    def _forward(self, item: RequestOutput | Exception | None) -> bool:
        """Hand `item` to the reader's callable; one that raises has left (the loop then aborts the
        request, as for any reader gone): a reader's code never stops the loop."""
        assert self.forward is not None
        try:
            self.forward(item)
        except Exception as exc:  # noqa: BLE001 - isolated: logged, and the reader counts as gone
            log.error("stream.forward_failed", error=repr(exc))
            self.reader_gone = True
            self.forward = None
            return False
        return True

    def leave(self) -> None:
        """The reader stops listening: drop what is queued."""
        self.reader_gone = True
        self._items.clear()

    async def receive(self) -> Any:
        """The next item; raises `anyio.EndOfStream` once closed and drained. A
        cancellation point even when an item is ready (as any anyio receive).

        NOTE: checked first, unconditionally: a consumer whose wake-up is always set
        before it is looked at (the loop sends, then yields) would otherwise never be
        seen waiting, and anyio would never deliver its cancellation. (Not only when an
        item is ready: a consumer that cancelled itself and then waits could be woken by
        the next output before anyio delivers the cancellation; tests/test_finish_paths.py
        holds it.)"""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while not self._items:
            if self.closed or self.reader_gone:
                raise anyio.EndOfStream
            event_type = self._event_type
            if event_type is None:
                waiter = anyio.Event()
                self._event_type = type(waiter)
            else:
                waiter = event_type()
            self._waiter = waiter
            await waiter.wait()
        return self._items.popleft()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()


class RequestStream:
    def __init__(self, request_id: str, channel: OutputChannel | None, abandon: Callable[[], None], *,
                 n: int = 1) -> None:
        """`channel` None: a stream its creator feeds (`feed`, `end`), as the API process's streams are."""
        self.request_id = request_id
        self._channel = channel if channel is not None else OutputChannel()
        self._abandon_cb = abandon
        self._open = n  # sequences without a final output yet
        self._done = False
        self._ready: anyio.Event | None = None  # set while the request waits to enter the engine
        self._refused: Exception | None = None

    def feed(self, item: RequestOutput | Exception) -> bool:
        """Queue an output (or the error that ends the stream) for the reader; False once it left."""
        return self._channel.send(item)

    def end(self) -> None:
        """No more outputs: the reader ends after those queued."""
        self._channel.close()

    # --------------------------------------------------- entering the engine
    def hold(self) -> None:
        """The request waits before entering the engine (its grammar compiles)."""
        self._ready = anyio.Event()

    def mark_ready(self, refused: Exception | None = None) -> None:
        """It entered the engine, or was refused (`refused`) before holding anything."""
        self._refused = refused
        if self._ready is not None:
            self._ready.set()

    async def ready(self) -> None:
        """Return once the request has entered the engine (at once, unless its grammar was
        still compiling); raise what refused it (`InvalidRequest`) if it never will."""
        if self._ready is not None:
            await self._ready.wait()
        if self._refused is not None:
            raise self._refused

    def forward(self, deliver: Callable[[RequestOutput | Exception | None], None]) -> None:
        """Hand each output (or the error that ends the stream) to `deliver` as the loop produces it,
        instead of queueing it for iteration; `deliver(None)` when the stream ends. For a reader that
        moves outputs elsewhere in bulk (the API process's bridge: serve.api_bridge): no task wakes per
        output. `deliver` runs on the loop and must not block; if it raises, the reader counts as gone
        and the request is aborted (the loop goes on). Call right after `generate`; the stream is then
        not iterated, and `abandon` still aborts the request."""
        def deliver_and_track(item: RequestOutput | Exception | None) -> None:
            if item is None or isinstance(item, Exception):
                self._done = True  # ended: nothing left to abandon
            deliver(item)

        self._channel.forward = deliver_and_track

    async def accepted(self) -> None:
        """Return once the engine holds the request: at once here, where `Engine.generate` raised any
        refusal itself (a stream from another process waits for its answer: serve.remote_engine)."""

    def _final_only(self) -> None:
        """Deliver only the final outputs (and errors): for a caller that discards the chunks
        (`Engine.complete`). Call before the first output can be sent (right after `generate`)."""
        self._channel.final_only = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._channel.receive()
        except anyio.EndOfStream:
            self._done = True
            raise StopAsyncIteration from None
        except BaseException:  # cancelled while waiting
            self.abandon()
            raise
        if isinstance(output, Exception):  # EngineDead, or the request refused before it started
            self._done = True
            self._channel.leave()
            raise output
        if output.finished:
            self._open -= 1
            if self._open <= 0:
                self._done = True
                self._channel.leave()
        return output

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.abandon()

    async def aclose(self) -> None:
        self.abandon()

    def abandon(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if self._done:
            return
        self._done = True
        self._channel.leave()
        self._abandon_cb()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abandon()
