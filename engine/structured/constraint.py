"""`Constraint`: what a request's output must match, as `SamplingParams(constraint=...)`.

    SamplingParams(constraint=Constraint.json_schema({"type": "object", ...}))
    SamplingParams(constraint=Constraint.json_object())
    SamplingParams(constraint=Constraint.regex(r"[0-9]{3}-[0-9]{4}"))
    SamplingParams(constraint=Constraint.choice(["yes", "no"]))
    SamplingParams(constraint=Constraint.lark('start: "a"+ "b"'))

A constraint is plain data (frozen, validated at construction, no compiled
state): it travels with a request wherever the request goes, through
`attrs.asdict` and back (`SamplingParams(constraint={...})` converts a dict),
so a prefill server in another process samples the first token under the same
grammar. `key` is what compiled grammars are cached by.

- JSON is compact by default: no whitespace between tokens, so a model cannot
  loop on whitespace until `max_new_tokens`; `flexible_whitespace=True` allows
  it. Properties are generated in the schema's order.
- `starts_after`: the constraint applies only after this text has appeared
  in the output (a reasoning model's ``</think>``), from the next token on;
  before it the output is free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from states.validation import InvalidRequest, require

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
#: The most characters a constraint's text may have (a schema, a pattern, a grammar, all choices).
MAX_CONSTRAINT_CHARS = 1 << 18
#: The most strings a choice may list.
MAX_CHOICES = 4096
_FIELD = "SamplingParams.constraint"


def _value(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen
class Constraint:
    """A grammar the output must match; build it with the class methods (the fields are the
    wire form: `kind`, then `value`: the schema as JSON text, the pattern, the choices, the
    Lark grammar)."""

    kind: str
    value: str | tuple[str, ...] = attrs.field(default="", converter=_value)
    flexible_whitespace: bool = False
    starts_after: str | None = None

    def __attrs_post_init__(self) -> None:
        require(self.kind in KINDS, InvalidRequest, f"{_FIELD}.kind", f"one of {', '.join(KINDS)}", self.kind)
        if self.kind == "choice":
            require(isinstance(self.value, tuple) and 0 < len(self.value) <= MAX_CHOICES
                    and all(isinstance(c, str) and c for c in self.value), InvalidRequest, f"{_FIELD}.choice",
                    f"a list of 1 to {MAX_CHOICES} non-empty strings", self.value)
            size = sum(len(c) for c in self.value)
        else:
            require(isinstance(self.value, str), InvalidRequest, f"{_FIELD}.{self.kind}", "a string", self.value)
            require(self.kind == "json_object" or bool(self.value), InvalidRequest, f"{_FIELD}.{self.kind}",
                    "non-empty", self.value)
            size = len(self.value)
        require(size <= MAX_CONSTRAINT_CHARS, InvalidRequest, f"{_FIELD}.{self.kind}",
                f"at most {MAX_CONSTRAINT_CHARS} characters", f"{size} characters")
        require(isinstance(self.flexible_whitespace, bool), InvalidRequest, f"{_FIELD}.flexible_whitespace",
                "true or false", self.flexible_whitespace)
        require(self.starts_after is None or (isinstance(self.starts_after, str) and 0 < len(self.starts_after) <= 64),
                InvalidRequest, f"{_FIELD}.starts_after", "None or a string of 1 to 64 characters", self.starts_after)

    # ------------------------------------------------------------ builders
    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, *, flexible_whitespace: bool = False,
                    starts_after: str | None = None) -> Constraint:
        """Output that is JSON matching `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequest(f"{_FIELD}.json_schema", "a JSON object", f"unparsable JSON ({exc})") from None
        require(isinstance(schema, dict), InvalidRequest, f"{_FIELD}.json_schema", "a JSON object (a schema)",
                schema)
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"{_FIELD}.json_schema", "JSON-serializable", str(exc)) from None
        return cls("json_schema", text, flexible_whitespace, starts_after)

    @classmethod
    def json_object(cls, *, flexible_whitespace: bool = False, starts_after: str | None = None) -> Constraint:
        """Output that is any JSON object."""
        return cls("json_object", "", flexible_whitespace, starts_after)

    @classmethod
    def regex(cls, pattern: str, *, starts_after: str | None = None) -> Constraint:
        """Output that matches `pattern` whole (Rust `regex` syntax, as llguidance reads it)."""
        return cls("regex", pattern, starts_after=starts_after)

    @classmethod
    def choice(cls, options: Sequence[str], *, starts_after: str | None = None) -> Constraint:
        """Output that is exactly one of `options`."""
        require(isinstance(options, (list, tuple)), InvalidRequest, f"{_FIELD}.choice", "a list of strings", options)
        return cls("choice", tuple(options), starts_after=starts_after)

    @classmethod
    def lark(cls, grammar: str, *, starts_after: str | None = None) -> Constraint:
        """Output that the Lark grammar accepts (llguidance's Lark dialect)."""
        return cls("lark", grammar, starts_after=starts_after)

    # ------------------------------------------------------------ reading
    @property
    def key(self) -> tuple[str, str | tuple[str, ...], bool]:
        """What a compiled grammar is cached by (`starts_after` is not part of the grammar)."""
        return (self.kind, self.value, self.flexible_whitespace)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a json_schema constraint (None for the other kinds)."""
        return json.loads(self.value) if self.kind == "json_schema" and isinstance(self.value, str) else None

    def describe(self) -> str:
        """A short label for logs: the kind and the start of the value."""
        shown = self.value if isinstance(self.value, str) else json.dumps(list(self.value))
        return f"{self.kind}:{shown[:60]}"


def constraint_from(value: Any) -> Any:
    """`SamplingParams.constraint`'s converter: a dict (the wire form, `attrs.asdict`) becomes a
    Constraint; anything else is left for the validator to name."""
    if not isinstance(value, dict):
        return value
    try:
        return Constraint(**value)
    except TypeError as exc:
        raise InvalidRequest(_FIELD, "a Constraint or its fields (kind, value, flexible_whitespace, starts_after)",
                             str(exc)) from None
