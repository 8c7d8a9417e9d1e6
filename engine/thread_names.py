"""kvlife's threads, named for the operating system as well as for Python.

Python keeps a thread's name to itself: `top -H`, `ps -L`, `perf`, py-spy's native
frames and ``/proc/<pid>/task/<tid>/comm`` show every thread of a kvlife process as
"python". `named_thread` builds a thread whose first act is to give the OS its name
(Linux: `prctl(PR_SET_NAME)`, which keeps the first 15 bytes), so an operator can
tell the event loop from a link's threads (``kvlife-send-…``, ``kvlife-recv-…``,
``kvlife-write-…`` on a decode; ``kvlife-ctl-…``, ``kvlife-answer-…`` on a prefill)
and from the step thread (``kvlife-step``). Elsewhere it is a plain thread.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

_PR_SET_NAME = 15  # linux/prctl.h
#: the process's own symbols, libc's among them (None: not looked up yet)
_libc: ctypes.CDLL | None = None
#: the lookup or the call failed once: no thread is named after that
_unavailable = False


def set_native_name(name: str) -> bool:
    """Give the calling thread `name` at the OS level (its first 15 bytes); False where that
    cannot be done (not Linux, no C library, or the call refused)."""
    global _libc, _unavailable
    if _unavailable or not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:  # NOTE: dlopen(NULL): no library search, no ldconfig run
            _libc = ctypes.CDLL(None, use_errno=True)
        return bool(_libc.prctl(_PR_SET_NAME, name.encode(errors="replace"), 0, 0, 0) == 0)
    except Exception:  # noqa: BLE001 - no C library, no prctl in it, anything: a name is never worth a thread
        _unavailable = True
        return False


def named_thread(target: Callable[..., object], *, name: str, args: tuple[object, ...] = (),
                 daemon: bool = True) -> threading.Thread:
    """A thread running `target(*args)` named `name` for Python and for the OS (see the module
    docstring); not started."""

    def run(*run_args: object) -> None:
        set_native_name(name)
        target(*run_args)

    return threading.Thread(target=run, args=args, name=name, daemon=daemon)
