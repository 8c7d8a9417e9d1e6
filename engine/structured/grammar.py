"""A `Constraint` as an llguidance grammar, and the errors a grammar ends a request with.

Each kind becomes llguidance's grammar JSON: a JSON schema (compact or
flexible whitespace), ``{"type": "object"}`` for any JSON object, a regex, a
Lark grammar, or for a choice a Lark grammar of the quoted alternatives.
"""

from __future__ import annotations

import json

from engine.structured.constraint import Constraint


class GrammarError(ValueError):
    """A constraint that cannot be compiled: an invalid schema, regex or grammar."""


class GrammarDeadEnd(RuntimeError):
    """No token is allowed by the request's grammar: the request ends (ERROR) instead of
    sampling an unconstrained token."""


class GrammarViolation(RuntimeError):
    """A token outside the request's grammar arrived (e.g. a first token from a prefill
    that did not apply the constraint): the request ends (ERROR)."""


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for `constraint` (validity is checked when it is compiled)."""
    from llguidance import LLMatcher

    kind, value = constraint.kind, constraint.value
    options = {"whitespace_flexible": constraint.flexible_whitespace}
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(str(value), overrides=options)  # type: ignore[arg-type]
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)  # type: ignore[arg-type]
        if kind == "regex":
            return LLMatcher.grammar_from_regex(str(value))
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        return LLMatcher.grammar_from_lark(str(value))
    except ValueError as exc:  # not a JSON object (schemas are checked when the constraint is built)
        raise GrammarError(str(exc)) from None
