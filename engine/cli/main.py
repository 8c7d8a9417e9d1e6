"""The `kvlife` command line.

    kvlife run [--requests N] [--json PATH]     the built-in mixed workload + report
    kvlife generate "text" --max-new-tokens N   stream one continuation
    kvlife serve [--host H] [--port P]          the HTTP server (needs the `serve` extra)
    kvlife --version

Every command takes the engine options (the EngineConfig fields, HiSparse,
`--no-plugins`) and the logging options (`--log-level`, `--log-json`),
given before or after the command; logging is configured once, to stderr.
Every bad value is one `kvlife: ...` line on stderr with exit code 2: an
argument argparse rejects, an InvalidConfig or InvalidRequest, a checkpoint
or chat template that does not load, a broken plugin (the engine's
PluginError names it), a path that cannot
be written, a port that cannot be bound. Never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

from engine.cli.generate_command import add_generate_parser
from engine.cli.options import CLIError, logging_choice
from engine.cli.run_command import add_run_parser
from engine.errors import InvalidRequest
from engine import LOG_LEVELS, configure_logging
from resources.plugins import PluginError

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one `kvlife: ...` line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kvlife").strip()
        self.exit(2, f"kvlife: {command + ': ' if command else ''}{message}\n")


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [CLIError, InvalidRequest, PluginError]  # a CheckpointError is an InvalidRequest
    try:
        from engine.serve.chat_template import ChatTemplateError

        errors.append(ChatTemplateError)
    except ImportError:  # the serve extra is missing
        pass
    return tuple(errors)


def _log_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # NOTE: on the subcommands the defaults are SUPPRESS, so an option given before the
    # command is not overwritten by the subparser's default; given after, it wins.
    default = argparse.SUPPRESS if suppress else None
    group = parser.add_argument_group("logging (before or after the command)")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=default,
                       help="debug, info, warning or error (default: warning; serve: info)")
    group.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=default,
                       help="JSON-lines logs (default: off; serve: on)")


def _package_version() -> str:
    try:
        return version("kvlife")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree without installing
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvlife", description="kvlife: the LLM decode engine that cannot leak")
    parser.add_argument("--version", action="version", version=f"kvlife {_package_version()}")
    _log_options(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _log_options(common, suppress=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,generate,serve}")
    add_run_parser(sub, [common])
    add_generate_parser(sub, [common])
    try:
        from engine.cli.serve_command import add_serve_parser
    except ImportError:  # pragma: no cover - the serve extra is missing
        pass
    else:
        add_serve_parser(sub, [common])
    return parser


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level, json_logs = logging_choice(args)
    configure_logging(level, json=json_logs)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("kvlife: interrupted", file=sys.stderr)
        return 130
    except BaseException as exc:
        leaf = _leaf(exc)
        if isinstance(leaf, _user_errors()):
            cause = leaf.__cause__  # e.g. the CheckpointError behind InvalidConfig('EngineConfig.model')
            hint = "; --no-plugins runs without plugins" if isinstance(leaf, PluginError) else ""
            print(f"kvlife: {leaf}" + (f" ({cause})" if isinstance(cause, _user_errors()) else "") + hint,
                  file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
