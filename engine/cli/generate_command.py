"""`kvlife generate "text"`: stream one continuation to stdout.

    kvlife generate "Hello" [--max-new-tokens 32] [--temperature 0] [engine options]

The prompt and the output length are checked against the engine's limits
before any token is generated (`InvalidRequest` is one `kvlife: ...` line,
exit code 2). What is printed is `RequestOutput.new_text`: the engine
detokenizes incrementally and holds back an incomplete UTF-8 character, so
a character split across tokens prints whole, never as U+FFFD. `--stop`
strings end the output (matched by the engine, left out of the text).
"""

from __future__ import annotations

import argparse
import sys

import anyio

from engine.cli.options import add_engine_options, engine_config_from_args, int_at_least, non_empty
from engine.cli.options import non_negative_number
from engine.config import SamplingParams


def add_generate_parser(subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    gen = subparsers.add_parser("generate", parents=parents, help="stream the continuation of a prompt",
                                description=__doc__.splitlines()[0])
    gen.add_argument("text", type=non_empty, help="the prompt")
    gen.add_argument("--max-new-tokens", type=int_at_least(1), default=32, help="output tokens (default: 32)")
    gen.add_argument("--temperature", type=non_negative_number, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--seed-sample", type=int_at_least(0), default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", type=non_empty, default=[], metavar="TEXT",
                     help="end the output at this string (repeatable)")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate, default_log_level="warning")


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine

    config = engine_config_from_args(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed_sample,
                            stop=tuple(args.stop))

    async def main() -> None:
        async with Engine(config) as engine:
            stream = engine.generate(args.text, params)  # InvalidRequest here, before any output
            async with stream:
                async for output in stream:
                    sys.stdout.write(output.new_text)
                    sys.stdout.flush()
            sys.stdout.write("\n")

    anyio.run(main)
    return 0
