"""RequestStream: one request's outputs, as an async iterator.

Closing it, leaving `async with stream`, cancelling the task that iterates
it, or dropping it unfinished all abort the request: a client that left
must never keep memory busy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from engine.outputs import RequestOutput


class RequestStream:
    def __init__(self, request_id: str, receive: Any, abandon: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._receive = receive
        self._abandon_cb = abandon
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
        if output.finished:
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
        self._abandon_cb(self.request_id)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abandon()
