"""Session routes (issue 21): ``POST /open_session`` and ``POST /close_session``.

    POST /open_session   {"session_id"?, "idle_timeout"?, "max_pages"?}
                         -> 200 {"session_id", "idle_timeout", "max_pages"}; 503 when max_sessions are open
    POST /close_session  {"session_id"} -> 200 {"session_id", "closed": true}; 404 if it is not open

A turn is a ``POST /generate`` with ``session_params: {"id": ...}`` whose
``text`` or ``input_ids`` are the turn's new tokens (docs/scheduling.md).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.errors import EngineOverloaded, InvalidRequest
from engine.serve.context import ServerContext
from engine.serve.http_errors import HTTPError
from engine.serve.schemas import known_fields


def _session_id(body: dict[str, Any], *, required: bool) -> str | None:
    value = body.get("session_id")
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequest("session_id", "a non-empty string", value)
    return value


def session_routes(ctx: ServerContext) -> list[Route]:
    engine = ctx.engine

    async def open_session(request: Request) -> Response:
        try:
            try:
                body = await ctx.read_json(request)
                known_fields(body, frozenset({"session_id", "idle_timeout", "max_pages"}))
                session_id = await engine.open_session(_session_id(body, required=False),
                                                       idle_timeout=body.get("idle_timeout"),
                                                       max_pages=body.get("max_pages"))
            except InvalidRequest as exc:
                raise HTTPError.invalid(exc) from None
            except EngineOverloaded as exc:
                raise ctx.unavailable(f"{exc}; retry later") from None
        except HTTPError as exc:
            return exc.response()
        info = engine.session_info(session_id)
        return JSONResponse({"session_id": session_id, "idle_timeout": info.idle_timeout,
                             "max_pages": info.max_pages})

    async def close_session(request: Request) -> Response:
        try:
            try:
                body = await ctx.read_json(request)
                known_fields(body, frozenset({"session_id"}))
                session_id = _session_id(body, required=True)
            except InvalidRequest as exc:
                raise HTTPError.invalid(exc) from None
            if not await engine.close_session(session_id):
                raise HTTPError(404, f"no open session {session_id!r}", "session_id")
        except HTTPError as exc:
            return exc.response()
        return JSONResponse({"session_id": session_id, "closed": True})

    return [Route("/open_session", open_session, methods=["POST"]),
            Route("/close_session", close_session, methods=["POST"])]
