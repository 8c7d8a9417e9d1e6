"""A request's constraint, as OpenAI, vLLM and SGLang clients send it.

    constraint, field = chat_constraint(body)          # /v1/chat/completions, /v1/completions
    constraint, field = generate_constraint(sampling)  # /generate's sampling_params

`field` is the body field the constraint came from, so an error about it
(an invalid schema, a compile that fails or times out) names that field.

- OpenAI: ``response_format`` ``{"type": "text"}`` (none), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` (the schema is always enforced, `strict` or not).
- vLLM: ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``
  (with ``disable_any_whitespace``), and the older ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` (``guided_decoding_backend`` is accepted and
  ignored). A grammar is llguidance's Lark, or GBNF (``::=`` rules), which is converted.
- SGLang (``/generate``): ``sampling_params.json_schema`` (JSON text), ``regex``, ``ebnf``.

JSON is compact unless a vLLM client asks for whitespace
(``"disable_any_whitespace": false``).
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequest
from engine.structured import Constraint

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
#: body fields of /v1/chat/completions and /v1/completions this module reads
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED, "guided_decoding_backend",
                               "guided_whitespace_pattern"})
GENERATE_FIELDS = frozenset({"json_schema", "regex", "ebnf"})
_SCHEMA_NAME = "a name of 1 to 64 letters, digits, '_' or '-'"


def _grammar(text: Any, field: str) -> Constraint:
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(field, "a grammar (llguidance Lark, or GBNF)", text)
    if "::=" in text:
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark
        except ImportError:
            raise InvalidRequest(field, "a Lark grammar (GBNF needs llguidance installed)", text[:60]) from None
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - the converter raises its own and plain errors
            raise InvalidRequest(field, f"a valid GBNF grammar ({exc})", text[:60]) from None
    return Constraint.lark(text)


def _schema(value: Any, field: str, *, flexible: bool = False) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequest(field, "a JSON schema (an object, or its JSON text)", value) from None
    if not isinstance(value, dict):
        raise InvalidRequest(field, "a JSON schema (an object, or its JSON text)", value)
    return Constraint.json_schema(value, flexible_whitespace=flexible)


def _response_format(value: Any) -> Constraint | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest(field, "an object with a type ('text', 'json_object' or 'json_schema')", value)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise InvalidRequest(f"{field}.type", "'text', 'json_object' or 'json_schema'", kind)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{field}.json_schema", "an object with name and schema", spec)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise InvalidRequest(f"{field}.json_schema.{unknown[0]}", "a known field (name, schema, strict, description)",
                             unknown[0])
    name = spec.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= 64 and all(c.isalnum() or c in "_-" for c in name)):
        raise InvalidRequest(f"{field}.json_schema.name", _SCHEMA_NAME, name)
    if spec.get("strict") not in (None, True, False):
        raise InvalidRequest(f"{field}.json_schema.strict", "true, false or absent", spec["strict"])
    if "schema" not in spec:
        return Constraint.json_object()
    return _schema(spec["schema"], f"{field}.json_schema.schema")


def _structured_outputs(value: Any) -> Constraint:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequest(field, "an object with one of json, regex, choice, grammar, json_object", value)
    known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequest(f"{field}.{unknown[0]}", f"one of {', '.join(sorted(known))} (not supported here)",
                             unknown[0])
    given = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if value.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise InvalidRequest(field, "exactly one of json, regex, choice, grammar, json_object", sorted(given))
    spaces = value.get("disable_any_whitespace")
    if spaces not in (None, True, False):
        raise InvalidRequest(f"{field}.disable_any_whitespace", "true or false", spaces)
    flexible = spaces is False
    kind = given[0]
    if kind == "json":
        return _schema(value["json"], f"{field}.json", flexible=flexible)
    if kind == "json_object":
        return Constraint.json_object(flexible_whitespace=flexible)
    return _simple(kind, value[kind], f"{field}.{kind}")


def _simple(kind: str, value: Any, field: str) -> Constraint:
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidRequest(field, "a non-empty regex", value)
        return Constraint.regex(value)
    if kind == "choice":
        if not isinstance(value, list):
            raise InvalidRequest(field, "a list of strings", value)
        try:
            return Constraint.choice(value)
        except InvalidRequest as exc:
            raise InvalidRequest(field, exc.limit, value) from None
    return _grammar(value, field)


def renamed(exc: InvalidRequest, field: str) -> InvalidRequest:
    """`exc` about the engine's `SamplingParams.constraint...` reworded to name the body's `field`."""
    if not exc.field.startswith("SamplingParams.constraint"):
        return exc
    return InvalidRequest(field, exc.limit, exc.value)


def chat_constraint(body: dict[str, Any]) -> tuple[Constraint | None, str | None]:
    """The constraint of a chat or completions body, and the field it came from (or None, None)."""
    try:
        return _chat_constraint(body)
    except InvalidRequest as exc:
        raise renamed(exc, next((f for f in CONSTRAINT_FIELDS if body.get(f) is not None), "response_format")) \
            from None


def _chat_constraint(body: dict[str, Any]) -> tuple[Constraint | None, str | None]:
    found: list[tuple[Constraint, str]] = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append((constraint, "response_format"))
    if body.get("structured_outputs") is not None:
        constraint = _structured_outputs(body["structured_outputs"])
        kind = {"json_schema": "json", "lark": "grammar"}.get(constraint.kind, constraint.kind)
        found.append((constraint, f"structured_outputs.{kind}"))
    for name in GUIDED:
        if body.get(name) is not None:
            kind = name.removeprefix("guided_")
            found.append((_schema(body[name], name) if kind == "json" else _simple(kind, body[name], name), name))
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidRequest("guided_whitespace_pattern", "absent (JSON is compact; flexible whitespace: "
                             "structured_outputs.disable_any_whitespace = false)", body["guided_whitespace_pattern"])
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise InvalidRequest("guided_decoding_backend", "a string (ignored: llguidance is the backend)", backend)
    if len(found) > 1:
        second = found[1][1].split(".")[0]
        raise InvalidRequest(second, f"absent when {found[0][1]} is given (one constraint per request)", body[second])
    return found[0] if found else (None, None)


def generate_constraint(sampling: dict[str, Any]) -> tuple[Constraint | None, str | None]:
    """SGLang's sampling_params.json_schema / regex / ebnf (at most one)."""
    given = [k for k in ("json_schema", "regex", "ebnf") if sampling.get(k) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"sampling_params.{given[1]}", f"absent when sampling_params.{given[0]} is given",
                             sampling[given[1]])
    if not given:
        return None, None
    kind, field = given[0], f"sampling_params.{given[0]}"
    try:
        if kind == "json_schema":
            return _schema(sampling[kind], field), field
        if kind == "regex":
            return _simple("regex", sampling[kind], field), field
        return _grammar(sampling[kind], field), field
    except InvalidRequest as exc:
        raise renamed(exc, field) from None
