"""The generation routes: ``POST /generate``, ``/v1/completions`` and ``/v1/chat/completions``.

One path for all three: refuse while draining, read and validate the body
(400/413 before the engine is called), check the model name (404) and the
in-flight bound (503), submit (a full engine inbox is 503 with
Retry-After), then answer streamed (SSE) or whole. The API decides how the
body is parsed and how the answer is written, and whether a failed
generation is answered as an error (the OpenAI routes, `engine.serve.failures`)
or as a finish reason (``/generate``, whose `meta_info` keeps the precise one).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.errors import EngineClosed, EngineOverloaded, InvalidRequest
from engine.serve.body_conventions import openai_conventions, sglang_generate
from engine.serve.chat_schema import parse_chat
from engine.serve.context import ServerContext
from engine.serve.failures import first_failure
from engine.serve.failures import GenerationFailed
from engine.serve.generation import EventStream, Generation, generate_events, generate_json, run_to_end
from engine.serve.http_errors import HTTPError
from engine.serve.openai_format import chat_events, chat_json, completion_events, completion_json
from engine.serve.request_ids import take_request_id, unique
from engine.serve.schemas import GenerateBody, parse_completion, parse_generate
from engine.serve.scheduling_fields import engine_field
from engine.serve.structured_fields import renamed


@attrs.frozen
class API:
    """How one route parses its body and writes its answer."""

    parse: Callable[[ServerContext, dict[str, Any]], tuple[GenerateBody, str | None]]
    events: Callable[[Generation, str], AsyncGenerator[bytes, None]]
    json: Callable[[Generation, str], dict[str, Any]]
    id_prefix: str = ""
    openai: bool = True
    #: a failed generation is an HTTP error or an error event (OpenAI), not a finish reason
    failures_as_errors: bool = False


def _parse_generate(ctx: ServerContext, raw: dict[str, Any]) -> tuple[GenerateBody, str | None]:
    body, model = sglang_generate(raw)  # SGLang's native body, as routers send it
    return parse_generate(body, ctx.limits, ctx.engine.tokenizer), model


def _parse_completion(ctx: ServerContext, raw: dict[str, Any]) -> tuple[GenerateBody, str | None]:
    return parse_completion(openai_conventions(raw), ctx.limits, ctx.engine.tokenizer)


def _parse_chat(ctx: ServerContext, raw: dict[str, Any]) -> tuple[GenerateBody, str | None]:
    return parse_chat(openai_conventions(raw), ctx.limits, ctx.engine.tokenizer, ctx.chat_template,
                      tool_parser=ctx.settings.tool_call_parser, reasoning_parser=ctx.settings.reasoning_parser)


GENERATE = API(_parse_generate, lambda g, model: generate_events(g), lambda g, model: generate_json(g),
               openai=False)
COMPLETIONS = API(_parse_completion, completion_events, completion_json, "cmpl-", failures_as_errors=True)
CHAT = API(_parse_chat, chat_events, chat_json, "chatcmpl-", failures_as_errors=True)


async def _start(ctx: ServerContext, request: Request, api: API, raw: dict[str, Any]) -> tuple[Generation, str]:
    try:
        raw, wanted_id = take_request_id(raw, request.headers, openai=api.openai)
        body, model = api.parse(ctx, raw)
    except InvalidRequest as exc:
        raise HTTPError.invalid(exc) from None
    if model is not None and model != ctx.limits.model_name:
        raise HTTPError(404, f"model {model!r} is not served here (serving {ctx.limits.model_name!r})",
                        "model", repr(ctx.limits.model_name))
    if ctx.inflight >= ctx.max_inflight:
        raise ctx.unavailable(f"{ctx.max_inflight} requests already in flight; retry later")
    try:
        generation = await _generation(ctx, request, api, body, wanted_id)
    except InvalidRequest as exc:  # the engine's own checks (a rid in flight, a busy session, n over max_queued,
        # a constraint it cannot serve)
        exc = renamed(exc, body.constraint_field or "response_format")
        field = engine_field(exc.field)
        raise HTTPError(400, str(exc).replace(exc.field, field, 1), field, exc.limit) from None
    except EngineOverloaded as exc:
        raise ctx.unavailable(f"the engine's queue is full ({exc}); retry later") from None
    except EngineClosed:
        raise ctx.unavailable("the engine is not running") from None
    return generation, model or ctx.limits.model_name


async def _generation(ctx: ServerContext, request: Request, api: API, body: GenerateBody,
                      wanted_id: str | None) -> Generation:
    """The generation under the body's rid, else the id a header or /v1 field asked for (made unique if
    that one is already in flight: a router's retry), else a new one."""
    async def start(body: GenerateBody, id_prefix: str = "") -> Generation:
        generation = Generation(ctx.engine, body, route=request.scope["path"], id_prefix=id_prefix,
                                default_deadline=ctx.settings.default_deadline,
                                openai_reasons=api.failures_as_errors, stream_interval=ctx.settings.stream_interval)
        accepted = getattr(generation.stream, "accepted", None)  # NOTE: an engine's own stream answers at once
        if accepted is not None:  # under --api-process: the engine's process's answer (serve.remote_engine)
            await accepted()
        return generation

    if body.rid is not None or wanted_id is None:
        return await start(body, api.id_prefix)
    try:
        return await start(attrs.evolve(body, rid=wanted_id))
    except InvalidRequest as exc:
        if exc.field != "request_id":
            raise
    return await start(attrs.evolve(body, rid=unique(wanted_id)))


async def _grammar_ready(generation: Generation) -> None:
    """A constrained request enters the engine once its grammar is compiled; one that cannot be
    (an invalid schema or grammar, a compile past its deadline) is a 400 naming the body's field."""
    if generation.body.params.constraint is None:
        return
    try:
        await generation.stream.ready()
    except InvalidRequest as exc:
        generation.close()
        raise HTTPError.invalid(renamed(exc, generation.body.constraint_field or "response_format")) from None


async def _serve(ctx: ServerContext, request: Request, api: API) -> Response | EventStream:
    try:
        if ctx.draining:
            raise ctx.unavailable("the server is shutting down")
        try:
            raw = await ctx.read_json(request)
        except InvalidRequest as exc:
            raise HTTPError.invalid(exc) from None
        generation, model = await _start(ctx, request, api, raw)
        await _grammar_ready(generation)
    except HTTPError as exc:
        return exc.response()
    ctx.inflight += 1

    def done() -> None:
        ctx.inflight -= 1

    generation.on_close = done
    id_header = {"X-Request-Id": generation.request_id}

    def failure(failed: GenerationFailed) -> Response:
        """The failure's HTTP error, with the request id as every generation's answer has it."""
        response: Response = ctx.failure_response(failed)
        response.headers.update(id_header)
        return response

    if generation.body.stream:
        return EventStream(api.events(generation, model), generation.close,
                           on_failure=failure if api.failures_as_errors else None, headers=id_header)
    if not await run_to_end(generation, request.receive):
        return Response(status_code=499)  # the client left; nobody reads this
    failed = first_failure(c.finish_reason for c in generation.choices) if api.failures_as_errors else None
    if failed is not None:
        return failure(failed)
    return JSONResponse(api.json(generation, model), headers=id_header)


def generation_routes(ctx: ServerContext) -> list[Route]:
    def endpoint(api: API) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response | EventStream:
            return await _serve(ctx, request, api)

        return handle

    return [
        Route("/generate", endpoint(GENERATE), methods=["POST"]),
        Route("/v1/completions", endpoint(COMPLETIONS), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(CHAT), methods=["POST"]),
    ]
