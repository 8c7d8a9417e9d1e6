"""`kvlife serve`: the HTTP server's command line (registered by engine.cli.main).

    kvlife serve [--host 127.0.0.1] [--port 30000] [--api-key KEY] [engine options] [server options]

Engine options are the EngineConfig fields shared by every command
(`engine.cli.options.add_engine_options`, HiSparse included); a server
defaults to leak_check 'log' (a leak is logged and counted, the server keeps
serving, the exit code reports it). Logs are JSON lines at info by default.
The API key comes from `--api-key` or the KVLIFE_API_KEY environment
variable; it is never logged or shown in --help.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio

from engine.cli.options import CLIError, add_engine_options, engine_config_from_args, int_at_least, port
from engine.cli.options import positive_seconds

API_KEY_ENV = "KVLIFE_API_KEY"


def add_serve_parser(subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Add the `serve` subcommand to `kvlife`'s subparsers."""
    serve = subparsers.add_parser("serve", parents=parents, help="run the HTTP server (needs the `serve` extra)",
                                  description=__doc__.splitlines()[0])
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=port, default=30000, help="port to listen on; 0 picks a free one "
                       "(default: 30000)")
    add_engine_options(serve, {"leak_check": "log"})
    server = serve.add_argument_group("server options")
    server.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer <key>' on every route "
                        f"but /health (default: ${API_KEY_ENV} if set, else no key)")
    server.add_argument("--max-body-bytes", type=int_at_least(1), default=1 << 20,
                        help="largest request body accepted (default: 1048576)")
    server.add_argument("--max-prompt-tokens", type=int_at_least(1), default=None,
                        help="default: max_context - 1")
    server.add_argument("--max-inflight", type=int_at_least(1), default=None,
                        help="generation requests at once before 503 (default: max_running + max_queued)")
    server.add_argument("--health-timeout", type=positive_seconds, default=10.0,
                        help="seconds for a /health_generate probe, and without progress under load (default: 10)")
    server.add_argument("--served-model-name", default=None, help="model id in /v1 (default: --model)")
    serve.set_defaults(func=run_serve, default_log_level="info", default_log_json=True)


def api_key_from(args: argparse.Namespace) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key:
        raise CLIError(f"--api-key (or ${API_KEY_ENV}) must not be empty")
    return key


def server_settings_from_args(args: argparse.Namespace) -> Any:
    from engine.serve.settings import ServerSettings

    return ServerSettings(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_inflight=args.max_inflight, health_timeout=args.health_timeout,
                          served_model_name=args.served_model_name, api_key=api_key_from(args))


def run_serve(args: argparse.Namespace) -> int:
    """Build config and settings (their errors are one line, exit 2), then serve until SIGTERM."""
    try:
        from engine.serve.server import serve
    except ImportError as exc:
        raise CLIError(f"serve needs the `serve` extra (pip install 'kvlife[serve]'): {exc}") from None
    config = engine_config_from_args(args)
    settings = server_settings_from_args(args)

    async def main() -> int:
        try:
            return await serve(config, args.host, args.port, settings=settings)
        except OSError as exc:
            raise CLIError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None

    try:
        import uvloop  # noqa: F401 - the faster event loop, when installed
    except ImportError:
        options = {}
    else:
        options = {"use_uvloop": True}
    return anyio.run(main, backend="asyncio", backend_options=options)
