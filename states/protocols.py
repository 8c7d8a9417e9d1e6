"""What the machine calls: the hook and ledger protocols, torch-free.

`Hook` is the machine's view of a resource hook: the members it reads and
the two calls every hook has. The optional members a hook may declare are
protocols of their own (`GrowingHook`, `TrimmingHook`, `PublishingHook`,
`ExtendingHook`, `RollingBackHook`,
`QuarantiningHook`): the machine sorts its hooks by them once, when it is
built, and never looks a member up by name. `resources.contract` is the
plugin author's version of the same contract (with `before`/`after`, the
release-order constraints, which the machine does not read: it is given its
hooks already ordered).

`Ledger` is what the machine records in: who holds how much of which pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, runtime_checkable

from states.handle import Handle
from states.request import Request
from states.request_state import RequestState


#: a handle of any hook's payload, as the machine sees it (each hook types its own payload)
AnyHandle: TypeAlias = Handle[Any]


@runtime_checkable
class Hook(Protocol):
    """A resource hook as the machine sees it (the contract: `resources.contract`)."""

    @property
    def name(self) -> str:
        """Unique among the machine's hooks; the key of the request's handle."""

    @property
    def acquire_on(self) -> frozenset[RequestState]:
        """States whose entry acquires the handle (if the request holds none yet)."""

    @property
    def scope(self) -> frozenset[RequestState]:
        """States in which the handle is held; leaving them releases it."""

    @property
    def pool(self) -> str | None:
        """The ledger pool `handle.amount` counts in, or None."""

    def acquire(self, request: Request, into: RequestState) -> AnyHandle | None:
        """Take what the request needs on entering `into`, whole, or raise and change nothing."""
        ...

    def release(self, request: Request, handle: AnyHandle) -> None:
        """Give back everything the handle holds (called exactly once per handle)."""
        ...


@runtime_checkable
class GrowingHook(Protocol):
    """A hook whose handle grows while the request decodes."""

    def grow(self, request: Request, handle: AnyHandle, num_tokens: int) -> bool:
        """Cover `num_tokens` tokens, raising `handle.amount`; False (or ResourceExhausted) when short."""
        ...


@runtime_checkable
class TrimmingHook(Protocol):
    """A hook that gives back, while the request runs, units no later step can read."""

    def trim(self, request: Request, handle: AnyHandle, num_tokens: int) -> None:
        """Free what no query at a position >= `num_tokens - 1` can read (a sliding window),
        lowering `handle.amount` by what it gave back."""
        ...


@runtime_checkable
class PublishingHook(Protocol):
    """A hook that can share a running request's complete memory with other requests."""

    def publish(self, request: Request, handle: AnyHandle) -> None:
        """Make the complete part of the handle shareable now (the prefix cache). What becomes
        shared leaves `handle.amount`; copies the pool already holds may be given back."""
        ...


@runtime_checkable
class ExtendingHook(Protocol):
    """A hook whose handle makes room for a speculative step's draft tokens."""

    def extend(self, request: Request, handle: AnyHandle, num_tokens: int) -> bool:
        """Cover `num_tokens` tokens for a verify step, raising `handle.amount`; False (or
        ResourceExhausted) when short: the step then speculates less, nobody is retracted."""
        ...


@runtime_checkable
class RollingBackHook(Protocol):
    """A hook that gives back what a speculative step's rejected draft tokens held."""

    def rollback(self, request: Request, handle: AnyHandle, num_tokens: int) -> None:
        """Free what lies past `num_tokens` tokens, lowering `handle.amount` by what it gave back."""
        ...


@runtime_checkable
class QuarantiningHook(Protocol):
    """A hook that is told when a fence protecting its handle missed its deadline."""

    def quarantine(self, request: Request, handle: AnyHandle) -> None:
        """The memory stays allocated (a late copy may write it); may drop read-only references."""
        ...


class Ledger(Protocol):
    """Where the machine records who holds what (`resources.ledger.Ledger`)."""

    def hold(self, pool: str, owner: Request, amount: int) -> None: ...
    def adjust(self, pool: str, owner: Request, delta: int) -> None: ...
    def drop(self, pool: str, owner: Request, amount: int) -> None: ...
    def quarantine(self, pool: str, owner: Request, amount: int) -> None: ...
    def unquarantine(self, pool: str, owner: Request, amount: int) -> None: ...
    def mark_suspect(self, pool: str) -> None: ...


class NoLedger:
    """The ledger of a machine built without one (unit tests of the machine)."""

    def hold(self, pool: str, owner: Request, amount: int) -> None: ...
    def adjust(self, pool: str, owner: Request, delta: int) -> None: ...
    def drop(self, pool: str, owner: Request, amount: int) -> None: ...
    def quarantine(self, pool: str, owner: Request, amount: int) -> None: ...
    def unquarantine(self, pool: str, owner: Request, amount: int) -> None: ...
    def mark_suspect(self, pool: str) -> None: ...


#: told after every transition (request, src, dst); cannot refuse or stop a move
TransitionObserver = Callable[[Request, RequestState, RequestState], None]
