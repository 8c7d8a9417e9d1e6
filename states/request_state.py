"""Request states, finish reasons and the one transition table.

The table is the whole lifecycle (see docs/architecture.md)::

    QUEUED -> PREFILLING -> PREBUILT -> STAGING -> DECODING -> FINISHED -> RELEASED
       |                       ^        (HiSparse)   |   ^
       +-> TRANSFERRING -------+                     v   |
           (decode role)                         RETRACTED -> QUEUED

    any state before FINISHED -> FINISHED (abort, error, transfer failure, shutdown, deadline)

Only the machine (`states.machine.RequestMachine`) moves a request along it.
"""

from __future__ import annotations

import enum


class RequestState(enum.Enum):
    """Where a request is in its lifecycle."""

    QUEUED = "queued"
    TRANSFERRING = "transferring"
    PREFILLING = "prefilling"
    PREBUILT = "prebuilt"
    STAGING = "staging"
    DECODING = "decoding"
    RETRACTED = "retracted"
    FINISHED = "finished"
    RELEASED = "released"

    def __repr__(self) -> str:
        return f"RequestState.{self.name}"

    # NOTE: members are singletons compared by identity, so the identity hash is
    # consistent with equality, and C-fast: every transition tests scopes (sets of states)
    __hash__ = object.__hash__


class FinishReason(enum.Enum):
    """Why a request finished. A health check is a request kind, not a reason."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TRANSFER_FAILED = "transfer_failed"
    SHUTDOWN = "shutdown"
    #: issue 21: the request's deadline passed (any state; through the one release path)
    DEADLINE = "deadline"

    def __repr__(self) -> str:
        return f"FinishReason.{self.name}"

    __hash__ = object.__hash__  # NOTE: as RequestState's


S = RequestState

#: Legal edges. FINISHED is reachable from every state before it; RELEASED only
#: from FINISHED, once its fences are done.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.QUEUED: frozenset({S.PREFILLING, S.TRANSFERRING, S.FINISHED}),
    S.TRANSFERRING: frozenset({S.PREBUILT, S.FINISHED}),
    S.PREFILLING: frozenset({S.PREBUILT, S.FINISHED}),
    S.PREBUILT: frozenset({S.STAGING, S.DECODING, S.FINISHED}),
    S.STAGING: frozenset({S.DECODING, S.RETRACTED, S.FINISHED}),
    S.DECODING: frozenset({S.RETRACTED, S.FINISHED}),
    S.RETRACTED: frozenset({S.QUEUED, S.FINISHED}),
    S.FINISHED: frozenset({S.RELEASED}),
    S.RELEASED: frozenset(),
}

#: States in which a request has not finished yet.
LIVE_STATES: frozenset[RequestState] = frozenset(
    s for s in RequestState if s not in (S.FINISHED, S.RELEASED)
)

#: Every state but RELEASED: the widest scope a handle can have.
HELD_STATES: frozenset[RequestState] = frozenset(s for s in RequestState if s is not S.RELEASED)


def is_legal(src: RequestState, dst: RequestState) -> bool:
    return dst in TRANSITIONS[src]


class IllegalTransition(Exception):
    """A transition that is not an edge of the table was attempted."""

    def __init__(self, request_id: str, src: RequestState, dst: RequestState) -> None:
        super().__init__(f"request {request_id!r}: illegal transition {src.name} -> {dst.name}")
        self.request_id = request_id
        self.src = src
        self.dst = dst
