"""Sessions' kept KV (issue 21): a lease with its own hook, riding on the prefix cache.

A session is a conversation whose KV is kept between turns, so each turn
computes only its new tokens. Its kept KV is a path in the radix prefix
cache, locked (so eviction cannot take it) on behalf of the session's
*anchor*: a request of kind `RequestKind.SESSION` that the engine starts
(QUEUED) when the session opens and never admits. Two hooks own it:

- `SessionHook` (``session``, pool ``sessions``): acquired by an anchor on
  entering QUEUED, it takes one of `max_sessions` slots; its handle's payload
  is the `SessionRecord`, which holds the lock on the kept path. Its release
  (the anchor finishes: close, lease expiry, shutdown, a dead loop) unlocks
  the path and frees the slot. Through the machine, on every path, once.
- `SessionTurnHook` (``session_turn``, no pool): acquired by a turn (a request
  with `session_id`) on entering QUEUED; released after ``kv`` on the turn's
  way to RELEASED. If the turn ended well (STOP or LENGTH) and its session is
  still open, it moves the session's lock to the turn's whole conversation
  (prompt + output, the first `kv_len` tokens in whole pages, at most the
  session's page budget), which the KV hook has just put in the prefix cache;
  otherwise (abort, error, deadline, shutdown, a closed session) the
  session keeps what it had. Either way nothing is left locked and unowned.

A turn shares its KV through the prefix cache even when the cache is off
for other requests (`Request.shares_prompt`), so sessions work with
``prefix_cache=False``. Retraction of a turn releases only the turn's own
KV: the session's path stays locked by its anchor.

Accounting: the ``sessions`` pool counts open sessions (capacity
`max_sessions`); ``kv_pages`` reports the kept pages as shared and as
``kept`` (`KVPool.session_locks`); both are what the idle leak check allows
(held == quarantined + kept), and the memory report names each session's
anchor (``session:<id>``) as their owner.
"""

from __future__ import annotations

from typing import Any

import attrs

from resources.contract import ResourceExhausted, ResourceHook
from resources.kv_pool import KVPool
from resources.ledger import PoolUsage
from states import HELD_STATES, FinishReason, Handle, Request, RequestKind, RequestState

SESSIONS = "sessions"
#: a turn that ended this way extends its session's kept KV; any other ending leaves it as it was
EXTENDS = frozenset({FinishReason.STOP, FinishReason.LENGTH})


def anchor_id(session_id: str) -> str:
    """The request id of a session's anchor, as the ledger and the memory report name it."""
    return f"session:{session_id}"


@attrs.define(eq=False)
class SessionRecord:
    """One session: the conversation so far, and the lock on its kept prefix."""

    session_id: str
    #: the most KV pages the session may keep locked
    max_pages: int
    #: every token of the conversation so far (each turn's prompt and output)
    tokens: list[int] = attrs.field(factory=list)
    #: the anchor whose handle holds this record (set when it is acquired)
    anchor: Request | None = None
    #: the radix node locked for the kept prefix (None: nothing kept)
    node: Any = None
    kept_pages: int = 0
    closed: bool = False
    turns: int = 0


class SessionPool:
    """Pool ``sessions``: open sessions, at most `capacity` (`EngineConfig.max_sessions`)."""

    name = SESSIONS

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.open = 0

    def stats(self) -> PoolUsage:
        return PoolUsage(capacity=self.capacity, free=self.capacity - self.open, kept=self.open, unit="sessions")


class SessionStore:
    """The records of open sessions and the operations both hooks share."""

    def __init__(self, kv: KVPool, max_sessions: int) -> None:
        self.kv = kv
        self.pool = SessionPool(max_sessions)
        self.records: dict[str, SessionRecord] = {}
        self.hooks = (SessionHook(self), SessionTurnHook(self))

    def new_record(self, session_id: str, max_pages: int) -> SessionRecord:
        """Register a session about to open (its anchor's start acquires it)."""
        record = SessionRecord(session_id, max_pages)
        self.records[session_id] = record
        return record

    def keep(self, record: SessionRecord, tokens: list[int], kv_len: int) -> None:
        """Lock the cached whole pages of `tokens[:kv_len]` (within the budget) for the
        session, then unlock what it kept before; `tokens` is the conversation from now on."""
        kv = self.kv
        ps = kv.page_size
        full = min(kv_len, len(tokens)) // ps
        full = min(full, record.max_pages)
        node = None
        kept = 0
        if full:
            pages, node = kv.radix.match_pages(tokens[: full * ps])
            kept = pages.shape[0]
            if kept:
                kv.radix.lock(node)  # NOTE: lock the new path before unlocking the old: they share a prefix
            else:
                node = None
        self.unlock(record)
        record.tokens = list(tokens)
        record.node, record.kept_pages = node, kept
        record.turns += 1
        if node is not None and record.anchor is not None:
            kv.session_locks[record.anchor] = (node, kept)

    def unlock(self, record: SessionRecord) -> None:
        if record.node is not None:
            self.kv.radix.unlock(record.node)
            record.node, record.kept_pages = None, 0
        if record.anchor is not None:
            self.kv.session_locks.pop(record.anchor, None)


class SessionHook(ResourceHook):
    """An anchor's lease: one session slot, and (in its record) the lock on the kept KV."""

    name = "session"
    acquire_on = frozenset({RequestState.QUEUED})
    scope = HELD_STATES
    pool = SESSIONS

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def acquire(self, request: Request, into: RequestState) -> Handle[SessionRecord] | None:
        if request.kind is not RequestKind.SESSION:
            return None
        store = self.store
        record = store.records.get(request.session_id or "")
        if record is None or record.anchor is not None:
            raise ValueError(f"{request.request_id!r} is not a session about to open")
        if store.pool.open >= store.pool.capacity:
            raise ResourceExhausted(f"{store.pool.capacity} sessions already open (max_sessions)")
        store.pool.open += 1
        record.anchor = request
        return Handle(self.name, request.request_id, record, amount=1)

    def release(self, request: Request, handle: Handle[SessionRecord]) -> None:
        record: SessionRecord = handle.payload
        record.closed = True
        store = self.store
        store.unlock(record)
        if store.records.get(record.session_id) is record:
            del store.records[record.session_id]
        store.pool.open -= 1


class SessionTurnHook(ResourceHook):
    """A turn of a session: at release (after ``kv``), hands the turn's KV to the session."""

    name = "session_turn"
    acquire_on = frozenset({RequestState.QUEUED})
    scope = HELD_STATES
    after = ("kv",)

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def acquire(self, request: Request, into: RequestState) -> Handle[SessionRecord] | None:
        if request.session_id is None or request.kind is RequestKind.SESSION:
            return None
        record = self.store.records.get(request.session_id)
        if record is None or record.closed:  # closed meanwhile: it runs as an ordinary request
            return None
        return Handle(self.name, request.request_id, record)

    def release(self, request: Request, handle: Handle[SessionRecord]) -> None:
        record: SessionRecord = handle.payload
        if record.closed or request.finish_reason not in EXTENDS:
            return
        self.store.keep(record, request.all_token_ids, request.kv_len)
