"""Reading JSON as it streams: where a value ends (or that it has not yet), and tool-call objects.

The tool-call parsers read model output that grows a token at a time, so
they need to know, of a possibly unfinished text, how far each JSON value
reaches. `value_end` answers that without parsing; `scan_call` reads one
``{"name": ..., "arguments": {...}}`` object as far as it is written, so a
stream can send the name once it is complete and the arguments' raw text as
it grows (the pieces concatenate to exactly the model's text of the value).
"""

from __future__ import annotations

import json

import attrs

WHITESPACE = " \t\r\n"
_DELIMITERS = WHITESPACE + ",]}:"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at `i` (a quote), or None if unfinished."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at `i`, or None if the text ends inside it."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _DELIMITERS:
        j += 1
    return j if j < len(text) else None  # a scalar at the very end may still grow


@attrs.define
class CallScan:
    """One tool-call object as far as it is written: its name once complete, the arguments' raw
    text so far (all of it once `arguments_done`), and where the object ends."""

    start: int
    name: str | None = None
    arguments: str = ""
    arguments_started: bool = False
    arguments_done: bool = False
    end: int | None = None
    #: False once the text cannot be a call object (not an object, a name that is not a string)
    valid: bool = True

    @property
    def complete(self) -> bool:
        return self.end is not None and self.valid and self.name is not None and self.arguments_done


def scan_call(text: str, i: int, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallScan:
    """Read the call object starting at `i` (after whitespace) as far as `text` goes."""
    scan = CallScan(start=i)
    if i >= len(text):
        return scan
    if text[i] != "{":
        scan.valid = False
        return scan
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            if not scan.arguments_started:  # a call without arguments takes none
                scan.arguments, scan.arguments_started, scan.arguments_done = "{}", True, True
            return scan
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            if j >= len(text):
                return scan
        if text[j] != '"':
            scan.valid = False
            return scan
        key_end = string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            scan.valid = False
            return scan
        start = skip_ws(text, j + 1)
        end = value_end(text, start)
        if key in argument_keys:
            scan.arguments_started = start < len(text)
            scan.arguments = text[start:len(text) if end is None else end]
            scan.arguments_done = end is not None
        elif key == "name" and end is not None:
            try:
                name = json.loads(text[start:end])
            except ValueError:
                name = None
            if not isinstance(name, str):
                scan.valid = False
                return scan
            scan.name = name
        if end is None:
            return scan
        j = end


def arguments_json(scan: CallScan) -> str | None:
    """The arguments as a JSON object's text, if they are one (None otherwise)."""
    text = scan.arguments if scan.arguments_started else "{}"
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return text if isinstance(value, dict) else None
