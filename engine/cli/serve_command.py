"""`kvlife serve`: the HTTP server's command line (registered by engine.cli.main).

    kvlife serve [--host 127.0.0.1] [--port 30000] [engine options] [server options]
    kvlife serve --disaggregation prefill --disaggregation-bootstrap-port 31001 [...]
    kvlife serve --disaggregation decode --prefill H:31001 [--prefill H2:31002 ...] [...]

Engine options are the EngineConfig fields, shared with `kvlife run` through
`engine.cli.main.add_engine_options`, plus the ones only a server needs
(`--max-queued`, `--fence-timeout`, HiSparse's `--hisparse-top-k` and
`--hisparse-device-buffer-size`); EngineConfig validates them with its own
messages. Logs are JSON lines at info by default (`--log-level debug` adds
one line per transition).

Disaggregation options (docs/disaggregation.md): `--disaggregation prefill`
runs a prefill server (engine.disagg.prefill_http) instead of an engine;
`--prefill` gives a decode server its prefill servers (without it,
`--disaggregation decode` keeps the in-process prefill worker). The
`--transfer-*` options are the link's bounds (engine.disagg.settings).
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
    _add_disaggregation_options(serve)
    serve.set_defaults(func=run_serve)


_TRANSFER_OPTIONS: list[tuple[str, type, str]] = [
    ("first_timeout", float, "seconds a prefill may take to answer a job (its compute budget)"),
    ("floor_bandwidth", float, "bytes/s a KV chunk must at least move at"),
    ("chunk_slack", float, "seconds added to every chunk's bound"),
    ("max_chunk_bytes", int, "largest KV message"),
    ("keepalive", float, "seconds between keepalives (4 missed end the link)"),
    ("connect_timeout", float, "seconds for the bootstrap handshake"),
]


def _add_disaggregation_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("disaggregation options (engine.disagg.settings)")
    group.add_argument("--prefill", dest="prefill_peers", action="append", default=None, metavar="HOST:PORT",
                       help="decode role: a prefill server's bootstrap address (repeat for several)")
    group.add_argument("--disaggregation-bootstrap-port", type=int, default=None,
                       help="prefill role: the bootstrap port decodes dial (0 picks a free one)")
    group.add_argument("--disaggregation-host", default=None,
                       help="address the bootstrap store and KV links bind (default: --host)")
    group.add_argument("--disaggregation-secret", default=None,
                       help="shared secret of the roles (prefer the KVLIFE_DISAGG_SECRET environment variable); "
                            "without one, loopback peers only")
    group.add_argument("--disaggregation-backend", default=None, help="gloo (default) or nccl")
    for name, kind, help_text in _TRANSFER_OPTIONS:
        group.add_argument(f"--transfer-{name.replace('_', '-')}", dest=f"transfer_{name}", type=kind, default=None,
                           help=help_text)


def _link_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"host": getattr(args, "disaggregation_host", None) or args.host}
    if getattr(args, "disaggregation_secret", None) is not None:
        fields["secret"] = args.disaggregation_secret
    if getattr(args, "disaggregation_backend", None) is not None:
        fields["backend"] = args.disaggregation_backend
    for name, _, _ in _TRANSFER_OPTIONS:
        if getattr(args, f"transfer_{name}", None) is not None:
            fields[name] = getattr(args, f"transfer_{name}")
    return fields


def prefill_settings_from_args(args: argparse.Namespace) -> Any:
    """The PrefillServerConfig of `kvlife serve --disaggregation prefill`."""
    from engine.disagg.settings import PrefillServerConfig

    port = args.disaggregation_bootstrap_port
    return PrefillServerConfig(bootstrap_port=31001 if port is None else port, **_link_fields(args))


def engine_config_from_serve_args(args: argparse.Namespace) -> Any:
    """The EngineConfig `kvlife serve` runs: engine options as given, leak_check 'log' unless set."""
    from engine.cli.main import engine_config_from_args

    overrides: dict[str, Any] = {name: getattr(args, name) for name, _, _ in _EXTRA_ENGINE_OPTIONS
                                 if getattr(args, name, None) is not None}
    if getattr(args, "leak_check", None) is None:
        overrides["leak_check"] = "log"  # a server logs a leak and keeps serving; the exit verdict reports it
    if getattr(args, "disaggregation", None) == "prefill":
        overrides["disaggregation"] = "none"  # the prefill role runs a PrefillServer over a plain engine config
    elif getattr(args, "disaggregation_bootstrap_port", None) is not None:
        raise InvalidConfig("--disaggregation-bootstrap-port", "given only with --disaggregation prefill",
                            args.disaggregation_bootstrap_port)
    if getattr(args, "prefill_peers", None):
        from engine.disagg.settings import RemotePrefill

        overrides["remote_prefill"] = RemotePrefill(peers=tuple(args.prefill_peers), **_link_fields(args))
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
    if args.disaggregation == "prefill":
        from engine.disagg.prefill_http import serve_prefill

        prefill = prefill_settings_from_args(args)
        return anyio.run(lambda: serve_prefill(config, prefill, args.host, args.port, log_json=args.log_json,
                                               log_level=args.log_level), backend="asyncio")
    settings = server_settings_from_args(args)

    return anyio.run(lambda: serve(config, args.host, args.port, log_json=args.log_json, log_level=args.log_level,
                                   settings=settings), backend="asyncio")
