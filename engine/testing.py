"""Fault injection: an off-by-default, documented way to make things fail.

Pass `Engine(config, faults=FaultInjector(...))`. Tests and users' own chaos
tests use it instead of patching internals; the engine must come out of
every injected fault with every pool whole.

- `stall_step`: called with the request ids of each model step's batch (in
  the worker thread, before `fail_step`); whatever it blocks for, the step
  stalls: a slow or hung device, or a test that lets steps through one at a
  time (tests/test_stateful_engine.py). The event loop stays responsive.
- `fail_step`: called with the request ids of each model step's batch (in
  the worker thread, just before the forward pass); returning True makes
  the step raise `InjectedFault`, so those requests finish with ERROR.
- `fail_release`: hook names whose release raises `InjectedFault` *after*
  the hook has released (so the pool stays whole but is marked suspect), or
  *instead of* releasing when `release_leaks=True` (a real leak, which the
  leak check must then name). `fail_release_when(hook_name, request_id)`
  does the same for the releases it returns True for (every hook is
  wrapped then).
- `fail_transfer`: called with a request id in the decode role; True makes
  that KV transfer fail (TRANSFER_FAILED).
- `stuck_fences`: fence names (e.g. "kv_transfer", "host_backup") whose
  copies do not complete, so the fence misses its deadline and quarantines.
  `stuck_fence_when(fence_name, request_id)` does the same for the fences
  it returns True for; components ask `fence_stuck(name, request_id)` and
  take the fence from `stuck_fence(...)`. `unstick()` completes every stuck
  fence made so far: the late copy lands, and its quarantined memory must
  come back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from resources.contract import ResourceHookProtocol


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


@attrs.define
class FaultInjector:
    fail_step: Callable[[Sequence[str]], bool] | None = None
    stall_step: Callable[[Sequence[str]], None] | None = None
    fail_release: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    fail_release_when: Callable[[str, str], bool] | None = None
    release_leaks: bool = False
    fail_transfer: Callable[[str], bool] | None = None
    stuck_fences: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    stuck_fence_when: Callable[[str, str], bool] | None = None
    steps_failed: int = 0
    releases_failed: int = 0
    #: every fence handed out by `stuck_fence`, for `unstick`
    stuck: list = attrs.field(factory=list)

    def before_step(self, request_ids: Sequence[str]) -> None:
        if self.stall_step is not None:
            self.stall_step(request_ids)
        if self.fail_step is not None and self.fail_step(request_ids):
            self.steps_failed += 1
            raise InjectedFault(f"injected model-step failure for {list(request_ids)}")

    def wrap_hooks(self, hooks: list[ResourceHookProtocol]) -> list[ResourceHookProtocol]:
        """Hooks whose release may fail (`fail_release`, `fail_release_when`), wrapped."""
        every = self.fail_release_when is not None
        return [_FailingRelease(h, self) if every or h.name in self.fail_release else h for h in hooks]

    def release_fails(self, hook_name: str, request_id: str) -> bool:
        return hook_name in self.fail_release or (
            self.fail_release_when is not None and bool(self.fail_release_when(hook_name, request_id)))

    def fence_stuck(self, fence_name: str, request_id: str) -> bool:
        return fence_name in self.stuck_fences or (
            self.stuck_fence_when is not None and bool(self.stuck_fence_when(fence_name, request_id)))

    def stuck_fence(self, name: str, protects: Any, *, timeout: float) -> Any:
        """A fence that completes only when `unstick()` is called."""
        from resources.fences import ManualFence

        fence = ManualFence(name, protects, timeout=timeout)
        self.stuck.append(fence)
        return fence

    def unstick(self) -> int:
        """Complete every stuck fence (the copies land late); returns how many."""
        for fence in self.stuck:
            fence.complete()
        return len(self.stuck)

    def transfer_fails(self, request_id: str) -> bool:
        return self.fail_transfer is not None and bool(self.fail_transfer(request_id))


class _FailingRelease:
    """Delegates everything to the wrapped hook; its release raises."""

    def __init__(self, hook: ResourceHookProtocol, faults: FaultInjector) -> None:
        self._hook = hook
        self._faults = faults

    def __getattr__(self, name):
        return getattr(self._hook, name)

    def release(self, request, handle) -> None:
        if not self._faults.release_fails(self._hook.name, request.request_id):
            self._hook.release(request, handle)
            return
        if not self._faults.release_leaks:
            self._hook.release(request, handle)
        self._faults.releases_failed += 1
        raise InjectedFault(f"injected release failure in hook {self._hook.name!r}")
