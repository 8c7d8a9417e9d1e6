"""Waking a runtime loop from another thread, and how long it may sleep while requests wait on fences.

A request waiting on a fence (a transfer landing in its pages, a link still
sending from them) is woken by the fence itself: before the loop sleeps with
an empty batch, `fence_wait` subscribes the loop's `LoopWaker` to every
pending fence that signals (`resources.fences.ManualFence`), and the thread
that completes one schedules one wake-up of the loop (`soon_on_loop`; a
burst of completions costs one). The loop then sleeps until a fence wakes
it, a submission or abort does, the earliest fence deadline passes (a missed
fence is seen on time), or `SAFETY_POLL` (a wakeup lost to a bug still ends
the request). A pending fence that cannot signal (a CUDA event), or a wait
with no pending fence at all (for memory, say), keeps the short poll
(`POLL`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import structlog
from anyio.lowlevel import EventLoopToken

from states import Request

log = structlog.get_logger("kvlife.loop")

#: seconds between looks while something the loop waits for cannot signal
POLL = 0.005
#: the longest the loop sleeps while every pending fence signals
SAFETY_POLL = 0.25


def soon_on_loop(token: EventLoopToken | None, fn: Callable[[], None]) -> None:
    """Schedule `fn()` on the event loop of `token` from another thread, without waiting for it
    (asyncio's `call_soon_threadsafe`, trio's `run_sync_soon`); RuntimeError once that loop is closed."""
    native = getattr(token, "native_token", None)
    schedule = getattr(native, "call_soon_threadsafe", None) or getattr(native, "run_sync_soon", None)
    if schedule is None:
        raise RuntimeError("no event loop to call")
    try:
        schedule(fn)
    except Exception as exc:  # noqa: BLE001 - asyncio: RuntimeError; trio: RunFinishedError
        raise RuntimeError(f"the event loop is closed: {exc!r}") from exc


class LoopWaker:
    """Calls `wake` on the loop's thread when called from any thread: at once on that thread,
    else scheduled, at most one scheduled at a time. Does nothing before `bind` (no loop runs)
    or once the loop has closed."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._token: EventLoopToken | None = None
        self._thread: int | None = None
        self._pending = False

    def bind(self, token: EventLoopToken) -> None:
        """Wake the loop running on this thread, under `token` (call from the loop's task)."""
        self._token, self._thread, self._pending = token, threading.get_ident(), False

    def __call__(self) -> None:
        if threading.get_ident() == self._thread:
            self._wake()
            return
        if self._pending or self._token is None:
            return
        self._pending = True
        try:
            soon_on_loop(self._token, self._woken)
        except RuntimeError:  # the loop has closed: nothing to wake
            self._pending = False

    def _woken(self) -> None:
        # NOTE: cleared before the wake: a completion after this line schedules another one
        self._pending = False
        self._wake()


def fence_wait(requests: Iterable[Request], waker: Callable[[], None], now: float) -> float:
    """How long the loop may sleep with an empty batch (see the module docstring); 0 if a fence
    completed meanwhile. Subscribes `waker` to each pending fence that signals."""
    timeout = SAFETY_POLL
    pending = False
    for request in requests:
        for fence in request.fences:
            if fence.done():
                continue
            subscribe = getattr(fence, "subscribe", None)
            try:  # NOTE: a fence of a plugin's may be faulty: one that cannot subscribe is polled
                subscribed = subscribe is not None and subscribe(waker)
            except Exception as exc:  # noqa: BLE001 - never the loop's end
                log.warning("fence.subscribe_failed", fence=repr(fence), error=repr(exc))
                subscribed = False
            if not subscribed:
                if fence.done():  # NOTE: completed since it was looked at: no sleep, no lost wakeup
                    return 0.0
                return POLL  # it cannot signal: poll
            pending = True
            timeout = min(timeout, max(fence.deadline - now, 0.0))
    return timeout if pending else POLL
