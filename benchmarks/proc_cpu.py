"""CPU time of a process, whole or by thread, from /proc (Linux): what the transfer benchmark
reads around each round to say where a job's CPU goes and whether the cores were the limit.

Threads fall in groups by the names the kernel knows them by (kvlife gives its threads their names
there too: `engine.thread_names`): the process's main thread (its event loop: the decode engine's,
or the prefill server's), gloo's socket threads (``gloo_tcp_loop``), the socket transport's native
threads (``kvlife-sock-tx``, ``kvlife-sock-rx``: `engine.disagg.link.socket_transport`), a link's threads (a decode's
``kvlife-send-…``, ``kvlife-recv-…``, ``kvlife-write-…``; a prefill's ``kvlife-ctl-…``,
``kvlife-answer-…``), the step thread (``kvlife-step``), and every other thread. A thread's
time comes from its ``schedstat`` (nanoseconds on a CPU) where the kernel has it, else from its
``stat`` (user + system, in clock ticks); a process's whole time from its ``stat`` (ticks), or,
for this process, `time.process_time`.
"""

from __future__ import annotations

import os
import time

#: the thread groups, in the order the benchmark prints them
GROUPS = ("loop", "gloo", "sock", "link", "step", "other")
#: the names (as the kernel keeps them: 15 bytes) of a link's threads
LINK_THREADS = ("kvlife-send-", "kvlife-recv-", "kvlife-write-", "kvlife-ctl-", "kvlife-answer-")


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread, ended ones too) of this process, or of process `pid`."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        return _stat_s(f.read())


def thread_cpu_s(pid: int | None = None) -> dict[str, float]:
    """On-CPU seconds of each thread group (`GROUPS`) of process `pid` (None: this one), of the threads
    alive now (to compare two moments, `thread_times` and `group_deltas` count only what ran between)."""
    out = dict.fromkeys(GROUPS, 0.0)
    for group, seconds in thread_times(pid).values():
        out[group] += seconds
    return out


def thread_times(pid: int | None = None) -> dict[int, tuple[str, float]]:
    """Each live thread of process `pid` (None: this one): its group (`GROUPS`) and on-CPU seconds."""
    pid = os.getpid() if pid is None else pid
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            seconds = _thread_s(task)
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended between the listing and the read
        out[int(tid)] = (_group(int(tid) == pid, name), seconds)
    return out


def group_deltas(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """Seconds each group ran between two `thread_times` snapshots: a thread started in between counts
    whole; one that ended in between is not counted (its last seconds cannot be read, and subtracting
    its earlier ones, as two group sums would, makes a group negative)."""
    out = dict.fromkeys(GROUPS, 0.0)
    for tid, (group, seconds) in after.items():
        out[group] += seconds - (before[tid][1] if tid in before else 0.0)
    return out


def _group(main: bool, name: str) -> str:
    if main:
        return "loop"
    if name.startswith("gloo"):
        return "gloo"
    if name.startswith("kvlife-sock-"):
        return "sock"
    if name.startswith(LINK_THREADS):
        return "link"
    return "step" if name == "kvlife-step" else "other"


def _thread_s(task: str) -> float:
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (FileNotFoundError, ValueError, IndexError):  # a kernel without schedstat
        with open(f"{task}/stat") as f:
            return _stat_s(f.read())


def _stat_s(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()  # NOTE: the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
