"""`kvlife serve`: the HTTP server's command line (registered by engine.cli.main).

    kvlife serve [--host 127.0.0.1] [--port 30000] [--api-key KEY] [engine options] [server options]
    kvlife serve --disaggregation prefill --disaggregation-bootstrap-port 31001 [...]
    kvlife serve --disaggregation decode --prefill H:31001 [--prefill H2:31002 ...] [...]

Engine options are the EngineConfig fields shared by every command
(`engine.cli.options.add_engine_options`, HiSparse included); a server
defaults to leak_check 'log' (a leak is logged and counted, the server keeps
serving, the exit code reports it). Logs are JSON lines at info by default.
The API key comes from `--api-key` or the KVLIFE_API_KEY environment
variable; it is never logged or shown in --help.

Disaggregation options (docs/disaggregation.md): `--disaggregation prefill`
runs a prefill server (engine.serve.prefill_http) instead of an engine;
`--prefill` gives a decode server its prefill servers (without it,
`--disaggregation decode` keeps the in-process prefill worker). The
`--transfer-*` options are the link's bounds (engine.disagg.link.settings).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio

from engine.cli.options import (ROLES, CLIError, add_engine_options, engine_config_from_args, int_at_least,
                                logging_choice, port)
from engine.cli.options import positive_seconds
from engine.cli.router_options import add_router_options, kv_events_from_args, refuse_router_options_for_prefill
from engine.errors import InvalidConfig

API_KEY_ENV = "KVLIFE_API_KEY"


def add_serve_parser(subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Add the `serve` subcommand to `kvlife`'s subparsers."""
    serve = subparsers.add_parser("serve", parents=parents, help="run the HTTP server (needs the `serve` extra)",
                                  description=__doc__.splitlines()[0])
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=port, default=30000, help="port to listen on; 0 picks a free one "
                       "(default: 30000)")
    add_engine_options(serve, {"leak_check": "log"}, roles=(*ROLES, "prefill"))
    server = serve.add_argument_group("server options")
    server.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer <key>' on every route "
                        f"but /health and /live (default: ${API_KEY_ENV} if set, else no key)")
    server.add_argument("--max-body-bytes", type=int_at_least(1), default=1 << 20,
                        help="largest request body accepted (default: 1048576)")
    server.add_argument("--max-prompt-tokens", type=int_at_least(1), default=None,
                        help="default: max_context - 1")
    server.add_argument("--max-inflight", type=int_at_least(1), default=None,
                        help="generation requests at once before 503 (default: max_running + max_queued)")
    server.add_argument("--health-timeout", type=positive_seconds, default=10.0,
                        help="seconds for a /health_generate probe, and without progress under load (default: 10)")
    server.add_argument("--served-model-name", default=None, help="model id in /v1 (default: --model)")
    server.add_argument("--default-deadline", type=positive_seconds, default=None,
                        help="seconds a generation request may take when its body gives no deadline "
                             "(default: none)")
    server.add_argument("--stream-interval", type=int_at_least(1), default=1,
                        help="tokens per streamed event after a sequence's first (default: 1, every output)")
    server.add_argument("--api-process", action="store_true",
                        help="serve HTTP from a second process (parsing, tokenizing, streaming), off the "
                             "engine's GIL; other routes pass through to the engine's process")
    _add_structured_options(serve)
    add_router_options(serve)
    _add_disaggregation_options(serve)
    serve.set_defaults(func=run_serve, default_log_level="info", default_log_json=True)


#: the parsers `engine.serve.tool_parsers` and `engine.serve.reasoning` name (not imported here: no web libraries)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def _add_structured_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("tool calls and reasoning (docs/structured.md)")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="read tool calls in this model format, for tool_choice 'auto' (default: none; "
                            "'auto' is then refused, 'required' and named tools still work)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM's command lines; 'auto' is on whenever --tool-call-parser is given")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="move a reasoning model's <think>...</think> into reasoning_content (default: none)")


def api_key_from(args: argparse.Namespace) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key:
        raise CLIError(f"--api-key (or ${API_KEY_ENV}) must not be empty")
    return key


_TRANSFER_OPTIONS: list[tuple[str, type, str]] = [
    ("first_timeout", float, "seconds a prefill may take to answer a job (its compute budget)"),
    ("floor_bandwidth", float, "bytes/s a KV chunk must at least move at"),
    ("chunk_slack", float, "seconds added to every chunk's bound"),
    ("max_chunk_bytes", int, "largest KV message"),
    ("direct_min_run_bytes", int, "shortest mean page run (bytes of one layer's K) sent from / received into "
                                  "the KV pages directly; shorter ones go through staging"),
    ("keepalive", float, "seconds between keepalives (4 missed end the link)"),
    ("connect_timeout", float, "seconds for the bootstrap handshake"),
]


def _add_disaggregation_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("disaggregation options (engine.disagg.link.settings)")
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
    group.add_argument("--disaggregation-transport", default=None,
                       help="what carries a gloo-backend link: auto (default: kvlife's sockets, driven by native "
                            "threads, where both sides can build them; else gloo) or gloo")
    for name, kind, help_text in _TRANSFER_OPTIONS:
        group.add_argument(f"--transfer-{name.replace('_', '-')}", dest=f"transfer_{name}", type=kind, default=None,
                           help=help_text)


def _link_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"host": getattr(args, "disaggregation_host", None) or args.host}
    if getattr(args, "disaggregation_secret", None) is not None:
        fields["secret"] = args.disaggregation_secret
    if getattr(args, "disaggregation_backend", None) is not None:
        fields["backend"] = args.disaggregation_backend
    if getattr(args, "disaggregation_transport", None) is not None:
        fields["transport"] = args.disaggregation_transport
    for name, _, _ in _TRANSFER_OPTIONS:
        if getattr(args, f"transfer_{name}", None) is not None:
            fields[name] = getattr(args, f"transfer_{name}")
    return fields


def prefill_settings_from_args(args: argparse.Namespace) -> Any:
    """The PrefillServerConfig of `kvlife serve --disaggregation prefill`."""
    from engine.disagg.link.settings import PrefillServerConfig

    port = args.disaggregation_bootstrap_port
    return PrefillServerConfig(bootstrap_port=31001 if port is None else port, **_link_fields(args))


def engine_config_from_serve_args(args: argparse.Namespace) -> Any:
    """The EngineConfig `kvlife serve` runs (leak_check 'log' unless set): the engine options, and the
    disaggregation role's (the prefill role runs a plain engine config under its PrefillServerConfig)."""
    overrides: dict[str, Any] = {}
    if getattr(args, "disaggregation", None) == "prefill":
        overrides["disaggregation"] = "none"
    elif getattr(args, "disaggregation_bootstrap_port", None) is not None:
        raise InvalidConfig("--disaggregation-bootstrap-port", "given only with --disaggregation prefill",
                            args.disaggregation_bootstrap_port)
    if getattr(args, "prefill_peers", None):
        from engine.disagg.link.settings import RemotePrefill

        overrides["remote_prefill"] = RemotePrefill(peers=tuple(args.prefill_peers), **_link_fields(args))
    return engine_config_from_args(args, **overrides)


def server_settings_from_args(args: argparse.Namespace) -> Any:
    from engine.serve.settings import ServerSettings

    return ServerSettings(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_inflight=args.max_inflight, health_timeout=args.health_timeout,
                          served_model_name=args.served_model_name, api_key=api_key_from(args),
                          default_deadline=args.default_deadline, stream_interval=args.stream_interval,
                          tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          vllm_metric_names=getattr(args, "vllm_metric_names", False),
                          kv_events=kv_events_from_args(args), api_process=args.api_process)


def run_serve(args: argparse.Namespace) -> int:
    """Build config and settings (their errors are one line, exit 2), then serve until SIGTERM."""
    try:
        from engine.serve.server import serve
    except ImportError as exc:
        raise CLIError(f"serve needs the `serve` extra (pip install 'kvlife[serve]'): {exc}") from None
    config = engine_config_from_serve_args(args)
    if args.disaggregation == "prefill":
        refuse_router_options_for_prefill(args)
        if args.api_process:
            raise CLIError("--api-process: not for --disaggregation prefill (a prefill server's routes are "
                           "its links' control plane; give it to the decode server)")
        from engine.serve.prefill_http import serve_prefill

        prefill = prefill_settings_from_args(args)
        level, json_logs = logging_choice(args)
        return anyio.run(lambda: serve_prefill(config, prefill, args.host, args.port, log_json=json_logs,
                                               log_level=level), backend="asyncio")
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
