"""The request machine: the only code that changes a request's state.

Every transition goes through `RequestMachine._move`, which, in order:

1. checks the edge against `TRANSITIONS` (else `IllegalTransition`);
2. acquires the handles of hooks whose `acquire_on` contains the destination
   and that the request does not hold yet (reverse release order), and adds
   the fences each acquisition started (`Handle.fences`). If one acquisition
   raises, the handles this transition acquired are released again, nothing
   else changed, and the error propagates (`ResourceExhausted` means "wait
   and retry"; anything else is a faulty hook);
3. releases, in the one release order, every held handle whose hook's
   `scope` does not contain the destination. The sequence always runs to
   its end: a hook that raises is logged and its pool marked suspect, and a
   `BaseException` (a cancellation) is re-raised only after the last hook;
4. records history, logs `request.transition` and tells the observers.

Besides moves, the machine is the one way to change what a request holds
while it runs: `grow` (each `TrimmingHook` gives back what no later step can
read, then each `GrowingHook` covers the next tokens), `publish` (each
`PublishingHook` shares the request's complete memory) and `add_fence` /
`prune_fences` (the in-flight operations a release waits for).

The machine, not the hooks, keeps the ownership ledger: after an
acquisition it records `hook.pool` / `handle.amount`, after a release it
drops it, on quarantine it moves it, and after `grow`, `trim` and `publish`
it reconciles what changed. Every call into a hook or an observer is
isolated: nothing a plugin does can stop a release sequence or leave a
request between states.

FINISHED -> RELEASED happens in `try_release` once the request's fences are
done; a fence past its deadline quarantines the handles it protects. A
quarantined handle is released by `reap_quarantine` once its fence does
complete after all.

The hooks are `states.protocols.Hook`s (the plugin author's contract is
`resources.contract`), given to the machine in release order; their optional
members are sorted once, by protocol, when the machine is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
from states.handle import Fence, Handle, ResourceExhausted
from states.logs import LiveLogger
from states.protocols import (AnyHandle, ExtendingHook, GrowingHook, Hook, Ledger, NoLedger, PublishingHook,
                              QuarantiningHook, RollingBackHook, TransitionObserver, TrimmingHook)
from states.request import Request
from states.request_state import TRANSITIONS, FinishReason, IllegalTransition, RequestState

S = RequestState
_H = TypeVar("_H", bound=Hook)


class FencePending(Exception):
    """A transition would free memory that an in-flight operation still uses."""


@attrs.define(eq=False)
class Quarantined:
    """A handle kept past its request's release because `fence` missed its deadline."""

    request: Request
    hook: Hook
    handle: Handle[Any]
    fence: Fence


class RequestMachine:
    """Moves requests through the transition table and runs their releases."""

    def __init__(
        self,
        hooks: Sequence[Hook],
        *,
        ledger: Ledger | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self.hooks: tuple[Hook, ...] = tuple(hooks)  # release order
        self._acquire_order = tuple(reversed(self.hooks))
        # NOTE: per destination, precomputed once: who acquires on entering it, and whose scope
        # it leaves (each transition then only looks at the hooks that can matter)
        self._acquirers = {s: tuple(h for h in self._acquire_order if s in h.acquire_on) for s in S}
        self._leavers = {s: tuple(h for h in self.hooks if s not in h.scope) for s in S}
        # the optional members, sorted once by protocol (acquisition order: a request's earlier
        # handles grow first, as they were taken)
        self._trimmers = tuple(h for h in self._acquire_order if isinstance(h, TrimmingHook))
        self._growers = tuple(h for h in self._acquire_order if isinstance(h, GrowingHook))
        self._publishers = tuple(h for h in self._acquire_order if isinstance(h, PublishingHook))
        self._extenders = tuple(h for h in self._acquire_order if isinstance(h, ExtendingHook))
        self._rollbacks = tuple(h for h in self.hooks if isinstance(h, RollingBackHook))
        self.ledger: Ledger = ledger if ledger is not None else NoLedger()
        self.clock = clock
        self.log: Any = logger if logger is not None else LiveLogger("kvlife.machine")
        self.transition_observers: list[TransitionObserver] = []
        #: handles whose fence missed its deadline, until the fence completes
        self.quarantined: list[Quarantined] = []

    # ------------------------------------------------------------------ moves
    def start(self, request: Request, *, acquire: bool = True) -> None:
        """Enter QUEUED, the first state, acquiring the QUEUED hooks.

        A refused acquisition leaves the request unstarted (no history, no
        handles) and propagates. `acquire=False` enters QUEUED holding nothing:
        for a request whose start a faulty hook refused, so it can be finished
        with ERROR through the one release path.
        """
        if request.history:
            raise IllegalTransition(request.request_id, request.state, S.QUEUED)
        if acquire:
            self._acquire(request, S.QUEUED)
        request.state = S.QUEUED
        self._record(request, None, S.QUEUED, "submit")

    def advance(self, request: Request, dst: RequestState, *, reason: str | None = None) -> None:
        """Move to `dst` (not FINISHED: use `finish`, not RELEASED: `try_release`)."""
        if dst in (S.FINISHED, S.RELEASED):
            raise IllegalTransition(request.request_id, request.state, dst)
        self._move(request, dst, reason)

    def finish(self, request: Request, reason: FinishReason, *, error: BaseException | None = None) -> bool:
        """Finish from any live state; never refused. False if it had already finished."""
        if request.state in (S.FINISHED, S.RELEASED):
            return False
        request.finish_reason = reason  # set first: FINISHED releases may read it
        if error is not None:
            request.error = error
        self._move(request, S.FINISHED, reason.value)
        return True

    def try_release(self, request: Request) -> bool:
        """FINISHED -> RELEASED once every fence is done or past its deadline."""
        if request.state is not S.FINISHED:
            raise IllegalTransition(request.request_id, request.state, S.RELEASED)
        now = self.clock()
        pending = [f for f in request.fences if not f.done()]
        if any(f.deadline > now for f in pending):
            return False
        for fence in pending:  # every one left has missed its deadline
            self._quarantine(request, fence)
        request.fences.clear()
        self._move(request, S.RELEASED, "fences done")
        return True

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Make every held growable handle cover `num_tokens` tokens, after each trimming hook
        has given back what no query from position `num_tokens - 1` on can read.

        False when a pool is short (what grew stays held and accounted); any
        other hook error propagates, and the caller finishes the request.
        """
        handles = request.handles
        for trimmer in self._trimmers:
            handle = handles.get(trimmer.name)
            if handle is not None:
                before = handle.amount
                try:
                    trimmer.trim(request, handle, num_tokens)
                finally:
                    self._reconcile(request, trimmer, handle, before)
        return self._cover(request, self._growers, lambda hook, handle: hook.grow(request, handle, num_tokens))

    def publish(self, request: Request) -> None:
        """Share the request's complete memory now (each publishing hook it holds a handle of),
        isolated: a hook that raises is logged and its pool marked suspect."""
        self._shrink(request, self._publishers, "publish", lambda hook, handle: hook.publish(request, handle))

    def extend(self, request: Request, num_tokens: int) -> bool:
        """Speculative decoding: make every held handle that declares `extend` cover
        `num_tokens` tokens (the draft tokens' slots), best effort. False when a pool is
        short: what grew stays held and accounted (`rollback` gives it back), and the caller
        speculates less; nothing is retracted for a draft."""
        return self._cover(request, self._extenders, lambda hook, handle: hook.extend(request, handle, num_tokens))

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding's declared shrink: every held handle that declares `rollback`
        gives back what it holds past `num_tokens` tokens (the slots of rejected drafts).
        Isolated like a release: a hook that raises is logged and its pool marked suspect."""
        self._shrink(request, self._rollbacks, "rollback",
                     lambda hook, handle: hook.rollback(request, handle, num_tokens))

    def _cover(self, request: Request, hooks: Sequence[_H], cover: Callable[[_H, AnyHandle], bool]) -> bool:
        """`cover` each held handle of `hooks` in order, recording what it changed; False at the
        first that is short (`ResourceExhausted` is short too); any other error propagates."""
        for hook in hooks:
            handle = request.handles.get(hook.name)
            if handle is None:
                continue
            before = handle.amount
            try:
                ok = cover(hook, handle)
            except ResourceExhausted:
                ok = False
            finally:
                self._reconcile(request, hook, handle, before)
            if not ok:
                return False
        return True

    def _shrink(self, request: Request, hooks: Sequence[_H], call: str,
                shrink: Callable[[_H, AnyHandle], None]) -> None:
        """`shrink` each held handle of `hooks`, isolated (a hook that raises is logged and its
        pool marked suspect), recording what it changed."""
        for hook in hooks:
            handle = request.handles.get(hook.name)
            if handle is None:
                continue
            before = handle.amount
            try:
                shrink(hook, handle)
            except Exception as exc:
                self._hook_failed(request, hook, call, exc)
            finally:
                self._reconcile(request, hook, handle, before)

    # ----------------------------------------------------------------- fences
    def add_fence(self, request: Request, fence: Fence) -> None:
        """An in-flight operation that uses some of the request's handles' memory: a release
        of those handles waits for it (or quarantines them at its deadline)."""
        if request.state is S.RELEASED:
            raise IllegalTransition(request.request_id, request.state, request.state)
        request.fences.append(fence)

    def prune_fences(self, request: Request) -> None:
        """Forget the request's completed fences (a long decode makes one per step)."""
        if request.fences:
            request.fences[:] = [f for f in request.fences if not _fence_done(f)]

    def reap_quarantine(self) -> int:
        """Release quarantined handles whose fences have completed; returns how many."""
        done = [q for q in self.quarantined if _fence_done(q.fence)]
        if not done:
            return 0
        self.quarantined = [q for q in self.quarantined if q not in done]
        interrupted: BaseException | None = None
        for q in done:
            pool = q.hook.pool
            if pool is not None:
                self.ledger.unquarantine(pool, q.request, q.handle.amount)
                self.ledger.drop(pool, q.request, q.handle.amount)
            try:
                self._release_handle(q.request, q.hook, q.handle, after_quarantine=True)
            except BaseException as exc:  # noqa: BLE001 - the others are released first
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
        return len(done)

    # -------------------------------------------------------------- internals
    def _move(self, request: Request, dst: RequestState, reason: str | None) -> None:
        src = request.state
        if dst not in TRANSITIONS[src]:
            raise IllegalTransition(request.request_id, src, dst)
        handles = request.handles
        leaving = [h for h in self._leavers[dst] if h.name in handles]
        if leaving and dst is not S.RELEASED:
            fenced = self._fenced(request, leaving)
            if fenced and dst is not S.FINISHED:
                names = sorted(f.name for f in request.fences if not f.done() and fenced & f.protects)
                raise FencePending(f"request {request.request_id!r}: {', '.join(names)} still uses {sorted(fenced)}")
            # NOTE: finishing never frees fenced memory early: those handles stay
            # held until RELEASED, which waits for the fence (or quarantines).
            leaving = [h for h in leaving if h.name not in fenced]
        if dst is not S.FINISHED:  # NOTE: no hook acquires on FINISHED (the contract forbids it)
            self._acquire(request, dst)
        interrupted = self._release_all(request, leaving)
        request.state = dst
        self._record(request, src, dst, reason)
        if interrupted is not None:
            raise interrupted

    def _fenced(self, request: Request, leaving: list[Hook]) -> set[str]:
        names = {h.name for h in leaving}
        fenced: set[str] = set()
        for fence in request.fences:
            if not fence.done():
                fenced |= names & fence.protects
        return fenced

    def _acquire(self, request: Request, dst: RequestState) -> None:
        acquired: list[Hook] = []
        try:
            for hook in self._acquirers[dst]:
                if hook.name not in request.handles:
                    handle = hook.acquire(request, dst)
                    if handle is not None and not isinstance(handle, Handle):
                        raise TypeError(f"hook {hook.name!r}: acquire returned {type(handle).__name__}, "
                                        "not a Handle or None")
                    if handle is not None:
                        request.handles[hook.name] = handle
                        acquired.append(hook)
                        pool = hook.pool
                        if pool is not None:
                            self.ledger.hold(pool, request, handle.amount)
                        if handle.fences:  # NOTE: added as acquired, so a rollback waits for them too
                            request.fences.extend(handle.fences)
                            handle.fences = ()
        except BaseException:
            self._release_all(request, [h for h in self.hooks if h in acquired])
            raise

    def _release_all(self, request: Request, hooks: Sequence[Hook]) -> BaseException | None:
        """Release each hook's handle, all of them whatever happens; returns a
        BaseException that interrupted one (to re-raise once all are done)."""
        interrupted: BaseException | None = None
        for hook in hooks:
            handle = request.handles.pop(hook.name)
            pool = hook.pool
            if pool is not None:
                self.ledger.drop(pool, request, handle.amount)
            try:
                self._release_handle(request, hook, handle)
            except BaseException as exc:  # noqa: BLE001 - re-raised after the last hook
                interrupted = interrupted or exc
        return interrupted

    def _release_handle(self, request: Request, hook: Hook, handle: Handle[Any], *,
                        after_quarantine: bool = False) -> None:
        handle.mark_released()  # raises DoubleRelease before any pool is touched
        try:
            hook.release(request, handle)
        except Exception as exc:  # a faulty hook must not stop the others
            self._hook_failed(request, hook, "release", exc)
            return
        log = self.log.debug_enabled() if isinstance(self.log, LiveLogger) else self.log
        if log is not None:
            log.debug("resource.released", request_id=request.request_id, resource=hook.name,
                      amount=handle.amount, after_quarantine=after_quarantine)

    def _quarantine(self, request: Request, fence: Fence) -> None:
        for hook in self.hooks:
            if hook.name not in fence.protects or hook.name not in request.handles:
                continue
            handle = request.handles.pop(hook.name)
            handle.mark_quarantined()
            pool = hook.pool
            if pool is not None:
                self.ledger.quarantine(pool, request, handle.amount)
            self.quarantined.append(Quarantined(request, hook, handle, fence))
            if isinstance(hook, QuarantiningHook):
                try:
                    hook.quarantine(request, handle)
                except Exception as exc:
                    self._hook_failed(request, hook, "quarantine", exc)
            self.log.warning("resource.quarantined", request_id=request.request_id, resource=hook.name,
                             amount=handle.amount, fence=fence.name)

    def _reconcile(self, request: Request, hook: Hook, handle: Handle[Any], before: int) -> None:
        """Record in the ledger what a hook call changed in `handle.amount`."""
        pool = hook.pool
        delta = handle.amount - before
        if pool is None or not delta:
            return
        self.ledger.adjust(pool, request, delta)

    def _hook_failed(self, request: Request, hook: Hook, call: str, exc: Exception) -> None:
        self.log.error(f"resource.{call}_failed", request_id=request.request_id, resource=hook.name,
                       error=repr(exc))
        self.ledger.mark_suspect(hook.pool or hook.name)

    def _record(self, request: Request, src: RequestState | None, dst: RequestState, reason: str | None) -> None:
        request.history.append((dst, self.clock()))
        log = self.log.debug_enabled() if isinstance(self.log, LiveLogger) else self.log
        if log is not None:
            log.debug("request.transition", request_id=request.request_id,
                      src=None if src is None else src.name, dst=dst.name, reason=reason)
        if src is None:
            return
        for observer in self.transition_observers:
            try:
                observer(request, src, dst)
            except Exception as exc:  # an observer is told, it cannot refuse or stop a move
                self.log.error("machine.observer_failed", request_id=request.request_id, observer=repr(observer),
                               error=repr(exc))


def _fence_done(fence: Fence) -> bool:
    try:
        return bool(fence.done())
    except Exception:  # a fence that cannot say is never done: the memory stays quarantined
        return False
