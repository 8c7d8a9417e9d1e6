"""RequestStream: one submission's outputs, as an async iterator.

Closing it, leaving `async with stream`, cancelling the task that iterates
it, or dropping it unfinished all abort the request it was created for (and
no other, even one that reuses its id): a client that left must never keep
memory busy. With `SamplingParams(n=k)` the stream carries the outputs of
all k sequences (`RequestOutput.index`) and ends after the k-th final one.
If the engine's loop dies, the stream raises `EngineDead`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from engine.errors import EngineDead
from engine.outputs import RequestOutput


class RequestStream:
    def __init__(self, request_id: str, receive: Any, abandon: Callable[[], None], *, n: int = 1) -> None:
        self.request_id = request_id
        self._receive = receive
        self._abandon_cb = abandon
        self._open = n  # sequences without a final output yet
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._receive.receive()
        except anyio.EndOfStream:
            self._done = True
            raise StopAsyncIteration from None
        except BaseException:  # cancelled, or the stream was closed under us
            self.abandon()
            raise
        if isinstance(output, EngineDead):
            self._done = True
            self._receive.close()
            raise output
        if output.finished:
            self._open -= 1
            if self._open <= 0:
                self._done = True
                self._receive.close()
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
        self._receive.close()
        self._abandon_cb()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abandon()
