"""OpenAI's answers for a `Generation`: text completions and chat completions, whole or streamed.

    events = completion_events(generation, model)     # SSE bytes, "data: [DONE]" last
    body = chat_json(generation, model)               # a chat.completion object

Streams follow OpenAI's chunk format: completions send ``choices[0].text``
deltas; chat sends a first chunk with ``delta.role = "assistant"``, then
``delta.content`` deltas, and the finish reason on the last choice. With
``stream_options.include_usage`` every chunk carries ``"usage": null`` and
a last chunk with no choices carries the usage, before ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.serve.generation import DONE, Chunk, Generation, sse_event


def _completion_choice(chunk_text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": chunk_text, "logprobs": None, "finish_reason": finish_reason}


def _chat_delta(chunk_text: str, finish_reason: str | None) -> dict[str, Any]:
    delta = {"content": chunk_text} if chunk_text else {}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _head(generation: Generation, model: str, kind: str) -> dict[str, Any]:
    return {"id": generation.request_id, "object": kind, "created": generation.created, "model": model}


async def _events(generation: Generation, head: dict[str, Any], choice: Callable[[str, str | None], dict],
                  first: dict[str, Any] | None) -> AsyncIterator[bytes]:
    include_usage = generation.body.include_usage
    usage_field = {"usage": None} if include_usage else {}
    if first is not None:
        yield sse_event(head | {"choices": [first]} | usage_field)
    chunk: Chunk | None
    while (chunk := await generation.next()) is not None:
        if chunk.delta or chunk.finished:
            yield sse_event(head | {"choices": [choice(chunk.delta, chunk.finish_reason)]} | usage_field)
    if include_usage:
        yield sse_event(head | {"choices": [], "usage": generation.usage()})
    yield DONE


def completion_events(generation: Generation, model: str) -> AsyncIterator[bytes]:
    """`/v1/completions` as server-sent events."""
    return _events(generation, _head(generation, model, "text_completion"), _completion_choice, None)


def completion_json(generation: Generation, model: str) -> dict[str, Any]:
    return _head(generation, model, "text_completion") | {
        "choices": [_completion_choice(generation.text, generation.finish_reason)], "usage": generation.usage()}


def chat_events(generation: Generation, model: str) -> AsyncIterator[bytes]:
    """`/v1/chat/completions` as server-sent events."""
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return _events(generation, _head(generation, model, "chat.completion.chunk"), _chat_delta, first)


def chat_json(generation: Generation, model: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": generation.text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": generation.finish_reason}
    return _head(generation, model, "chat.completion") | {"choices": [choice], "usage": generation.usage()}
