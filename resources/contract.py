"""The resource-hook contract: the one place that says how resources are held.

A *resource hook* owns one kind of resource for every request (KV pages,
HiSparse buffers, multimodal references, an MoE record, a plugin's own
resource). It declares:

``name``
    unique among the engine's hooks; the key of the request's handle.
``acquire_on``
    states whose entry acquires the handle, if the request does not hold
    one yet. Must be a subset of ``scope``.
``scope``
    the states in which the handle is held. On every transition the machine
    releases each handle whose scope does not contain the destination, so
    reaching RELEASED (in no scope) releases everything, and RETRACTED
    releases exactly the hooks that leave it out of their scope.
``before`` / ``after``
    names of hooks this one must be released before / after. The release
    order is derived once, at registration (`order_hooks`), deterministically
    (ties keep registration order); a cycle or an unknown name is a
    `HookOrderError` then, never at release time. Acquisition runs in the
    reverse order.
``pool``
    the name of the pool the hook accounts in, if any (a hook that raises on
    release marks that pool suspect in the memory report).

and three methods, all called only by the machine (`states.RequestMachine`):

``acquire(request, into) -> Handle | None``
    take what the request needs on entering state `into` (the request is
    still in its source state while this runs), or return None when
    it needs nothing. Either succeed whole or raise and change nothing (the
    machine then releases whatever else this transition acquired and leaves
    the request where it was). Raise `ResourceExhausted` when the pool is
    full.
``release(request, handle)``
    give back everything the handle holds. Called at most once per handle:
    the machine marks the handle released first, so a second release raises
    `states.DoubleRelease` without reaching the hook. If it raises, the error
    is logged as ``resource.release_failed``, the other hooks still run and
    the request still moves on.
``quarantine(request, handle)``
    a fence protecting this handle missed its deadline: keep the memory
    allocated forever (an in-flight copy may still write it) and account it
    as quarantined, so the leak check names it instead of failing.

Pools never free memory except from a hook's ``release``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from states import HELD_STATES, Handle, Request, RequestState


class ResourceExhausted(Exception):
    """A pool cannot satisfy an acquisition now; the caller may retry later."""


class HookOrderError(ValueError):
    """The hooks' names or before/after constraints cannot be ordered."""


class ResourceHook:
    """Base class for resource hooks; see the module docstring for the contract."""

    name: str = ""
    acquire_on: frozenset[RequestState] = frozenset()
    scope: frozenset[RequestState] = HELD_STATES
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    pool: str | None = None

    def __init__(self) -> None:
        self.quarantined: list[Handle] = []

    def acquire(self, request: Request, into: RequestState) -> Handle | None:
        return None

    def release(self, request: Request, handle: Handle) -> None:
        """Give back what `handle` holds."""

    def quarantine(self, request: Request, handle: Handle) -> None:
        self.quarantined.append(handle)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def validate_hook(hook: Any) -> None:
    """Raise HookOrderError if a hook's declaration breaks the contract."""
    for attr in ("name", "acquire_on", "scope", "before", "after", "acquire", "release", "quarantine"):
        if not hasattr(hook, attr):
            raise HookOrderError(f"resource hook {hook!r} has no {attr!r}")
    if not isinstance(hook.name, str) or not hook.name:
        raise HookOrderError(f"resource hook {hook!r} needs a non-empty string name")
    if RequestState.RELEASED in hook.scope:
        raise HookOrderError(f"hook {hook.name!r}: RELEASED cannot be in a scope")
    if not set(hook.acquire_on) <= set(hook.scope):
        raise HookOrderError(f"hook {hook.name!r}: acquire_on must be a subset of scope")


def order_hooks(hooks: Iterable[Any]) -> list[Any]:
    """The one release order: a topological sort of before/after, ties by registration."""
    hooks = list(hooks)
    index: dict[str, int] = {}
    for i, hook in enumerate(hooks):
        validate_hook(hook)
        if hook.name in index:
            raise HookOrderError(f"two resource hooks are named {hook.name!r}")
        index[hook.name] = i
    edges: dict[int, set[int]] = {i: set() for i in range(len(hooks))}  # i released before j
    for i, hook in enumerate(hooks):
        for other in hook.before:
            edges[i].add(_lookup(index, other, hook.name))
        for other in hook.after:
            edges[_lookup(index, other, hook.name)].add(i)
    indegree = {i: 0 for i in edges}
    for targets in edges.values():
        for j in targets:
            indegree[j] += 1
    ready = sorted(i for i, d in indegree.items() if d == 0)
    ordered: list[int] = []
    while ready:
        i = ready.pop(0)
        ordered.append(i)
        for j in sorted(edges[i]):
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
                ready.sort()
    if len(ordered) != len(hooks):
        stuck = sorted(hooks[i].name for i, d in indegree.items() if d > 0)
        raise HookOrderError(f"release-order cycle among hooks {stuck}")
    return [hooks[i] for i in ordered]


def _lookup(index: dict[str, int], name: str, referrer: str) -> int:
    if name not in index:
        raise HookOrderError(f"hook {referrer!r} refers to unknown hook {name!r}")
    return index[name]

