"""Tool calls in a model's own text format, read whole or as they stream (`--tool-call-parser`).

    parser = TOOL_PARSERS["hermes"]
    parsed = parser(text, final=True)      # content, and the calls

Each parser reads the whole output so far and returns the content (text
that is not a call) and the calls as far as they are written. While
streaming (`final=False`) the content stops before anything that may still
turn into a call marker, so successive results only grow: a stream sends
the differences (`engine.serve.chat_output`).

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks; the content is the text before the first one.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the output is ``{"name": ..., "parameters": {...}}``
  objects separated by ``;`` (after ``<|python_tag|>`` when it is decoded), or plain content.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``; the content is the text
  before the marker. ``[TOOL_CALLS]`` is a special token that decoding usually drops, so an output
  that is a JSON array of call objects is read as calls too.
- ``json_array`` (internal: `tool_choice` "required"): the output is a JSON array of call objects.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from engine.serve.json_scan import CallScan, scan_call, skip_ws


@attrs.define
class ParsedOutput:
    content: str
    calls: list[CallScan] = attrs.field(factory=list)


ToolParser = Callable[[str, bool], ParsedOutput]


def _settled(text: str, marker: str, final: bool) -> str:
    """`text` less any tail that may still grow into `marker` (all of it once final)."""
    if final:
        return text
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


def _calls_in_array(text: str, i: int) -> list[CallScan]:
    """The call objects of the JSON array starting at `i` (a '['), as far as written."""
    calls: list[CallScan] = []
    j = skip_ws(text, i + 1)
    while j < len(text) and text[j] != "]":
        call = scan_call(text, j)
        calls.append(call)
        if call.end is None or not call.valid:
            break
        j = skip_ws(text, call.end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
    return calls


def hermes(text: str, final: bool) -> ParsedOutput:
    start, end = "<tool_call>", "</tool_call>"
    first = text.find(start)
    if first < 0:
        return ParsedOutput(_settled(text, start, final))
    parsed = ParsedOutput(text[:first])
    at = first
    while at >= 0:
        call = scan_call(text, skip_ws(text, at + len(start)))
        parsed.calls.append(call)
        if call.end is None or not call.valid:
            break
        at = text.find(start, call.end)
        closing = text.find(end, call.end)
        if at >= 0 and closing < 0:
            break
    return parsed


def llama3_json(text: str, final: bool) -> ParsedOutput:
    tag = "<|python_tag|>"
    body = text[len(tag):] if text.startswith(tag) else text
    i = skip_ws(body, 0)
    if i >= len(body):
        return ParsedOutput(text if final else "")
    if body[i] != "{":
        return ParsedOutput(text)
    parsed = ParsedOutput("")
    while i < len(body):
        call = scan_call(body, i)
        parsed.calls.append(call)
        if call.end is None or not call.valid:
            break
        i = skip_ws(body, call.end)
        if i < len(body) and body[i] == ";":
            i = skip_ws(body, i + 1)
        elif i < len(body):
            break
    return parsed


def mistral(text: str, final: bool) -> ParsedOutput:
    marker = "[TOOL_CALLS]"
    at = text.find(marker)
    if at >= 0:
        i = skip_ws(text, at + len(marker))
        return ParsedOutput(text[:at], _calls_in_array(text, i) if text.startswith("[", i) else [])
    i = skip_ws(text, 0)
    if text.startswith("[{", i):  # the marker was a special token that decoding dropped
        return ParsedOutput("", _calls_in_array(text, i))
    if not final and text[i:] in ("", "["):  # may still become an array of calls
        return ParsedOutput("")
    return ParsedOutput(_settled(text, marker, final))


def json_array(text: str, final: bool) -> ParsedOutput:
    i = skip_ws(text, 0)
    return ParsedOutput("", _calls_in_array(text, i) if i < len(text) else [])


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}
