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
    alive now: compare snapshots of threads that live throughout (a benchmark's engines and links)."""
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
        elif name.startswith("kvlife-sock-"):
            out["sock"] += seconds
        elif name.startswith(LINK_THREADS):
            out["link"] += seconds
        elif name == "kvlife-step":
            out["step"] += seconds
        else:
            out["other"] += seconds
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
