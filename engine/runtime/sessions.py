"""Sessions (issue 21): open, run turns whose KV is kept, close; the loop's side of them.

    session_id = await engine.open_session(idle_timeout=60)
    out = await engine.complete(first_prompt, params, session=session_id)    # turn 1
    out = await engine.complete(next_tokens, params, session=session_id)     # turn 2: only these are new
    await engine.close_session(session_id)

A turn's prompt is the *new* tokens: the engine prepends the conversation so
far (every earlier turn's prompt and output), whose KV the session keeps in
the prefix cache (`resources.session_hook`), so the turn computes only what
is new. The manager validates turns at submission (the session is open, no
other turn is in flight: one turn at a time, a second is refused with
`InvalidRequest`; the conversation fits `max_context`), marks the session
busy when the loop takes the turn, and free again when the turn reaches
RELEASED, by whatever path (a release observer, so a turn whose start was
refused frees it too).

Leases: a session expires `idle_timeout` seconds after its latest activity
(opening, a turn's submission, a turn's end), also in the middle of a turn
that outlasts it. Expiry, `close` and shutdown finish the anchor through the
machine, through the runtime's gateway (reasons DEADLINE, STOP and SHUTDOWN), which releases its handle:
the kept KV is unlocked and the slot freed. A turn in flight when its
session goes keeps running; its KV then goes to the prefix cache like any
request's, and the session is gone for the next turn. The loop applies
closes and expiries each iteration, and bounds its waits by `next_due()`,
so a lease expires without traffic.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import attrs

from engine.errors import EngineOverloaded, InvalidRequest
from engine.runtime.gateway import RequestGateway
from resources.paging import pages_for
from resources.session_hook import SessionRecord, SessionStore, anchor_id
from states import FinishReason, Request, RequestKind, ResourceExhausted

MAX_SESSION_ID_CHARS = 128


@attrs.frozen
class SessionInfo:
    """What `Engine.session_info` reports about an open session."""

    session_id: str
    idle_timeout: float
    max_pages: int
    #: tokens of the conversation so far, and how many of them have their KV kept
    num_tokens: int
    kept_tokens: int
    kept_pages: int
    turns: int
    busy: bool
    expires_in: float


@attrs.define(eq=False)
class _Session:
    record: SessionRecord
    anchor: Request
    idle_timeout: float
    last_active: float
    #: the turn in flight (submitted, not yet RELEASED), if any
    turn: Request | None = None

    def expires_at(self) -> float:
        return self.last_active + self.idle_timeout


class SessionManager:
    def __init__(self, store: SessionStore | None, gateway: RequestGateway, *, max_context: int,
                 idle_timeout: float, max_pages: int | None, clock: Callable[[], float]) -> None:
        self.store = store
        self.gateway = gateway
        self.max_context = max_context
        self.default_idle_timeout = idle_timeout
        self.page_size = store.kv.page_size if store is not None else 1
        #: the most pages a session may keep: at most what a whole context needs
        self.max_pages = min(max_pages if max_pages is not None else pages_for(max_context, self.page_size),
                             pages_for(max_context, self.page_size))
        self.clock = clock
        self.sessions: dict[str, _Session] = {}
        self._closing: list[tuple[str, FinishReason]] = []

    def __len__(self) -> int:
        return len(self.sessions)

    # ------------------------------------------------------------ opening
    def open(self, session_id: str | None = None, *, idle_timeout: float | None = None,
             max_pages: int | None = None) -> str:
        """Open a session now (its anchor starts through the machine); returns its id."""
        store = self._store()
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not (isinstance(session_id, str) and 0 < len(session_id) <= MAX_SESSION_ID_CHARS
                  and session_id.isprintable()):
            raise InvalidRequest("session_id", f"a printable string of 1 to {MAX_SESSION_ID_CHARS} characters",
                                 session_id)
        if session_id in self.sessions or session_id in store.records:
            raise InvalidRequest("session_id", "not the id of an open session", session_id)
        idle = self.default_idle_timeout if idle_timeout is None else idle_timeout
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0 < idle < float("inf"):
            raise InvalidRequest("idle_timeout", "a finite number of seconds > 0", idle_timeout)
        pages = self.max_pages if max_pages is None else max_pages
        if isinstance(pages, bool) or not isinstance(pages, int) or not 0 <= pages <= self.max_pages:
            raise InvalidRequest("max_pages", f"an integer in [0, {self.max_pages}]", max_pages)
        record = store.new_record(session_id, pages)
        # NOTE: started here, on the caller's task, so a full engine says so at once: an anchor's start
        # takes only its session slot (and the timing stamp), never pages or anything a step reads
        anchor = Request(anchor_id(session_id), [], None, kind=RequestKind.SESSION, session_id=session_id)
        try:
            self.gateway.start(anchor)
        except ResourceExhausted as exc:
            store.records.pop(session_id, None)
            raise EngineOverloaded(str(exc)) from None
        except BaseException:
            store.records.pop(session_id, None)
            raise
        self.sessions[session_id] = _Session(record, anchor, float(idle), self.clock())
        return session_id

    # -------------------------------------------------------------- turns
    def turn_prompt(self, session_id: Any, new_tokens: list[int], max_new_tokens: int) -> list[int]:
        """The turn's whole prompt (the conversation so far, then `new_tokens`), or
        InvalidRequest: the session must be open, idle of turns, and the result fit."""
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or any(sid == session_id for sid, _ in self._closing):
            raise InvalidRequest("session", "the id of an open session", session_id)
        if session.turn is not None:
            raise InvalidRequest("session", "a session with no turn in flight (one turn at a time)",
                                 f"{session_id} (turn {session.turn.request_id!r} is running)")
        prompt = session.record.tokens + new_tokens
        total = len(prompt) + max_new_tokens
        if total > self.max_context:
            raise InvalidRequest("session tokens + prompt + max_new_tokens", f"<= max_context = {self.max_context}",
                                 total)
        return prompt

    def has_context(self, session_id: str) -> bool:
        """Whether the session already holds a conversation (a text turn then adds no BOS)."""
        session = self.sessions.get(session_id)
        return session is not None and bool(session.record.tokens)

    def bind(self, request: Request) -> None:
        """The loop took `request`, a turn: its session is busy until the turn is released."""
        session = self.sessions.get(request.session_id or "")
        if session is None:
            return
        session.turn = request
        session.last_active = self.clock()

    def on_released(self, request: Request) -> None:
        """A release observer: a turn reached RELEASED (any path), its session is free again."""
        if request.session_id is None:
            return
        session = self.sessions.get(request.session_id)
        if session is not None and session.turn is request:
            session.turn = None
            session.last_active = self.clock()

    # ------------------------------------------------------------ endings
    def close(self, session_id: Any) -> bool:
        """Queue `session_id` to close at the loop's next iteration; False if it is not open
        (or already closing). It takes no new turn from now on."""
        if not isinstance(session_id, str) or session_id not in self.sessions:
            return False
        if any(sid == session_id for sid, _ in self._closing):
            return False
        self._closing.append((session_id, FinishReason.STOP))
        return True

    def expire(self, now: float) -> bool:
        """Apply queued closes and expired leases; True if a session was released."""
        if not self.sessions:
            self._closing.clear()
            return False
        ending = self._closing
        self._closing = []
        ending += [(sid, FinishReason.DEADLINE) for sid, s in self.sessions.items() if s.expires_at() <= now]
        for session_id, reason in ending:
            self._end(session_id, reason)
        return bool(ending)

    def shutdown(self) -> None:
        """Release every session (the engine is stopping, or its loop died)."""
        self._closing.clear()
        for session_id in list(self.sessions):
            self._end(session_id, FinishReason.SHUTDOWN)

    def next_due(self) -> float | None:
        """When the loop must look again without traffic: a queued close now, else the next expiry."""
        if self._closing:
            return self.clock()
        return min((s.expires_at() for s in self.sessions.values()), default=None)

    def _end(self, session_id: str, reason: FinishReason) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        # NOTE: an anchor holds no fenced memory, so it is released at once; finish never refuses
        self.gateway.finish(session.anchor, reason)  # and its release

    # ------------------------------------------------------------ reading
    def info(self, session_id: str) -> SessionInfo | None:
        session = self.sessions.get(session_id)
        if session is None:
            return None
        record = session.record
        return SessionInfo(session_id, session.idle_timeout, record.max_pages, len(record.tokens),
                           record.kept_pages * self.page_size, record.kept_pages, record.turns,
                           session.turn is not None, max(0.0, session.expires_at() - self.clock()))

    def num_turns_in_flight(self) -> int:
        return sum(s.turn is not None for s in self.sessions.values())

    def _store(self) -> SessionStore:
        if self.store is None:
            raise InvalidRequest("EngineConfig.max_sessions", "> 0 to open sessions", 0)
        return self.store
