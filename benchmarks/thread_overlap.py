"""How much two threads of one process ran at the same time: the event loop's thread and the model
step's worker thread of `kvlife serve`, from a py-spy profile that kept idle samples.

    py-spy record --pid PID --idle --threads -r 500 -d 5 --format speedscope -o server.ss
    python benchmarks/thread_overlap.py server.ss [--loop MainThread] [--worker kvlife-step]
        [--out bench-results/thread_overlap.json]

py-spy samples every thread at the same instants, so the i-th sample of
one thread and the i-th of the other describe the same moment. Each sample
is *busy* (running Python, or in a call that holds the GIL), *idle*
(the event loop in its selector, or in uvloop's C with no Python frame
under it; the worker waiting for its next step) or,
for the worker, *handing back* (its step done, waiting to wake the loop).
The table gives the share of moments in each pair of states; beside it,
what the loop's thread ran while the worker sat idle (the frames under the
event loop's handle, by share). A worker idle while the loop's thread is
busy is a step that could have run and did not: the two threads were
serialized. Prints the tables and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import write_results  # noqa: E402

#: frames in which the worker thread waits for its next step, or to hand its result back
WORKER_WAITS = {"Queue.get": "idle", "_write_to_self": "handing back"}


#: the event loop thread's innermost frame when it runs no Python: asyncio in its selector, or uvloop
#: (whose loop is C: its own work between callbacks counts as idle here)
LOOP_IDLE = ("select", "Runner.run", "run_until_complete", "run_forever")


def loop_state(names: list[str]) -> str:
    return "idle" if not names or names[-1].endswith(LOOP_IDLE) else "busy"


def worker_state(names: list[str]) -> str:
    for frame, state in WORKER_WAITS.items():
        if frame in names:
            return state
    return "busy"


def what_ran(names: list[str], depth: int = 3) -> str:
    """The frames just under the event loop's `Handle._run` (the task or callback that ran)."""
    if "Handle._run" in names:
        at = names.index("Handle._run")
        return ";".join(names[at + 1: at + 1 + depth]) or "Handle._run"
    return ";".join(names[-depth:])


def overlap(profile: dict, loop_name: str, worker_name: str) -> dict:
    frames = [f["name"] for f in profile["shared"]["frames"]]

    def thread(part: str) -> dict:
        for p in profile["profiles"]:
            if part in p["name"]:
                return p
        raise SystemExit(f"no thread named like {part!r} in the profile: {[p['name'] for p in profile['profiles']]}")

    loop, worker = thread(loop_name), thread(worker_name)
    pairs: collections.Counter = collections.Counter()
    while_idle: collections.Counter = collections.Counter()
    n = min(len(loop["samples"]), len(worker["samples"]))
    for a, b in zip(loop["samples"][:n], worker["samples"][:n]):
        la, wb = [frames[i] for i in a], [frames[i] for i in b]
        ls, ws = loop_state(la), worker_state(wb)
        pairs[(ls, ws)] += 1
        if ws != "busy" and ls == "busy":
            while_idle[what_ran(la)] += 1
    return {"samples": n,
            "pairs": {f"loop {ls} / worker {ws}": round(c / n, 4) for (ls, ws), c in pairs.most_common()},
            "loop_busy_while_worker_waits": {k: round(c / n, 4) for k, c in while_idle.most_common(12)}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="py-spy speedscope JSON recorded with --idle --threads")
    parser.add_argument("--loop", default="MainThread", help="a part of the event loop thread's name")
    parser.add_argument("--worker", default="kvlife-step",
                        help="a part of the step thread's name (before kvlife's own step thread: 'AnyIO worker')")
    parser.add_argument("--out", default="bench-results/thread_overlap.json")
    args = parser.parse_args(argv)
    result = overlap(json.loads(Path(args.profile).read_text()), args.loop, args.worker)
    print(f"{result['samples']} moments sampled")
    print("| loop thread / worker thread | share of moments |\n|---|---:|")
    for name, share in result["pairs"].items():
        print(f"| {name} | {100 * share:.1f}% |")
    print("\nwhat the loop thread ran while the worker waited (share of all moments):")
    for name, share in result["loop_busy_while_worker_waits"].items():
        print(f"  {100 * share:5.1f}%  {name}")
    write_results(args.out, {"profile": args.profile, **result})
    return result


if __name__ == "__main__":
    main()
