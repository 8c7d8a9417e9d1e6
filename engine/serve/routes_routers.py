"""The routes routers call besides generation: discovery, liveness, and flushing the prefix cache.

    GET  /model_info, /get_model_info     the model (SGLang's shape; SGLang Model Gateway reads it)
    GET  /server_info, /get_server_info   the server's limits and roles (SGLang's shape, trimmed)
    GET  /live                            liveness (engine.serve.probes); /health is readiness
    POST /flush_cache                     free the prefix cache's unused pages (SGLang's name; the
    POST /reset_prefix_cache              gateway fans it out to every worker) and vLLM's name

SGLang Model Gateway registers a worker by GET /server_info (then /get_server_info) and
/model_info (then /get_model_info): ``served_model_name`` becomes the worker's model id,
``model_path``/``tokenizer_path`` are where it would load a tokenizer (a checkpoint directory; null
for the built-in models, which have no files), ``tp_size``/``dp_size`` are 1.
``disaggregation_mode`` is "null": a kvlife server is a whole server to a router, its prefill
peers are its own business (``kvlife_role`` says which role it plays).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.serve.context import ServerContext
from engine.serve.probes import liveness


def _checkpoint(model: str) -> Path | None:
    path = Path(model)
    return path.resolve() if path.is_dir() else None


def _version() -> str:
    try:
        return metadata.version("kvlife")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "unknown"


def model_info(ctx: ServerContext) -> dict[str, Any]:
    """SGLang's /model_info fields, from the checkpoint's config.json where there is one."""
    checkpoint = _checkpoint(ctx.engine.config.model)
    hf: dict[str, Any] = {}
    if checkpoint is not None and (checkpoint / "config.json").is_file():
        hf = json.loads((checkpoint / "config.json").read_text())
    path = None if checkpoint is None else str(checkpoint)
    return {"model_path": path, "tokenizer_path": path, "served_model_name": ctx.limits.model_name,
            "is_generation": True, "model_type": hf.get("model_type"), "architectures": hf.get("architectures"),
            "has_image_understanding": ctx.engine.model_config.vision is not None,
            "has_audio_understanding": False, "max_context": ctx.limits.max_context}


def server_info(ctx: ServerContext) -> dict[str, Any]:
    """SGLang's /server_info fields a router reads, and kvlife's limits."""
    config, info = ctx.engine.config, model_info(ctx)
    publisher = ctx.kv_events
    return {
        "engine": "kvlife", "version": _version(),
        "model_path": info["model_path"], "tokenizer_path": info["tokenizer_path"],
        "served_model_name": ctx.limits.model_name, "tp_size": 1, "dp_size": 1,
        "disaggregation_mode": "null", "kvlife_role": config.disaggregation,
        "max_running_requests": config.max_running, "max_queued_requests": config.max_queued,
        "max_prefill_tokens": config.max_prefill_tokens, "context_length": ctx.limits.max_context,
        "page_size": config.page_size, "max_total_num_tokens": config.num_kv_pages * config.page_size,
        "prefix_cache": config.prefix_cache, "kv_cache_dtype": config.kv_cache_dtype,
        "kv_events": None if publisher is None else {"endpoint": publisher.endpoint,
                                                     "replay_endpoint": publisher.replay_endpoint,
                                                     "topic": publisher.config.topic,
                                                     "block_size": config.page_size},
    }


def router_routes(ctx: ServerContext) -> list[Route]:
    async def get_model_info(request: Request) -> Response:
        return JSONResponse(model_info(ctx))

    async def get_server_info(request: Request) -> Response:
        return JSONResponse(server_info(ctx))

    async def live(request: Request) -> Response:
        status, body = liveness(ctx)
        return JSONResponse(body, status_code=status)

    async def flush(request: Request) -> Response:
        freed, kept = ctx.engine.flush_prefix_cache()
        return JSONResponse({"flushed": kept == 0, "pages_freed": freed, "pages_in_use": kept})

    return [
        Route("/model_info", get_model_info, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/server_info", get_server_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/live", live, methods=["GET"]),
        Route("/flush_cache", flush, methods=["POST"]),
        Route("/reset_prefix_cache", flush, methods=["POST"]),
    ]
