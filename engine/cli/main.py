"""The `kvlife` command line.

    kvlife run [--requests N] [--json PATH]     the built-in mixed workload + report
    kvlife generate "text" --max-new-tokens N   stream one continuation
    kvlife serve [--host H] [--port P]          the HTTP server (needs the `serve` extra)

Engine options are the EngineConfig fields (`--model`, `--device`,
`--page-size`, ...), validated with the same messages.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from engine.config import EngineConfig, SamplingParams
from engine.errors import InvalidRequest
from engine.logging import configure_logging

ENGINE_OPTIONS: list[tuple[str, type, str]] = [
    ("model", str, "'tiny', 'tiny-moe', 'null' (no compute) or a checkpoint directory"),
    ("device", str, "torch device, e.g. cpu or cuda"),
    ("dtype", str, "float32, float16 or bfloat16"),
    ("seed", int, "seed of the built-in model's weights"),
    ("page_size", int, "tokens per KV page"),
    ("num_kv_pages", int, "KV pages in the pool (page 0 is reserved)"),
    ("max_running", int, "requests running at once"),
    ("max_context", int, "prompt + output tokens per request"),
    ("max_prefill_tokens", int, "prefill tokens per step (chunked prefill)"),
    ("disaggregation", str, "none or decode"),
    ("leak_check", str, "raise, log or off"),
]


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (EngineConfig fields)")
    for name, kind, help_text in ENGINE_OPTIONS:
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None, help=help_text)
    group.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    fields = {name: getattr(args, name) for name, _, _ in ENGINE_OPTIONS if getattr(args, name) is not None}
    if getattr(args, "prefix_cache", None) is not None:
        fields["prefix_cache"] = args.prefix_cache
    fields.update(overrides)
    return EngineConfig(**fields)


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_run(args: argparse.Namespace) -> int:
    from engine.cli.workload import format_report, run_workload

    # A deliberately small pool by default, so the run shows queueing and retraction.
    defaults = {"num_kv_pages": 160, "max_context": 1024, "leak_check": "log"}
    defaults.update({k: v for k, v in vars(args).items() if k in defaults and v is not None})
    config = engine_config_from_args(args, **defaults)
    report = anyio.run(lambda: run_workload(config, num_requests=args.requests, concurrency=args.concurrency,
                                            seed=args.workload_seed, progress=None if args.quiet else _progress))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if report["leak_check"] == "clean" else 1


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine

    config = engine_config_from_args(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed_sample)

    async def main() -> None:
        async with Engine(config) as engine:
            async for output in engine.generate(args.text, params):
                sys.stdout.write(engine.tokenizer.decode(output.new_token_ids))
                sys.stdout.flush()
            sys.stdout.write("\n")

    anyio.run(main)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlife", description="kvlife: the LLM decode engine that cannot leak")
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    parser.add_argument("--log-json", action="store_true", help="JSON-lines logs")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the built-in mixed workload and print a report")
    run.add_argument("--requests", type=int, default=48)
    run.add_argument("--concurrency", type=int, default=16)
    run.add_argument("--workload-seed", type=int, default=0)
    run.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_options(run)
    run.set_defaults(func=cmd_run)

    gen = sub.add_parser("generate", help="stream the continuation of a prompt")
    gen.add_argument("text")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed-sample", type=int, default=None, help="sampling seed")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)

    try:
        from engine.cli.serve_command import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub, add_engine_options)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, json=args.log_json)
    try:
        return args.func(args)
    except InvalidRequest as exc:
        print(f"kvlife: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
