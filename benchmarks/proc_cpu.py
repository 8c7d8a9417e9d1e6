"""CPU time of a process, whole or by thread, from /proc (Linux): what the transfer benchmark
reads around each round to say where a job's CPU goes and whether the cores were the limit.

Threads fall in three groups, by what the kernel knows of them: the process's main thread (its
event loop: the decode engine's, or the prefill server's), gloo's socket threads (named
``gloo_tcp_loop`` by gloo), and every other thread (kvlife's link threads, a step worker thread,
anything else the process runs; Python does not name its threads for the kernel). A thread's
time comes from its ``schedstat`` (nanoseconds on a CPU) where the kernel has it, else from its
``stat`` (user + system, in clock ticks); a process's whole time from its ``stat`` (ticks), or,
for this process, `time.process_time`.
"""

from __future__ import annotations

import os
import time

#: the thread groups, in the order the benchmark prints them
GROUPS = ("loop", "gloo", "other")


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread, ended ones too) of this process, or of process `pid`."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        return _stat_s(f.read())


def thread_cpu_s(pid: int | None = None) -> dict[str, float]:
    """CPU seconds of each thread group (`GROUPS`) of process `pid` (None: this one). "other" is the
    process's whole time less the other two, so a thread that ended still counts there."""
    pid = os.getpid() if pid is None else pid
    out = dict.fromkeys(GROUPS, 0.0)
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
        if int(tid) == pid:
            out["loop"] += seconds
        elif name.startswith("gloo"):
            out["gloo"] += seconds
    out["other"] = cpu_s(None if pid == os.getpid() else pid) - out["loop"] - out["gloo"]
    return out


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
