"""What every route of one app shares: the engine, the settings, the prompt limits, the chat
template, the in-flight count and the draining flag; reading a bounded JSON body; and the app
around the routes (kvlife's error answers, the API key check, the context on its state)."""

from __future__ import annotations

import time
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute

from engine.serve.auth import APIKeyMiddleware
from engine.serve.chat_template import ChatTemplate
from engine.serve.failures import GenerationFailed
from engine.serve.http_errors import HTTPError, error_handlers
from engine.serve.schemas import Limits, parse_json
from engine.serve.settings import ServerSettings


@attrs.define
class ServerContext:
    engine: Any
    settings: ServerSettings
    limits: Limits
    chat_template: ChatTemplate
    max_inflight: int
    inflight: int = 0
    draining: bool = False  # NOTE: `serve` sets it on SIGTERM: new generation requests get 503
    kv_events: Any = None  # the KV events publisher while one runs (engine.kv_events), for /server_info
    started_at: float = attrs.field(factory=time.monotonic)

    @classmethod
    def build(cls, engine: Any, settings: ServerSettings) -> ServerContext:
        limits = Limits.for_engine(engine, max_prompt_tokens=settings.max_prompt_tokens,
                                   model_name=settings.served_model_name)
        max_inflight = settings.max_inflight or engine.config.max_running + engine.config.max_queued
        return cls(engine, settings, limits, ChatTemplate.for_model(engine.config.model), max_inflight)

    def app(self, routes: list[BaseRoute]) -> Starlette:
        """The ASGI app of `routes` over this context: errors as kvlife's JSON, the API key checked
        when the settings have one, this context as ``app.state.kvlife`` (`serve` sets its
        `draining` on SIGTERM)."""
        app = Starlette(routes=routes, exception_handlers=error_handlers())
        if self.settings.api_key is not None:
            app.add_middleware(APIKeyMiddleware, api_key=self.settings.api_key)
        app.state.kvlife = self
        return app

    def unavailable(self, message: str) -> HTTPError:
        return HTTPError(503, message, headers={"Retry-After": str(self.settings.retry_after_s)})

    def failure_response(self, failed: GenerationFailed) -> JSONResponse:
        """A failed generation's HTTP error (503 with Retry-After when retrying can help)."""
        headers = {"Retry-After": str(self.settings.retry_after_s)} if failed.retryable else None
        return JSONResponse(failed.body(), status_code=failed.status, headers=headers)

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, at most `max_body_bytes` (declared or streamed), else HTTPError."""
        bound = self.settings.max_body_bytes
        too_large = HTTPError(413, f"body must be at most {bound} bytes", "body", f"at most {bound} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > bound:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > bound:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise HTTPError(499, "the client disconnected while sending the body") from None
        return parse_json(b"".join(chunks))
