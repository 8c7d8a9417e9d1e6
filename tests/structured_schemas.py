"""Random JSON schemas for the structured-output tests, with a bound on the output they allow.

`random_schema(rng)` draws a schema of nested objects (closed: no extra
properties), arrays with item bounds, enums, patterns, bounded integers and
strings, booleans and nulls; `max_bytes(schema)` bounds the compact JSON any
instance can take, in bytes (so in tokens of any byte-level tokenizer), each
string character counted as a 6-byte escape.
"""

from __future__ import annotations

import json
import random
from typing import Any

PATTERNS = {"^[a-z]{1,5}$": 5, "^[0-9]{3}-[0-9]{2}$": 6, "^(yes|no|maybe)$": 5, "^[A-Z][a-z]{0,3}$": 4}
WORDS = ["alpha", "beta", "gamma", "delta", "kv", "life", "page", "slot"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "string", "enum", "pattern", "boolean", "null", "const"])
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 5)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4)) + ([rng.randint(0, 99)] if rng.random() < 0.3 else [])}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(sorted(PATTERNS))}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    return {"type": kind}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.3:
        return _object(rng, depth + 1)
    if depth < 2 and roll < 0.5:
        low = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth == 0 else 3))
    properties = {name: _node(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def random_schema(rng: random.Random, *, budget: int = 200) -> dict[str, Any]:
    """A random object schema whose instances take at most `budget` bytes."""
    while True:
        schema = _object(rng, 0)
        if max_bytes(schema) <= budget:
            return schema


def max_bytes(schema: dict[str, Any]) -> int:
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "object":
        inner = sum(len(json.dumps(k)) + 2 + max_bytes(v) for k, v in schema["properties"].items())
        return 2 + inner
    if kind == "array":
        return 2 + schema["maxItems"] * (max_bytes(schema["items"]) + 1)
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":
        chars = PATTERNS[schema["pattern"]] if "pattern" in schema else schema["maxLength"]
        return 2 + 6 * chars
    return {"boolean": 5, "null": 4}[kind]
