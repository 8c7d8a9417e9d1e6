"""`kvlife serve`: the HTTP server's command line (registered by engine.cli.main).

    kvlife serve [--host 127.0.0.1] [--port 30000] [engine options] [server options]

Engine options are the EngineConfig fields, shared with `kvlife run` through
`engine.cli.main.add_engine_options`, plus the ones only a server needs
(`--max-queued`, `--fence-timeout`, HiSparse's `--hisparse-top-k` and
`--hisparse-device-buffer-size`); EngineConfig validates them with its own
messages. Logs are JSON lines at info by default (`--log-level debug` adds
one line per transition).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import anyio

from engine.errors import InvalidConfig

_EXTRA_ENGINE_OPTIONS: list[tuple[str, type, str]] = [
    ("max_queued", int, "requests that may wait in the engine's inbox (a full inbox answers 503)"),
    ("fence_timeout", float, "seconds a fence may stay pending before its handle is quarantined"),
]


def add_serve_parser(subparsers: Any, add_engine_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `serve` subcommand to `kvlife`'s subparsers."""
    serve = subparsers.add_parser("serve", help="run the HTTP server (needs the `serve` extra)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=30000, help="port to listen on; 0 picks a free one")
    serve.add_argument("--log-level", default="info", help="debug, info, warning or error (default info)")
    serve.add_argument("--no-log-json", dest="log_json", action="store_false", default=True,
                       help="console logs instead of JSON lines")
    add_engine_options(serve)
    engine_group = serve.add_argument_group("more engine options (EngineConfig fields)")
    existing = {a.dest for a in serve._actions}
    for name, kind, help_text in _EXTRA_ENGINE_OPTIONS:
        if name not in existing:
            engine_group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                                      help=help_text)
    if "hisparse_top_k" not in existing:
        engine_group.add_argument("--hisparse-top-k", type=int, default=None,
                                  help="enable HiSparse, attending over the top K tokens per step")
        engine_group.add_argument("--hisparse-device-buffer-size", type=int, default=None,
                                  help="HiSparse device buffer slots per request")
    server = serve.add_argument_group("server options")
    server.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    server.add_argument("--max-prompt-tokens", type=int, default=None, help="default: max_context - 1")
    server.add_argument("--max-inflight", type=int, default=None,
                        help="generation requests at once before 503 (default: max_running + max_queued)")
    server.add_argument("--health-timeout", type=float, default=10.0, help="seconds for /health_generate")
    server.add_argument("--served-model-name", default=None, help="model id in /v1 (default: --model)")
    serve.set_defaults(func=run_serve)


def engine_config_from_serve_args(args: argparse.Namespace) -> Any:
    """The EngineConfig `kvlife serve` runs: engine options as given, leak_check 'log' unless set."""
    from engine.cli.main import engine_config_from_args

    overrides: dict[str, Any] = {name: getattr(args, name) for name, _, _ in _EXTRA_ENGINE_OPTIONS
                                 if getattr(args, name, None) is not None}
    if getattr(args, "leak_check", None) is None:
        overrides["leak_check"] = "log"  # a server logs a leak and keeps serving; the exit verdict reports it
    top_k, buffer = getattr(args, "hisparse_top_k", None), getattr(args, "hisparse_device_buffer_size", None)
    if top_k is not None or buffer is not None:
        try:
            from hisparse import HiSparseConfig
        except ImportError:
            raise InvalidConfig("EngineConfig.hisparse", "available (HiSparse is not in this build)", top_k) from None
        fields = {k: v for k, v in (("top_k", top_k), ("device_buffer_size", buffer)) if v is not None}
        overrides["hisparse"] = HiSparseConfig(**fields)
    return engine_config_from_args(args, **overrides)


def server_settings_from_args(args: argparse.Namespace) -> Any:
    from engine.serve.server import ServerSettings

    return ServerSettings(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_inflight=args.max_inflight, health_timeout=args.health_timeout,
                          served_model_name=args.served_model_name)


def run_serve(args: argparse.Namespace) -> int:
    """Build the config (InvalidConfig propagates to the CLI's error message), then serve until SIGTERM."""
    config = engine_config_from_serve_args(args)
    try:
        from engine.serve.server import serve
    except ImportError as exc:
        print(f"kvlife serve needs the `serve` extra (pip install 'kvlife[serve]'): {exc}", file=sys.stderr)
        return 2
    settings = server_settings_from_args(args)

    return anyio.run(lambda: serve(config, args.host, args.port, log_json=args.log_json, log_level=args.log_level,
                                   settings=settings), backend="asyncio")
