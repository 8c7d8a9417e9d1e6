"""The operational routes: abort, models, liveness and health, metrics, the memory report."""

from __future__ import annotations

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.errors import InvalidRequest
from engine.serve.context import ServerContext
from engine.serve.health import health_generate
from engine.serve.http_errors import HTTPError
from engine.serve.metrics import EngineCollector
from engine.serve.probes import readiness
from engine.serve.router_metrics import router_collector
from engine.serve.schemas import parse_abort
from engine.serve.structured_metrics import StructuredCollector
from engine.serve.transfer_metrics import TransferCollector

log = structlog.get_logger("kvlife.http")


def ops_routes(ctx: ServerContext) -> list[Route]:
    engine = ctx.engine
    registry = CollectorRegistry(auto_describe=False)
    registry.register(router_collector(EngineCollector(engine, model_name=ctx.limits.model_name), engine,
                                       model_name=ctx.limits.model_name, vllm_names=ctx.settings.vllm_metric_names))
    registry.register(StructuredCollector(engine, model_name=ctx.limits.model_name))
    transfer_stats = getattr(engine.prefill_client, "stats", None)
    if transfer_stats is not None:  # a decode with remote prefills: its links and transfers
        registry.register(TransferCollector(transfer_stats, model_name=ctx.limits.model_name))

    async def abort(request: Request) -> Response:
        try:
            try:
                rid = parse_abort(await ctx.read_json(request))
            except InvalidRequest as exc:
                raise HTTPError.invalid(exc) from None
            if not await engine.abort(rid):
                raise HTTPError(404, f"no request {rid!r} in flight", "rid")
        except HTTPError as exc:
            return exc.response()
        log.info("request.abort_requested", request_id=rid)
        return JSONResponse({"rid": rid, "aborted": True})

    async def models(request: Request) -> Response:
        card = {"id": ctx.limits.model_name, "object": "model", "created": 0, "owned_by": "kvlife",
                "max_model_len": ctx.limits.max_context}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:  # readiness (engine.serve.probes)
        status, body = readiness(ctx)
        return JSONResponse(body, status_code=status)

    async def health_check(request: Request) -> Response:
        status, body = await health_generate(ctx)
        return JSONResponse(body, status_code=status)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def debug_memory(request: Request) -> Response:
        return JSONResponse(engine.memory_report().as_dict())

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/abort", abort, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_check, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/debug/memory", debug_memory, methods=["GET"]),
    ]
