"""One HTTP generation: the engine stream as text chunks; SSE framing; the `/generate` answers.

`Generation` wraps `engine.generate(...)`: it turns each RequestOutput into
a `Chunk` (the text delta, the new token ids, and the finish reason on the
last), matches stop strings on the text (cutting the text before the stop
string and aborting the request if the engine has not finished it), holds
back text that may still become a stop string or an incomplete UTF-8
character, and logs one `request.summary` line at info when it closes.

`close()` is idempotent and abandons the engine stream: whatever way the
HTTP exchange ends (finished, client gone, cancelled, error), the request
is aborted if it is still running and is released like any other.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import attrs
import structlog

from engine.serve.schemas import MAX_STOP_CHARS, GenerateBody
from engine.outputs import RequestOutput

log = structlog.get_logger("kvlife.http")
DONE = b"data: [DONE]\n\n"


@attrs.frozen
class Chunk:
    delta: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # set on the last chunk only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` not to send yet: a stop string's prefix, or U+FFFD."""
    settled = text.rstrip("\ufffd")  # NOTE: an incomplete UTF-8 character decodes to U+FFFD
    unsettled = len(text) - len(settled)
    hold = unsettled
    for stop in stops:
        for k in range(min(len(stop) - 1, len(settled)), 0, -1):
            if settled.endswith(stop[:k]):
                hold = max(hold, unsettled + k)
                break
    return hold


class Generation:
    def __init__(self, engine: Any, body: GenerateBody, *, route: str, id_prefix: str = "") -> None:
        self.request_id = body.rid or f"{id_prefix}{uuid.uuid4().hex}"
        self.body = body
        self.route = route
        self.tokenizer = engine.tokenizer
        self.started = time.monotonic()
        self.created = int(time.time())
        self.stream = engine.generate(body.token_ids, body.params, request_id=self.request_id)
        self.token_ids: list[int] = []
        self.text = ""  # what has been (or, on the final chunk, will be) sent
        self.finish_reason: str | None = None
        self.final: RequestOutput | None = None
        self.first_chunk_at: float | None = None
        self.on_close: Callable[[], None] | None = None
        self._closed = False

    async def next(self) -> Chunk | None:
        """The next chunk to send; None once the final chunk was returned."""
        if self.finish_reason is not None:
            return None
        try:
            output = await self.stream.__anext__()
        except StopAsyncIteration:  # the stream was abandoned under us
            self.finish_reason = "abort"
            return Chunk("", [], "abort")
        self.token_ids = output.token_ids
        text = self.tokenizer.decode(output.token_ids)
        finish = output.finish_reason.value if output.finished else None
        if output.finished:
            self.final = output
        stops = self.body.stop
        if stops:
            start = max(0, len(self.text) - MAX_STOP_CHARS)
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if hits:
                text, finish = text[: min(hits)], "stop"
                self.stream.abandon()  # aborts the request if the engine has not finished it
        visible = text if finish is not None else text[: len(text) - _holdback(text, stops)]
        delta = visible[len(self.text):]
        self.text = visible if len(visible) > len(self.text) else self.text
        if self.first_chunk_at is None and output.new_token_ids:
            self.first_chunk_at = time.monotonic()
        self.finish_reason = finish
        return Chunk(delta, list(output.new_token_ids), finish)

    def close(self) -> None:
        """Abandon the engine stream (an abort if still running) and log the summary, once."""
        if self._closed:
            return
        self._closed = True
        self.stream.abandon()
        if self.on_close is not None:
            self.on_close()
        log.info("request.summary", request_id=self.request_id, route=self.route, stream=self.body.stream,
                 finish_reason=self.finish_reason or "client_gone", prompt_tokens=len(self.body.token_ids),
                 completion_tokens=len(self.token_ids), **self.timings())

    def timings(self) -> dict[str, float | None]:
        final = self.final
        return {
            "queue_time": None if final is None else final.queue_time,
            "time_to_first_token": None if self.first_chunk_at is None else self.first_chunk_at - self.started,
            "e2e_latency": time.monotonic() - self.started,
        }

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.body.token_ids), len(self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def meta_info(self) -> dict[str, Any]:
        final = self.final
        return {"id": self.request_id, "finish_reason": self.finish_reason, **self.usage(),
                "cached_tokens": 0 if final is None else final.num_cached_tokens,
                "error": None if final is None else final.error, **self.timings()}


async def _watch_disconnect(receive: Callable, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def run_to_end(generation: Generation, receive: Callable) -> bool:
    """Drive a non-streaming generation; False (and the request aborted) if the client left."""
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
            while await generation.next() is not None:
                pass
            tg.cancel_scope.cancel()
    finally:
        generation.close()
    return generation.finish_reason is not None


class EventStream:
    """An ASGI response of server-sent events that aborts its request when the client leaves."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass  # the client is gone; on_close aborts the request
        finally:
            self.on_close()
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def generate_events(generation: Generation) -> AsyncIterator[bytes]:
    """`/generate` stream: one event per output chunk, the last with meta_info, then [DONE]."""
    while (chunk := await generation.next()) is not None:
        event: dict[str, Any] = {"rid": generation.request_id, "text": chunk.delta,
                                 "token_ids": chunk.new_token_ids, "finished": chunk.finished}
        if chunk.finished:
            event["meta_info"] = generation.meta_info()
            event["output_text"] = generation.text
            event["output_ids"] = generation.token_ids
        yield sse_event(event)
    yield DONE


def generate_json(generation: Generation) -> dict[str, Any]:
    return {"rid": generation.request_id, "text": generation.text, "output_ids": generation.token_ids,
            "meta_info": generation.meta_info()}
