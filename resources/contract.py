"""The resource-hook contract: the one place that says how resources are held.

A *resource hook* owns one kind of resource for every request (a request
slot, KV pages, HiSparse buffers, multimodal references, an MoE record, a
plugin's own resource). `ResourceHookProtocol` below is the contract, member
by member; `ResourceHook` is a base class with the optional members filled
in. Duck-typed hooks work too: `validate_hook` checks, at registration, the
members the protocol declares (`REQUIRED_MEMBERS`) and fills in nothing.

Who does what:

- A hook allocates (in `acquire`, `grow`, `extend`) and frees (in `release`),
  and nothing else; the only other places it may give memory back are the
  declared shrinks: `trim` (what no later step can read: a sliding window),
  `publish` (copies the pool already holds, when a request's complete
  memory becomes shared) and `rollback` (the slots of draft tokens the model
  rejected). `tests/test_only_hooks_free.py` holds it: no other
  code calls a pool's freeing methods.
- The machine (`states.RequestMachine`) calls the hook, records every amount
  in the ownership ledger, logs, and isolates every call: a hook that raises
  in `release`, `quarantine` or `publish` is logged
  (``resource.release_failed``), its pool is marked suspect, and the rest of
  the release sequence still runs; the request always reaches RELEASED.
- Memory nobody owns (unlocked prefix-cache pages, unreferenced cached
  embeddings) is not released by any hook: its pool evicts it when an
  allocation needs room, and reports it as `evictable` meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

from states import (HELD_STATES, ExtendingHook, GrowingHook, Handle, PublishingHook, QuarantiningHook, Request,
                    RequestState, ResourceExhausted, RollingBackHook, TrimmingHook)

__all__ = [
    "OPTIONAL_MEMBERS",
    "REQUIRED_MEMBERS",
    "ExtendingHook",
    "GrowingHook",
    "HookOrderError",
    "PublishingHook",
    "QuarantiningHook",
    "ResourceExhausted",
    "ResourceHook",
    "ResourceHookProtocol",
    "RollingBackHook",
    "TrimmingHook",
    "order_hooks",
    "validate_hook",
]


class HookOrderError(ValueError):
    """A hook's declaration breaks the contract, or the hooks cannot be ordered."""


@runtime_checkable
class ResourceHookProtocol(Protocol):
    """What every resource hook declares and does.

    The declared members are read, never written, by the engine; plain class
    attributes (``pool = "lora_slots"``, ``before = ("kv",)``) implement them.
    """

    @property
    def name(self) -> str:
        """Unique among the engine's hooks; the key of the request's handle."""

    @property
    def acquire_on(self) -> frozenset[RequestState]:
        """States whose entry acquires the handle if the request holds none yet; a subset of
        `scope`. Never FINISHED or RELEASED: finishing is never refused for lack of memory."""

    @property
    def scope(self) -> frozenset[RequestState]:
        """States in which the handle is held. On every transition the machine releases each
        handle whose scope does not contain the destination (RELEASED is in no scope)."""

    @property
    def before(self) -> tuple[str, ...]:
        """Hooks this one is released before. The one release order is derived at
        registration (`order_hooks`); acquisition runs in reverse."""

    @property
    def after(self) -> tuple[str, ...]:
        """Hooks this one is released after (see `before`)."""

    @property
    def pool(self) -> str | None:
        """The ledger pool the handle's `amount` counts in, or None for a hook that holds no
        pool memory (the timing hook). One hook, one pool."""

    def acquire(self, request: Request, into: RequestState) -> Handle[Any] | None:
        """Take what the request needs on entering `into` (the request is still in its
        source state), or return None when it needs nothing. Succeed whole or raise and
        change nothing. Raise `ResourceExhausted` when the pool is short *now*: the
        machine then releases whatever else this transition acquired and leaves the
        request exactly where it was (unstarted, for QUEUED), and the engine retries
        later. Any other exception finishes the request with ERROR.
        `handle.amount` is what the machine records in the ledger for `pool`; an
        acquisition that starts an in-flight operation on the handle's memory (a copy)
        returns its fence in `Handle(..., fences=(fence,))` and the machine adds it."""
        ...

    def release(self, request: Request, handle: Handle[Any]) -> None:
        """Give back everything the handle holds. Called exactly once per handle (a second
        release raises `states.DoubleRelease` before reaching the hook), also for a
        quarantined handle once its fence completes (`handle.was_quarantined` is then
        True: its memory may have been written late, so never cache it)."""
        ...


#: The members `validate_hook` checks, exactly those the protocol declares.
REQUIRED_MEMBERS: tuple[str, ...] = ("name", "acquire_on", "scope", "before", "after", "pool", "acquire",
                                     "release")

#: Optional members, called only if present (each a protocol of `states.protocols`, which
#: the machine sorts its hooks by once, when it is built):
#:
#: ``grow(request, handle, num_tokens) -> bool`` (`GrowingHook`)
#:     make the handle cover `num_tokens` tokens (decode growth), updating
#:     `handle.amount`; return False (or raise `ResourceExhausted`) when the
#:     pool is short, changing nothing that is not accounted in the amount.
#: ``trim(request, handle, num_tokens)`` (`TrimmingHook`), a declared shrink
#:     before each growth: give back the units no query at a position
#:     >= `num_tokens - 1` can read again (the KV hook's sliding-window pages),
#:     lowering `handle.amount` by what it gave back.
#: ``publish(request, handle)`` (`PublishingHook`), a declared shrink
#:     make the handle's complete part shared now (the KV hook hands a
#:     leader's prompt pages to the prefix cache, so the other sequences of
#:     its prompt match them); what becomes shared leaves `handle.amount`, and
#:     copies the pool already holds may be given back. The runtime calls
#:     `machine.publish(request)` when an n > 1 leader has its first token.
#: ``extend(request, handle, num_tokens) -> bool`` (`ExtendingHook`)
#:     speculative decoding: cover `num_tokens` tokens for a step that verifies
#:     draft tokens (the drafts' slots), like `grow`; False when the pool is
#:     short (the step then speculates less: a draft never retracts anyone).
#:     Called by `machine.extend`, never by the mandatory growth.
#: ``rollback(request, handle, num_tokens)`` (`RollingBackHook`), a declared shrink
#:     give back what the handle holds past `num_tokens` tokens: the slots of
#:     drafts the model rejected, lowering `handle.amount` by what it gave
#:     back. Called by `machine.rollback` after a verify step.
#: ``quarantine(request, handle)`` (`QuarantiningHook`)
#:     a fence protecting this handle missed its deadline: the memory stays
#:     allocated (a copy may still write it) until `release` is called when
#:     the fence completes. Must not free anything; may drop references that
#:     are only read (nothing needs to).
#: ``pools``
#:     the hook's pools (each with `name` and `stats() -> PoolUsage`), so the
#:     leak check covers them.
OPTIONAL_MEMBERS: tuple[str, ...] = ("grow", "trim", "publish", "extend", "rollback", "quarantine", "pools")


class ResourceHook:
    """Base class for resource hooks; see `ResourceHookProtocol` for the contract."""

    name: str = ""
    acquire_on: frozenset[RequestState] = frozenset()
    scope: frozenset[RequestState] = HELD_STATES
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    pool: str | None = None

    def acquire(self, request: Request, into: RequestState) -> Handle[Any] | None:
        return None

    def release(self, request: Request, handle: Handle[Any]) -> None:
        """Give back what `handle` holds."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _is_state_set(value: Any) -> bool:
    return isinstance(value, (set, frozenset, tuple, list)) and all(isinstance(s, RequestState) for s in value)


def validate_hook(hook: Any) -> None:
    """Raise HookOrderError if a hook's declaration breaks the contract."""
    for attr in REQUIRED_MEMBERS:
        if not hasattr(hook, attr):
            raise HookOrderError(f"resource hook {hook!r} has no {attr!r} (see resources.contract)")
    if not isinstance(hook.name, str) or not hook.name:
        raise HookOrderError(f"resource hook {hook!r} needs a non-empty string name")
    for attr in ("acquire_on", "scope"):
        if not _is_state_set(getattr(hook, attr)):
            raise HookOrderError(f"hook {hook.name!r}: {attr} must be a set of RequestState")
    for attr in ("before", "after"):
        value = getattr(hook, attr)
        if not isinstance(value, (tuple, list)) or not all(isinstance(n, str) for n in value):
            raise HookOrderError(f"hook {hook.name!r}: {attr} must be a tuple of hook names")
    if hook.pool is not None and (not isinstance(hook.pool, str) or not hook.pool):
        raise HookOrderError(f"hook {hook.name!r}: pool must be None or a non-empty string")
    for attr in ("acquire", "release", *(m for m in ("grow", "trim", "publish", "extend", "rollback", "quarantine")
                                          if hasattr(hook, m))):
        if not callable(getattr(hook, attr)):
            raise HookOrderError(f"hook {hook.name!r}: {attr} must be callable")
    if RequestState.RELEASED in hook.scope:
        raise HookOrderError(f"hook {hook.name!r}: RELEASED cannot be in a scope")
    if {RequestState.FINISHED, RequestState.RELEASED} & set(hook.acquire_on):
        raise HookOrderError(f"hook {hook.name!r}: a hook cannot acquire on FINISHED or RELEASED")
    if not set(hook.acquire_on) <= set(hook.scope):
        raise HookOrderError(f"hook {hook.name!r}: acquire_on must be a subset of scope")


_Hook = TypeVar("_Hook", bound=ResourceHookProtocol)


def order_hooks(hooks: Iterable[_Hook]) -> list[_Hook]:
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
