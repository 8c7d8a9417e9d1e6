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
import ctypes.util
import sys
import threading
from collections.abc import Callable

_PR_SET_NAME = 15  # linux/prctl.h
#: the C library once looked up (None: not yet; False: not found)
_libc: ctypes.CDLL | bool | None = None


def set_native_name(name: str) -> bool:
    """Give the calling thread `name` at the OS level (its first 15 bytes); False where that
    cannot be done (not Linux, no C library, or the call refused)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    if not isinstance(_libc, ctypes.CDLL):
        return False
    return bool(_libc.prctl(_PR_SET_NAME, name.encode(), 0, 0, 0) == 0)


def named_thread(target: Callable[..., object], *, name: str, args: tuple[object, ...] = (),
                 daemon: bool = True) -> threading.Thread:
    """A thread running `target(*args)` named `name` for Python and for the OS (see the module
    docstring); not started."""

    def run(*run_args: object) -> None:
        set_native_name(name)
        target(*run_args)

    return threading.Thread(target=run, args=args, name=name, daemon=daemon)
