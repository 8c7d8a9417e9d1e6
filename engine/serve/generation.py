"""One HTTP generation: the engine stream as chunks per sequence; SSE framing; the `/generate` answers.

`Generation` wraps `engine.generate(...)`: each RequestOutput becomes a
`Chunk` of one of the request's `n` sequences (`RequestOutput.index`): its
new text (`RequestOutput.new_text`: the engine detokenizes incrementally,
holds back an incomplete UTF-8 character or a possible stop-string prefix,
and matches stop strings itself), its new token ids and logprobs, and the
finish reason on that sequence's last chunk. Nothing is re-decoded here.
`Generation.choices` keeps each sequence's text, ids and logprobs for the
whole answers and usage; one `request.summary` line is logged at info when
it closes.

`close()` is idempotent and abandons the engine stream: whatever way the
HTTP exchange ends (finished, client gone, cancelled, error), the request
(every one of its sequences) is aborted if it is still running and is
released like any other.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
import attrs
import structlog

from engine.errors import EngineDead
from engine.outputs import RequestOutput, TokenLogprob
from engine.serve.failures import GenerationFailed, openai_finish_reason
from engine.serve.schemas import GenerateBody

log = structlog.get_logger("kvlife.http")
DONE = b"data: [DONE]\n\n"


@attrs.frozen
class Chunk:
    index: int
    delta: str
    new_token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # set on the sequence's last chunk only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: Chunk) -> Chunk:
        """This chunk and the same sequence's next one, as one."""
        logprobs = None if self.logprobs is None and later.logprobs is None else (
            (self.logprobs or ()) + (later.logprobs or ()))
        return Chunk(self.index, self.delta + later.delta, self.new_token_ids + later.new_token_ids, logprobs,
                     later.finish_reason)


@attrs.define
class Choice:
    """One sequence's answer so far."""

    index: int
    parts: list[str] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    finish_reason: str | None = None
    final: RequestOutput | None = None
    #: issue 21: the prompt's logprobs (first entry None), from the sequence's first output
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Generation:
    def __init__(self, engine: Any, body: GenerateBody, *, route: str, id_prefix: str = "",
                 default_deadline: float | None = None, openai_reasons: bool = False, stream_interval: int = 1) -> None:
        #: the OpenAI routes' finish reasons: a deadline that cut an answer short is "length"
        #: (`engine.serve.failures.openai_finish_reason`); /generate keeps the engine's reasons
        self.openai_reasons = openai_reasons
        self.request_id = body.rid or f"{id_prefix}{uuid.uuid4().hex}"
        self.body = body
        self.route = route
        self.tokenizer = engine.tokenizer  # for logprobs' token texts
        self.started = time.monotonic()
        self.created = int(time.time())
        self.stream = engine.generate(body.token_ids, body.params, request_id=self.request_id,
                                      **body.submit.kwargs(default_deadline))  # issue 21
        self.choices = [Choice(i) for i in range(body.params.n)]
        self.first_chunk_at: float | None = None
        self.on_close: Callable[[], None] | None = None
        self._open = body.params.n
        self._closed = False
        #: streamed: a sequence's chunks after its first are held until this many tokens (or its end)
        self.stream_interval = stream_interval if body.stream else 1
        self._held: dict[int, Chunk] = {}


    @property
    def done(self) -> bool:
        return self._open == 0

    async def next(self) -> Chunk | None:
        """The next chunk to send; None once every sequence's final chunk was returned. With a stream
        interval, a sequence's chunks after its first token come `stream_interval` tokens at a time."""
        while True:
            chunk = await self._next_output()
            if chunk is None or self.stream_interval == 1:
                return chunk
            held = self._held.pop(chunk.index, None)
            if held is not None:
                chunk = held.then(chunk)
            tokens = len(chunk.new_token_ids)
            if chunk.finished or not tokens or tokens >= self.stream_interval or \
                    tokens == len(self.choices[chunk.index].token_ids):  # its first token goes at once
                return chunk
            self._held[chunk.index] = chunk

    async def _next_output(self) -> Chunk | None:
        if self._open == 0:
            return None
        try:
            output = await self.stream.__anext__()
        except (StopAsyncIteration, EngineDead) as exc:  # abandoned under us, or the engine died
            choice = next(c for c in self.choices if c.finish_reason is None)
            return self._finish(choice, "error" if isinstance(exc, EngineDead) else "abort")
        choice = self.choices[output.index]
        if output.prompt_logprobs is not None and choice.prompt_logprobs is None:
            choice.prompt_logprobs = output.prompt_logprobs
        choice.token_ids += output.new_token_ids
        if output.new_text:
            choice.parts.append(output.new_text)
        if output.logprobs:
            choice.logprobs += output.logprobs
        if self.first_chunk_at is None and output.new_token_ids:
            self.first_chunk_at = time.monotonic()
        finish = None
        if output.finished:
            choice.final, finish = output, output.finish_reason.value
            if self.openai_reasons:
                finish = openai_finish_reason(finish, produced=bool(choice.token_ids))
            self._open -= 1
            choice.finish_reason = finish
        return Chunk(output.index, output.new_text, output.new_token_ids, output.logprobs, finish)

    def _finish(self, choice: Choice, reason: str) -> Chunk:
        choice.finish_reason = reason
        self._open -= 1
        return Chunk(choice.index, "", [], None, reason)

    def close(self) -> None:
        """Abandon the engine stream (an abort if still running) and log the summary, once."""
        if self._closed:
            return
        self._closed = True
        self.stream.abandon()
        if self.on_close is not None:
            self.on_close()
        reasons = sorted({c.finish_reason or "client_gone" for c in self.choices})
        log.info("request.summary", request_id=self.request_id, route=self.route, stream=self.body.stream,
                 n=len(self.choices), finish_reason=",".join(reasons), prompt_tokens=len(self.body.token_ids),
                 completion_tokens=self.completion_tokens, **self.timings())

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def timings(self) -> dict[str, float | None]:
        final = self.choices[0].final
        return {
            "queue_time": None if final is None else final.queue_time,
            "time_to_first_token": None if self.first_chunk_at is None else self.first_chunk_at - self.started,
            "e2e_latency": time.monotonic() - self.started,
        }

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.body.token_ids), self.completion_tokens
        if self.body.echo_only:  # issue 21: echo with max_tokens 0 answers the prompt alone
            completion = 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def meta_info(self) -> dict[str, Any]:
        choice = self.choices[0]
        final = choice.final
        return {"id": self.request_id, "finish_reason": choice.finish_reason, **self.usage(),
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
    return generation.done


class EventStream:
    """An ASGI response of server-sent events that aborts its request when the client leaves.

    The response starts with the first event: if the events fail before it with
    `GenerationFailed`, the answer is `on_failure`'s response (an HTTP error) instead.
    `headers` are added to the stream's (the request id)."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None], *,
                 on_failure: Callable[[GenerationFailed], Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.on_failure = on_failure
        self.extra_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no"), *self.extra_headers]
        refusal: Any = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
                try:
                    first: bytes | None = await self.events.__anext__()
                except StopAsyncIteration:
                    first = None
                except GenerationFailed as failed:
                    if self.on_failure is None:
                        raise
                    refusal = self.on_failure(failed)
                    tg.cancel_scope.cancel()
                if refusal is None:
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    if first is not None and not first.endswith(DONE):
                        await send({"type": "http.response.body", "body": first, "more_body": True})
                        first = None
                        async for event in self.events:
                            if event.endswith(DONE):  # the last event: sent with the end of the body
                                first = event
                                break
                            await send({"type": "http.response.body", "body": event, "more_body": True})
                    # NOTE: the last events, [DONE] and the end of the chunked body in one write
                    await send({"type": "http.response.body", "body": first or b"", "more_body": False})
                    tg.cancel_scope.cancel()
            if refusal is not None:  # nothing was sent yet: an HTTP error instead of a stream
                await refusal(scope, receive, send)
        except OSError:
            pass  # the client is gone; on_close aborts the request
        finally:
            self.on_close()
            with anyio.CancelScope(shield=True):
                await self.events.aclose()


_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps(..., separators=...) builds one per call
_json_str = json.encoder.encode_basestring_ascii  # the C encoder of a str, as json.dumps(str) writes it


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


async def generate_events(generation: Generation) -> AsyncGenerator[bytes, None]:
    """`/generate` stream: one event per output chunk, the last with meta_info, then [DONE] (with the
    last event, in one write).

    NOTE: a chunk that does not finish is written from a template, byte for byte what `sse_event` makes
    of `{"rid", "text", "token_ids", "finished": false}` (0.3 us against 2.3 us, once per token)."""
    head = b'data: {"rid":' + _json_str(generation.request_id).encode() + b',"text":'
    while (chunk := await generation.next()) is not None:
        if not chunk.finished:
            yield b"".join((head, _json_str(chunk.delta).encode(), b',"token_ids":[',
                            ",".join(map(str, chunk.new_token_ids)).encode(), b'],"finished":false}\n\n'))
            continue
        choice = generation.choices[0]
        event: dict[str, Any] = {"rid": generation.request_id, "text": chunk.delta, "token_ids": chunk.new_token_ids,
                                 "finished": True, "meta_info": generation.meta_info(), "output_text": choice.text,
                                 "output_ids": choice.token_ids}
        if generation.done:
            yield sse_event(event) + DONE
            return
        yield sse_event(event)
    yield DONE


def generate_json(generation: Generation) -> dict[str, Any]:
    choice = generation.choices[0]
    return {"rid": generation.request_id, "text": choice.text, "output_ids": choice.token_ids,
            "meta_info": generation.meta_info()}
