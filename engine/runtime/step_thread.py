"""The thread a runtime loop runs its larger model steps on.

A model step that is not small (`EngineConfig.inline_step_tokens`) runs off
the event loop's thread, so the loop keeps answering while the step's torch
ops run with the GIL released. Each such step is two thread hand-offs: the
step to this thread, and its result back to the loop. `anyio.to_thread`
made them cost 0.45-0.8 ms per 10 ms step on the 2-core development VM (its
thread pool, capacity limiter and cancel scope per call, and a wake-up
cost that grew with the step's length); a thread of the loop's own, a C
queue to hand the step over and the event loop's own thread-safe call to
hand it back cost about 0.2 ms, whatever the step's length
(docs/benchmarks.md, "Engine work per step").

The await is shielded, as `anyio.to_thread.run_sync` shields it by
default: a step in flight still writes its batch's KV pages, so the loop
never leaves it behind (the in-flight-step fence,
`engine.runtime.loop.RuntimeLoop`). The step runs in a copy of the
caller's context variables. The thread starts on the first step and ends
with `close` (the loop's task closes it as it ends).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from typing import TypeVar, cast

import anyio
from anyio.lowlevel import EventLoopToken

from engine.runtime.loop_waker import soon_on_loop
from engine.thread_names import named_thread

T = TypeVar("T")
R = TypeVar("R")

#: what the thread's queue carries: a step, or None to end the thread
_Job = tuple[Callable[[], object], list[object], Callable[[], None]]


class StepThread:
    """One thread that runs steps handed to it by one event loop, one at a time."""

    def __init__(self, name: str = "kvlife-step") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: EventLoopToken | None = None
        self._event_type: type[anyio.Event] = anyio.Event

    def bind(self, token: EventLoopToken) -> None:
        """Hand results back to the event loop of `token` (call from the loop's task)."""
        self._token = token
        # NOTE: the running library's event class, looked up once: `anyio.Event()` asks which
        # library runs on every call (as `engine.stream.OutputChannel` does)
        self._event_type = type(anyio.Event())

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def run(self, fn: Callable[[T], R], arg: T) -> R:
        """`fn(arg)` on this thread; its result, or its exception raised here. Not cancellable
        while the step runs (module docstring)."""
        if self._token is None:
            raise RuntimeError("StepThread.run before bind: no event loop to hand results back to")
        token = self._token
        if self._thread is None:  # NOTE: a queue of its own: a closed thread may still read the old one
            self._jobs = queue.SimpleQueue()
            self._thread = named_thread(self._serve, args=(self._jobs,), name=self.name)
            self._thread.start()
        done = self._event_type()
        box: list[object] = []
        context = contextvars.copy_context()
        self._jobs.put((lambda: context.run(fn, arg), box, lambda: soon_on_loop(token, done.set)))
        with anyio.CancelScope(shield=True):  # NOTE: as anyio.to_thread's: the result is returned
            await done.wait()
        ok, value = box
        if not ok:
            raise cast(BaseException, value)
        return cast(R, value)

    def close(self) -> None:
        """End the thread once the step it runs (if any) returns; no more steps after this."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            step, box, hand_back = job
            try:
                box.extend((True, step()))
            except BaseException as exc:  # noqa: BLE001 - raised again on the loop's thread
                box.extend((False, exc))
            try:
                hand_back()
            except RuntimeError:  # the event loop has closed: nobody waits for this step
                pass
