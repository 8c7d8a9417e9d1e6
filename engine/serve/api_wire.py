"""The wire between the API process and the engine's process (`kvlife serve --api-process`).

One local stream socket carries length-prefixed frames, each one pickled list of messages (both ends
are this package, on one machine, started together: nothing else can dial the socket, which lives in
a private directory). The API process sends:

    ("submit", key, token_ids, params, request_id, priority, deadline, session, resume_output_ids)
    ("abandon", key)                              # the client left: the engine aborts the request

and the engine's side answers with, for each key:

    ("accepted", key, error)    # error None: the engine holds the request; else why it was refused
    ("ready", key, error)       # a constrained request: its grammar compiled (None) or not
    ("out", key, output)        # one RequestOutput, as `pack_output` made it
    ("end", key, error)         # no more outputs; error: what ended the stream instead (EngineDead)

The engine's side writes what every request produced since its last write in one frame, so a decode
step costs the engine one write for its whole batch, not one per request and token.

Errors cross as (kind, message, field, limit) and come back as the engine's own classes
(`engine.errors`), which is what the HTTP routes map to statuses.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, TypeAlias

from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from engine.errors import EngineClosed, EngineDead, EngineOverloaded, InvalidRequest
from engine.outputs import RequestOutput

__all__ = ["FrameReader", "Message", "OutputViews", "PackedError", "pack_error", "pack_output", "send_frame",
           "unpack_error"]

#: one message: its kind, the request's key, then the kind's values (module docstring)
Message: TypeAlias = tuple[Any, ...]
#: an error as plain values: kind, message, field, limit
PackedError: TypeAlias = tuple[str, str, str | None, str | None]

_HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30  # a corrupt length is refused rather than allocated


async def send_frame(stream: ByteStream, messages: list[Message]) -> None:
    body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    await stream.send(_HEADER.pack(len(body)) + body)


class FrameReader:
    """The frames of one stream, in order; `receive` raises anyio.EndOfStream (or IncompleteRead) at
    the end."""

    def __init__(self, stream: ByteStream) -> None:
        self._buffered = BufferedByteReceiveStream(stream)

    async def receive(self) -> list[Message]:
        (size,) = _HEADER.unpack(await self._buffered.receive_exactly(_HEADER.size))
        if size > MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes is over the wire's bound ({MAX_FRAME})")
        messages: list[Message] = pickle.loads(await self._buffered.receive_exactly(size))
        return messages


def pack_output(output: RequestOutput) -> Message:
    """The fields a client reads (not the whole-output views: the API process keeps its own)."""
    return (output.request_id, output.new_token_ids, output.new_text, output.index, output.logprobs,
            output.prompt_logprobs, output.finished, output.finish_reason, output.num_prompt_tokens,
            output.num_cached_tokens, output.queue_time, output.time_to_first_token, output.completion_time,
            output.error, output.speculation)


class OutputViews:
    """The API process's side of `pack_output`: each sequence's whole output so far, kept here, so
    `RequestOutput.token_ids` and `.text` read as they do in the engine's process."""

    def __init__(self) -> None:
        self._ids: dict[int, list[int]] = {}
        self._parts: dict[int, list[str]] = {}

    def unpack(self, packed: Message) -> RequestOutput:
        (request_id, new_ids, new_text, index, logprobs, prompt_logprobs, finished, finish_reason,
         num_prompt, num_cached, queue_time, ttft, completion_time, error, speculation) = packed
        ids = self._ids.setdefault(index, [])
        ids += new_ids
        parts = self._parts.setdefault(index, [])
        if new_text:
            parts.append(new_text)
        return RequestOutput(request_id, new_ids, all_ids=ids, num_ids=len(ids), new_text=new_text,
                             text_parts=parts, num_parts=len(parts), index=index, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, finished=finished, finish_reason=finish_reason,
                             num_prompt_tokens=num_prompt, num_cached_tokens=num_cached, queue_time=queue_time,
                             time_to_first_token=ttft, completion_time=completion_time, error=error,
                             speculation=speculation)


_KINDS: dict[str, type[Exception]] = {"InvalidRequest": InvalidRequest, "EngineOverloaded": EngineOverloaded,
                                      "EngineClosed": EngineClosed, "EngineDead": EngineDead}


def pack_error(exc: BaseException | None) -> PackedError | None:
    """An error as plain values; kinds the routes do not tell apart cross as a dead engine."""
    if exc is None:
        return None
    if isinstance(exc, InvalidRequest):
        return "InvalidRequest", str(exc), exc.field, exc.limit
    for kind in ("EngineOverloaded", "EngineClosed", "EngineDead"):
        if isinstance(exc, _KINDS[kind]):
            return kind, str(exc), None, None
    return "EngineDead", f"the engine's side failed: {exc!r}", None, None


def unpack_error(packed: PackedError | None) -> Exception | None:
    if packed is None:
        return None
    kind, message, field, limit = packed
    if kind == "InvalidRequest":
        error = InvalidRequest.__new__(InvalidRequest)
        Exception.__init__(error, message)
        error.field, error.limit, error.value = field or "request", limit or "valid", None
        return error
    if kind == "EngineDead":
        dead = EngineDead(RuntimeError(message))
        dead.args = (message,)
        return dead
    return _KINDS[kind](message)
