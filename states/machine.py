"""The request machine: the only code that changes a request's state.

Every transition goes through `RequestMachine._move`, which, in order:

1. checks the edge against `TRANSITIONS` (else `IllegalTransition`);
2. acquires the handles of hooks whose `acquire_on` contains the destination
   and that the request does not hold yet (reverse release order); if one
   acquisition raises, the handles acquired by this transition are released
   again and the request stays where it was;
3. releases, in the one release order, every held handle whose hook's
   `scope` does not contain the destination;
4. records history and logs `request.transition`.

The hooks are the objects described in `resources.contract` (this package
stays free of torch and pools, so it only relies on their attributes:
`name`, `acquire_on`, `scope`, `acquire`, `release`, `quarantine`). They are
given to the machine already in release order.

FINISHED -> RELEASED happens in `try_release` once the request's fences are
done; a fence past its deadline quarantines the handles it protects.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from states.handle import Handle
from states.request import Request
from states.request_state import (
    TRANSITIONS,
    FinishReason,
    IllegalTransition,
    RequestState,
)

TransitionObserver = Callable[[Request, RequestState, RequestState], None]
ReleaseErrorObserver = Callable[[Any, Request, BaseException], None]


class FencePending(Exception):
    """A transition would free memory that an in-flight operation still uses."""


class RequestMachine:
    """Moves requests through the transition table and runs their releases."""

    def __init__(
        self,
        hooks: Sequence[Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self.hooks = tuple(hooks)  # release order
        self._acquire_order = tuple(reversed(self.hooks))
        self.clock = clock
        self.log = logger if logger is not None else structlog.get_logger("kvlife.machine")
        self.transition_observers: list[TransitionObserver] = []
        self.release_error_observers: list[ReleaseErrorObserver] = []

    # ------------------------------------------------------------------ moves
    def start(self, request: Request) -> None:
        """Enter QUEUED: the request's first state, acquiring QUEUED hooks."""
        if request.history:
            raise IllegalTransition(request.request_id, request.state, RequestState.QUEUED)
        request.state = RequestState.QUEUED
        self._acquire(request, RequestState.QUEUED)
        now = self.clock()
        request.history.append((RequestState.QUEUED, now))
        self.log.debug("request.transition", request_id=request.request_id, src=None, dst="QUEUED", reason="submit")

    def advance(self, request: Request, dst: RequestState, *, reason: str | None = None) -> None:
        """Move to `dst` (not FINISHED: use `finish`, not RELEASED: `try_release`)."""
        if dst in (RequestState.FINISHED, RequestState.RELEASED):
            raise IllegalTransition(request.request_id, request.state, dst)
        self._move(request, dst, reason)

    def finish(self, request: Request, reason: FinishReason, *, error: BaseException | None = None) -> bool:
        """Finish from any live state. Returns False if it had already finished."""
        if request.state in (RequestState.FINISHED, RequestState.RELEASED):
            return False
        before = request.finish_reason, request.error
        request.finish_reason = reason  # set first: FINISHED releases may read it
        if error is not None:
            request.error = error
        try:
            self._move(request, RequestState.FINISHED, reason.value)
        except BaseException:  # refused (fence pending, acquisition failed): still live
            request.finish_reason, request.error = before
            raise
        return True

    def try_release(self, request: Request) -> bool:
        """FINISHED -> RELEASED once every fence is done or past its deadline."""
        if request.state is not RequestState.FINISHED:
            raise IllegalTransition(request.request_id, request.state, RequestState.RELEASED)
        now = self.clock()
        pending = [f for f in request.fences if not f.done()]
        if any(f.deadline > now for f in pending):
            return False
        for fence in pending:  # every one left has missed its deadline
            self._quarantine(request, fence)
        request.fences.clear()
        self._move(request, RequestState.RELEASED, "fences done")
        return True

    # -------------------------------------------------------------- internals
    def _move(self, request: Request, dst: RequestState, reason: str | None) -> None:
        src = request.state
        if dst not in TRANSITIONS[src]:
            raise IllegalTransition(request.request_id, src, dst)
        leaving = [
            h for h in self.hooks if h.name in request.handles and dst not in h.scope
        ]
        if leaving and dst is not RequestState.RELEASED:
            self._check_no_pending_fence(request, leaving)
        self._acquire(request, dst)
        for hook in leaving:
            self._release(request, hook)
        request.state = dst
        request.history.append((dst, self.clock()))
        self.log.debug(
            "request.transition", request_id=request.request_id, src=src.name, dst=dst.name, reason=reason
        )
        for observer in self.transition_observers:
            observer(request, src, dst)

    def _check_no_pending_fence(self, request: Request, leaving: list[Any]) -> None:
        names = {h.name for h in leaving}
        for fence in request.fences:
            if not fence.done() and names & fence.protects:
                raise FencePending(
                    f"request {request.request_id!r}: {fence.name} still uses {sorted(names & fence.protects)}"
                )

    def _acquire(self, request: Request, dst: RequestState) -> None:
        acquired: list[Any] = []
        try:
            for hook in self._acquire_order:
                if dst in hook.acquire_on and hook.name not in request.handles:
                    handle = hook.acquire(request, dst)
                    if handle is not None:
                        request.handles[hook.name] = handle
                        acquired.append(hook)
        except BaseException:
            for hook in (h for h in self.hooks if h in acquired):
                self._release(request, hook)
            raise

    def _release(self, request: Request, hook: Any) -> None:
        handle: Handle = request.handles.pop(hook.name)
        handle.mark_released()  # raises DoubleRelease before any pool is touched
        try:
            hook.release(request, handle)
        except Exception as exc:  # a faulty hook must not stop the others
            self.log.error(
                "resource.release_failed",
                request_id=request.request_id,
                resource=hook.name,
                error=repr(exc),
            )
            for observer in self.release_error_observers:
                observer(hook, request, exc)
            return
        self.log.debug(
            "resource.released", request_id=request.request_id, resource=hook.name, amount=handle.amount
        )

    def _quarantine(self, request: Request, fence: Any) -> None:
        for hook in self.hooks:
            if hook.name in fence.protects and hook.name in request.handles:
                handle = request.handles.pop(hook.name)
                handle.mark_quarantined()
                hook.quarantine(request, handle)
                self.log.warning(
                    "resource.quarantined",
                    request_id=request.request_id,
                    resource=hook.name,
                    amount=handle.amount,
                    fence=fence.name,
                )
