"""OpenAI's answers for a `Generation`: text completions and chat completions, whole or streamed,
with `n` choices and logprobs.

    events = completion_events(generation, model)     # SSE bytes, "data: [DONE]" last
    body = chat_json(generation, model)               # a chat.completion object

Streams follow OpenAI's chunk format, one choice per chunk (its `index`
says which of the n): completions send ``text`` deltas; chat sends, for
each choice, a first chunk with ``delta.role = "assistant"``, then
``delta.content`` deltas, and the finish reason on the choice's last chunk;
with a reasoning parser or tools, ``delta.reasoning_content`` and
``delta.tool_calls`` too (`engine.serve.chat_output`).
With ``stream_options.include_usage`` every chunk carries ``"usage": null``
and a last chunk with no choices carries the usage (all n choices), before
``[DONE]``.

A stream starts with the request's first token: a request that fails before
it raises `GenerationFailed` before any event (the route answers an HTTP
error); one that fails after it ends with an error event (`engine.serve.failures`).

Logprobs are the engine's (`RequestOutput.logprobs`, from the logits the
sampler used), formatted by `engine.serve.logprob_format`: completions use
the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs`` as
``{token: logprob}``, ``text_offset``); chat uses ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from engine.serve.failures import GenerationFailed, is_failure
from engine.serve.chat_output import ChatChoices
from engine.serve.generation import DONE, Chunk, Generation, sse_event
from engine.serve.logprob_format import CompletionLogprobs, chat_logprobs
from engine.serve.prompt_format import echo_choice, prompt_logprobs_json, prompt_text, stream_choice


def _wants_logprobs(generation: Generation) -> bool:
    return generation.body.params.logprobs is not None


def _head(generation: Generation, model: str, kind: str) -> dict[str, Any]:
    return {"id": generation.request_id, "object": kind, "created": generation.created, "model": model}


async def _started(generation: Generation) -> list[Chunk]:
    """The chunks up to the first that carries a token or ends a choice; `GenerationFailed` if a
    choice fails first (nothing was sent yet, so the route can still answer an HTTP error)."""
    held: list[Chunk] = []
    while (chunk := await generation.next()) is not None:
        if is_failure(chunk.finish_reason):
            raise GenerationFailed(chunk.finish_reason or "error")
        held.append(chunk)
        if chunk.new_token_ids or chunk.finished:
            break
    return held


async def _events(generation: Generation, head: dict[str, Any], choice: Callable[[Chunk], dict | list[dict]],
                  first: Callable[[int], dict] | None) -> AsyncGenerator[bytes, None]:
    usage_field = {"usage": None} if generation.body.include_usage else {}
    held = deque(await _started(generation))
    tail: list[bytes] = []
    if first is not None:
        for index in range(len(generation.choices)):
            yield sse_event(head | {"choices": [first(index)]} | usage_field)
    while (chunk := held.popleft() if held else await generation.next()) is not None:
        if is_failure(chunk.finish_reason):  # after the first token: an error event the SDK raises on
            yield sse_event(GenerationFailed(chunk.finish_reason or "error").body())
            yield DONE
            return
        events = []
        if chunk.delta or chunk.finished or chunk.logprobs:
            made = choice(chunk)  # NOTE: a list when the text is read (reasoning, tool calls): maybe none yet
            events = [sse_event(head | {"choices": [one]} | usage_field)
                      for one in (made if isinstance(made, list) else [made])]
        if generation.done and not held:  # the last chunk: its events, usage and [DONE] in one write
            tail = events
            break
        for event in events:
            yield event
    if generation.body.include_usage:
        tail.append(sse_event(head | {"choices": [], "usage": generation.usage()}))
    yield b"".join([*tail, DONE])


def completion_events(generation: Generation, model: str) -> AsyncGenerator[bytes, None]:
    """`/v1/completions` as server-sent events."""
    logprobs = CompletionLogprobs(generation.tokenizer) if _wants_logprobs(generation) else None
    started: set[int] = set()

    def choice(chunk: Chunk) -> dict[str, Any]:
        first = chunk.index not in started  # issue 21: the prompt's parts go on a choice's first chunk
        started.add(chunk.index)
        if first and generation.body.echo and logprobs is not None:
            logprobs.start(chunk.index, prompt_text(generation))
        entry = {"index": chunk.index, "text": chunk.delta,
                 "logprobs": None if logprobs is None else logprobs(chunk.index, chunk.logprobs or (), chunk.delta),
                 "finish_reason": chunk.finish_reason}
        return stream_choice(generation, chunk, entry, first=first)

    return _events(generation, _head(generation, model, "text_completion"), choice, None)


def completion_json(generation: Generation, model: str) -> dict[str, Any]:
    logprobs = CompletionLogprobs(generation.tokenizer) if _wants_logprobs(generation) else None
    choices: list[dict[str, Any]] = [
        {"index": c.index, "text": c.text, "logprobs": None if logprobs is None else logprobs(c.index, c.logprobs, c.text),
         "finish_reason": c.finish_reason} for c in generation.choices]
    for c, entry in zip(generation.choices, choices):  # issue 21: echo and prompt logprobs
        if generation.body.echo:
            echo_choice(generation, c, entry)
        if generation.body.params.prompt_logprobs is not None:
            entry["prompt_logprobs"] = prompt_logprobs_json(generation.tokenizer, c.prompt_logprobs)
    return _head(generation, model, "text_completion") | {"choices": choices, "usage": generation.usage()}


def chat_events(generation: Generation, model: str) -> AsyncGenerator[bytes, None]:
    """`/v1/chat/completions` as server-sent events."""
    tokenizer, wanted = generation.tokenizer, _wants_logprobs(generation)

    def first(index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    reader = ChatChoices(generation.body.chat) if generation.body.chat is not None else None

    def choice(chunk: Chunk) -> dict[str, Any] | list[dict[str, Any]]:
        logprobs = chat_logprobs(tokenizer, chunk.logprobs or ()) if wanted else None
        if reader is not None:
            return reader.chunk(chunk.index, chunk.delta, chunk.finish_reason, logprobs)
        return {"index": chunk.index, "delta": {"content": chunk.delta} if chunk.delta else {},
                "logprobs": logprobs, "finish_reason": chunk.finish_reason}

    return _events(generation, _head(generation, model, "chat.completion.chunk"), choice, first)


def chat_json(generation: Generation, model: str) -> dict[str, Any]:
    tokenizer, wanted = generation.tokenizer, _wants_logprobs(generation)
    reader = ChatChoices(generation.body.chat) if generation.body.chat is not None else None
    choices = []
    for c in generation.choices:
        message, finish = (reader.whole(c.index, c.text, c.finish_reason) if reader is not None
                           else ({"role": "assistant", "content": c.text}, c.finish_reason))
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(tokenizer, c.logprobs) if wanted else None,
                        "finish_reason": finish})
    answer = _head(generation, model, "chat.completion") | {"choices": choices, "usage": generation.usage()}
    if generation.body.params.prompt_logprobs is not None:  # issue 21: vLLM puts them at the top
        answer["prompt_logprobs"] = prompt_logprobs_json(tokenizer, generation.choices[0].prompt_logprobs)
    return answer
