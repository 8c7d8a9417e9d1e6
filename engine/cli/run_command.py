"""`kvlife run`: the built-in mixed workload, a progress bar on a terminal, and the report.

    kvlife run [--requests 48] [--concurrency 16] [--json PATH] [engine options]

A deliberately small pool by default (`RUN_DEFAULTS`, shown in --help), so
the run shows queueing and retraction; max_context is the engine's own
default (what the pool and the model allow), and the workload fits its
prompts and output lengths to it, so any model runs. The progress bar (rich:
done / total, elapsed time, requests/s) is drawn only when stderr is a
terminal; the report is printed to stdout whatever happens, and `--json` is
checked before the run so a bad path cannot lose it. Exit code 1 on a leak
(or a pool that cannot be checked); a leak that leaves requests starving
ends the run early (`workload.run_workload`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio

from engine.cli.options import add_engine_options, engine_config_from_args, int_at_least, writable_path, write_text

RUN_DEFAULTS = {"num_kv_pages": 160, "leak_check": "log", "starvation_timeout": 10.0}


def add_run_parser(subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    run = subparsers.add_parser("run", parents=parents, help="run the built-in mixed workload and print a report",
                                description=__doc__.splitlines()[0])
    run.add_argument("--requests", type=int_at_least(1), default=48, help="requests to run (default: 48)")
    run.add_argument("--concurrency", type=int_at_least(1), default=16,
                     help="clients streaming at once (default: 16)")
    run.add_argument("--workload-seed", type=int_at_least(0), default=0, help="seed of the workload (default: 0)")
    run.add_argument("--json", metavar="PATH", help="also write the report as JSON (checked before the run)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_options(run, RUN_DEFAULTS)
    run.set_defaults(func=cmd_run, default_log_level="warning")


@contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr when it is a terminal (else None: no `\\r` updates in logs)."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield None
        return
    started = time.perf_counter()
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[rate]}"))
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("run", total=total, rate="")

        def update(done: int, total: int) -> None:
            rate = done / max(time.perf_counter() - started, 1e-9)
            bar.update(task, completed=done, rate=f"{rate:.1f} req/s")

        yield update


def cmd_run(args: argparse.Namespace) -> int:
    from engine.cli.workload import format_report, run_workload

    target = writable_path(args.json) if args.json else None
    config = engine_config_from_args(args)
    with progress_bar(args.requests, not args.quiet) as progress:
        report = anyio.run(lambda: run_workload(config, num_requests=args.requests, concurrency=args.concurrency,
                                                seed=args.workload_seed, progress=progress))
    print(format_report(report))
    if target is not None:
        write_text(target, json.dumps(report, indent=2, default=str))
    return 0 if report["leak_check"] == "clean" else 1
