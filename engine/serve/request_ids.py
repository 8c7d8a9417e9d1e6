"""The request id a generation runs under: the body's, else the one a router or proxy put in a header.

    raw, wanted = take_request_id(raw, request.headers, route="/v1/completions")

In order: ``rid`` of a /generate body (parsed by `schemas`), vLLM's ``request_id`` or SGLang's
``rid`` in a /v1 body (taken out of the body here, validated like ``rid``), then the first of
`REQUEST_ID_HEADERS` present: ``X-Request-Id`` (what vLLM reads, and what SGLang Model Gateway
forwards), ``X-Correlation-Id``, ``X-Trace-Id``, ``Request-Id``. A header that is not a printable
string of 1 to 128 characters is ignored (warned once); a body field that is not is a 400.

A header id may already be in flight (a router retrying on the same instance): the generation
then runs as ``<id>-<8 hex>`` (`unique`), so a retry never fails on its own id. Every generation
answers with ``X-Request-Id`` set to the id it ran under.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import structlog

from engine.errors import InvalidRequest
from engine.serve.schemas import MAX_RID_CHARS

log = structlog.get_logger("kvlife.http")
REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
#: /v1 body fields that carry a request id (vLLM's, SGLang's)
BODY_FIELDS = ("request_id", "rid")
_warned_headers: set[str] = set()


def valid_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_RID_CHARS and value.isprintable()


def _from_headers(headers: Mapping[str, str]) -> str | None:
    for name in REQUEST_ID_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        if valid_id(value):
            return value
        if name not in _warned_headers:
            _warned_headers.add(name)
            log.warning("http.ignored_request_id_header", header=name,
                        limit=f"a printable string of 1 to {MAX_RID_CHARS} characters (logged once per header)")
    return None


def take_request_id(raw: dict[str, Any], headers: Mapping[str, str], *,
                    openai: bool) -> tuple[dict[str, Any], str | None]:
    """The body without its /v1 request-id fields (`openai`), and the id asked for (None: make one)."""
    wanted = None
    if openai and any(name in raw for name in BODY_FIELDS):
        raw = dict(raw)
        for name in BODY_FIELDS:
            value = raw.pop(name, None)
            if value is None:
                continue
            if not valid_id(value):
                raise InvalidRequest(name, f"a printable string of 1 to {MAX_RID_CHARS} characters", value)
            wanted = wanted or value
    if wanted is None and (openai or raw.get("rid") is None):  # a /generate rid wins over headers
        wanted = _from_headers(headers)
    return raw, wanted


def unique(request_id: str) -> str:
    """`request_id` made unique for a retry that arrives while the first is still in flight."""
    return f"{request_id[: MAX_RID_CHARS - 9]}-{uuid.uuid4().hex[:8]}"
