"""API-key access: every route but the probes (``/health``, ``/live``) needs ``Authorization: Bearer <key>``.

    app = APIKeyMiddleware(app, api_key)   # create_app does this when ServerSettings.api_key is set

As `vllm serve --api-key` (or ``KVLIFE_API_KEY`` through the CLI): a request
without the header, or with another key, answers 401 in OpenAI's error shape
with ``WWW-Authenticate: Bearer``, before any route runs. The key is
compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from engine.serve.http_errors import error_body

OPEN_PATHS = frozenset({"/health", "/live"})


class APIKeyMiddleware:
    """A pure ASGI middleware (streaming responses pass through untouched)."""

    def __init__(self, app: Callable, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "a valid API key is required: send 'Authorization: Bearer <key>'")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)
