"""Tool calling over /v1/chat/completions: the `tools` a request offers, its `tool_choice`, and the
tool turns of its conversation.

    tools = parse_tools(body, parser="hermes")     # None without tools (or tool_choice "none")
    constraint = tools.constraint()                # "required" or a named function, else None

- ``tools``: ``[{"type": "function", "function": {"name", "description", "parameters",
  "strict"}}]`` (1 to 128; names of letters, digits, ``_`` and ``-``); they are passed to the
  chat template as ``tools``.
- ``tool_choice``: ``"none"`` (no call), ``"auto"`` (default with tools; the model decides and
  the server's ``--tool-call-parser`` reads its format), ``"required"`` (one call or more, the
  output constrained to a JSON array of ``{"name", "arguments"}`` objects built from every
  tool's parameter schema; ``parallel_tool_calls: false`` makes it exactly one), or
  ``{"type": "function", "function": {"name": ...}}`` (that function; the output is its
  arguments, constrained by its parameter schema).
- Messages: an assistant message may carry ``tool_calls`` (its ``content`` may be null); a
  ``tool`` message carries ``tool_call_id`` and the result as ``content``. The template sees
  each call's ``arguments`` as an object (as transformers' templates expect) when it is JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from engine.errors import InvalidRequest
from engine.structured import Constraint

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_LIMIT = "a name of 1 to 64 letters, digits, '_' or '-'"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@attrs.frozen
class Tool:
    name: str
    parameters: dict[str, Any]


@attrs.frozen
class ToolRequest:
    """What a request asked of tools: `choice` is "auto", "required" or "named" (`named` says which)."""

    tools: tuple[Tool, ...]
    choice: str
    named: str | None
    parallel: bool
    #: the tools as given, for the chat template
    template_tools: list[dict[str, Any]]
    #: the `--tool-call-parser` reading "auto" output (None for "required" and "named")
    parser: str | None = None

    def constraint(self, *, starts_after: str | None = None) -> Constraint | None:
        """The grammar of "required" and "named"; None for "auto"."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return Constraint.json_schema(tool.parameters, starts_after=starts_after)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return Constraint.json_schema(schema, starts_after=starts_after)


def _tool(value: Any, field: str) -> tuple[Tool, dict[str, Any]]:
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise InvalidRequest(field, "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}", value)
    unknown = sorted(set(value) - {"type", "function"})
    if unknown:
        raise InvalidRequest(f"{field}.{unknown[0]}", "a known field (type, function)", unknown[0])
    function = value["function"]
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequest(f"{field}.function.{unknown[0]}", "a known field (name, description, parameters, strict)",
                             unknown[0])
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(f"{field}.function.name", _NAME_LIMIT, name)
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise InvalidRequest(f"{field}.function.description", "a string", function["description"])
    parameters = function.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{field}.function.parameters", "a JSON schema object", parameters)
    if function.get("strict") not in (None, True, False):
        raise InvalidRequest(f"{field}.function.strict", "true, false or absent", function["strict"])
    return Tool(name, parameters), value


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name not in names:
            raise InvalidRequest("tool_choice.function.name", f"one of the tools' names ({', '.join(sorted(names))})",
                                 name)
        return "named", name
    raise InvalidRequest("tool_choice", "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                         value)


def parse_tools(body: dict[str, Any], parser: str | None) -> ToolRequest | None:
    """The request's tools and choice; None when no tool may be called."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise InvalidRequest(legacy, "absent (the legacy function-calling fields: use tools and tool_choice)",
                                 body[legacy])
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls", "true or false", parallel)
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice", "'none' or absent when no tools are given", choice)
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest("tools", f"a list of 1 to {MAX_TOOLS} tools", tools)
    parsed = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [t.name for t, _ in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools", "tools with distinct names", names)
    kind, named = _choice("auto" if choice is None else choice, set(names))
    if kind == "none":
        return ToolRequest(tuple(t for t, _ in parsed), "none", None, parallel, [raw for _, raw in parsed])
    if kind == "auto" and parser is None:
        raise InvalidRequest("tool_choice", "'none', 'required' or a named function: 'auto' (the default with "
                             "tools) needs the server started with --tool-call-parser", "auto")
    return ToolRequest(tuple(t for t, _ in parsed), kind, named, parallel, [raw for _, raw in parsed],
                       parser if kind == "auto" else None)


# ---------------------------------------------------------------- messages
def _call(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("function"), dict):
        raise InvalidRequest(field, "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}",
                             value)
    function = value["function"]
    if not isinstance(function.get("name"), str):
        raise InvalidRequest(f"{field}.function.name", "a string", function.get("name"))
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise InvalidRequest(f"{field}.function.arguments", "a string of JSON (as OpenAI sends it)", arguments)
    try:
        shown: Any = json.loads(arguments)
    except ValueError:
        shown = arguments
    call = {"type": "function", "function": {"name": function["name"], "arguments": shown}}
    if value.get("id") is not None:
        if not isinstance(value["id"], str):
            raise InvalidRequest(f"{field}.id", "a string", value["id"])
        call["id"] = value["id"]
    return call


def tool_message_fields(message: dict[str, Any], field: str) -> dict[str, Any]:
    """The tool parts of one message as the template sees them (`tool_calls`, `tool_call_id`),
    validated; {} for a message without any."""
    role = message.get("role")
    extra: dict[str, Any] = {}
    if message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if role != "assistant":
            raise InvalidRequest(f"{field}.tool_calls", "only on assistant messages", role)
        if not isinstance(calls, list):
            raise InvalidRequest(f"{field}.tool_calls", "a list of tool calls", calls)
        extra["tool_calls"] = [_call(c, f"{field}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequest(f"{field}.tool_call_id", "the id of the call this message answers", call_id)
        extra["tool_call_id"] = call_id
    elif "tool_call_id" in message:
        raise InvalidRequest(f"{field}.tool_call_id", "only on tool messages", role)
    return extra
