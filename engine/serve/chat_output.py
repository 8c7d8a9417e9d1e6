"""A chat answer's text as OpenAI's message: thinking in ``reasoning_content``, tool calls in
``tool_calls``, the rest in ``content``; whole, or as streamed deltas.

    spec = ChatOutputSpec(reasoning="reasoning", tools=tool_request)
    out = spec.choice()
    deltas = out.feed(new_text) ... out.feed("", final=True)   # each a chunk's `delta`
    message = spec.choice().message(whole_text)

The text first goes through the reasoning splitter (`engine.serve.reasoning`),
then, when tools may be called, through the tool-call reading of the
request's mode: ``auto`` reads the model's own format with the server's
parser (`engine.serve.tool_parsers`), ``required`` reads the JSON array its
grammar produced, a named function takes the whole answer as its arguments.
A stream sends the name of a call once it is complete and its arguments as
they are written (the pieces concatenate to the final ``arguments``); a
call that turns out malformed in a whole answer leaves the text as content.
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs

from engine.serve.json_scan import CallScan, arguments_json
from engine.serve.reasoning import ReasoningSplitter
from engine.serve.tool_parsers import TOOL_PARSERS, ParsedOutput, json_array
from engine.serve.tools import ToolRequest


@attrs.frozen
class ChatOutputSpec:
    """How one request's answers are read: the reasoning split's starting state (None: no
    reasoning parser) and the tools (None: no call can be made)."""

    reasoning: str | None = None
    tools: ToolRequest | None = None

    def choice(self) -> ChoiceOutput:
        return ChoiceOutput(self, uuid.uuid4().hex[:20])

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason


class ChoiceOutput:
    """One choice's text, read as it grows."""

    def __init__(self, spec: ChatOutputSpec, call_prefix: str) -> None:
        self.spec = spec
        self.call_prefix = call_prefix
        self.splitter = ReasoningSplitter(spec.reasoning) if spec.reasoning is not None else None
        tools = spec.tools
        self.mode = None if tools is None or tools.choice == "none" else tools.choice
        self._text = ""
        self._sent_content = ""
        self._sent_args: dict[int, int] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self._sent_args)

    def _parse(self, text: str, final: bool) -> ParsedOutput:
        tools = self.spec.tools
        assert tools is not None
        if self.mode == "named":
            return ParsedOutput("", [CallScan(0, name=tools.named, arguments=text, arguments_started=bool(text),
                                              arguments_done=final, end=len(text) if final else None)])
        if self.mode == "required":
            return json_array(text, final)
        return TOOL_PARSERS[tools.parser or "hermes"](text, final)

    # ------------------------------------------------------------ streaming
    def feed(self, delta: str, *, final: bool = False) -> list[dict[str, Any]]:
        """The deltas `delta` settles (the last call with `final=True` flushes what was held)."""
        thinking, content = self.splitter.feed(delta, final=final) if self.splitter else ("", delta)
        deltas: list[dict[str, Any]] = []
        if thinking:
            deltas.append({"reasoning_content": thinking})
        if self.mode is None:
            if content:
                deltas.append({"content": content})
            return deltas
        self._text += content
        parsed = self._parse(self._text, final)
        if parsed.content.startswith(self._sent_content) and len(parsed.content) > len(self._sent_content):
            deltas.append({"content": parsed.content[len(self._sent_content):]})
            self._sent_content = parsed.content
        for index, call in enumerate(parsed.calls):
            if not call.valid or call.name is None:
                break
            if index not in self._sent_args:
                deltas.append({"tool_calls": [{"index": index, "id": self._call_id(index), "type": "function",
                                               "function": {"name": call.name, "arguments": call.arguments}}]})
                self._sent_args[index] = len(call.arguments)
            elif len(call.arguments) > self._sent_args[index]:
                piece = call.arguments[self._sent_args[index]:]
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                self._sent_args[index] = len(call.arguments)
        return deltas

    # ------------------------------------------------------------ whole
    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as a message (role, content, reasoning_content, tool_calls)."""
        thinking, content = self.splitter.feed(text, final=True) if self.splitter else ("", text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.splitter is not None:
            message["reasoning_content"] = thinking or None
        if self.mode is None:
            return message
        parsed = self._parse(content, True)
        calls = [(c.name, arguments_json(c)) for c in parsed.calls if c.complete]
        if not calls or any(arguments is None for _, arguments in calls) or \
                (self.mode == "auto" and len(calls) != len(parsed.calls)):
            return message  # not (all) well-formed calls: the text stays content
        message["content"] = parsed.content or None
        message["tool_calls"] = [{"id": self._call_id(i), "type": "function",
                                  "function": {"name": name, "arguments": arguments}}
                                 for i, (name, arguments) in enumerate(calls)]
        self._sent_args = {i: 0 for i in range(len(calls))}
        return message

    def _call_id(self, index: int) -> str:
        return f"call_{self.call_prefix}_{index}"


class ChatChoices:
    """Every choice of one answer, by index: the choice objects of a stream's chunks, or whole."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        self.spec = spec
        self._outputs: dict[int, ChoiceOutput] = {}

    def _output(self, index: int) -> ChoiceOutput:
        if index not in self._outputs:
            self._outputs[index] = self.spec.choice()
        return self._outputs[index]

    def chunk(self, index: int, delta: str, finish_reason: str | None, logprobs: Any) -> list[dict[str, Any]]:
        """The chunk choices one engine chunk gives (none while text is held back); the finish
        reason (``tool_calls`` when calls were made) rides on the last."""
        out = self._output(index)
        choices: list[dict[str, Any]] = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
                                         for d in out.feed(delta, final=finish_reason is not None)]
        if not choices and (finish_reason is not None or logprobs is not None):
            choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
        if choices:
            choices[0]["logprobs"] = logprobs
            choices[-1]["finish_reason"] = self.spec.finish_reason(finish_reason, out.has_calls)
        return choices

    def whole(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(message, finish reason) of a whole answer."""
        message = self._output(index).message(text)
        return message, self.spec.finish_reason(finish_reason, "tool_calls" in message)
