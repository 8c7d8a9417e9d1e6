"""Counting hooks, paths through the state table and drivers shared by the machine's tests."""

from __future__ import annotations

from resources import ResourceHook, order_hooks
from states import (
    HELD_STATES,
    TRANSITIONS,
    FinishReason,
    Handle,
    Request,
    RequestMachine,
    RequestState,
)

S = RequestState
KV_SCOPE = frozenset({S.TRANSFERRING, S.PREFILLING, S.PREBUILT, S.STAGING, S.DECODING, S.FINISHED})
#: The built-in release order of docs/architecture.md.
ORDER = ["moe", "hisparse", "kv", "mm", "timing"]

#: One way to reach each state from QUEUED, plus the other ways to reach RELEASED.
PATHS = {
    S.QUEUED: [S.QUEUED],
    S.TRANSFERRING: [S.QUEUED, S.TRANSFERRING],
    S.PREFILLING: [S.QUEUED, S.PREFILLING],
    S.PREBUILT: [S.QUEUED, S.PREFILLING, S.PREBUILT],
    S.STAGING: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.STAGING],
    S.DECODING: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING],
    S.RETRACTED: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.RETRACTED],
    S.FINISHED: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.FINISHED],
    S.RELEASED: [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.FINISHED, S.RELEASED],
}
EXTRA_PATHS = {
    "transfer-prebuilt": [S.QUEUED, S.TRANSFERRING, S.PREBUILT],
    "staging-decoding": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.STAGING, S.DECODING],
    "staging-retracted": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.STAGING, S.RETRACTED],
    "retract-requeue": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.RETRACTED, S.QUEUED],
    "requeue-decode": [S.QUEUED, S.PREFILLING, S.PREBUILT, S.DECODING, S.RETRACTED, S.QUEUED,
                       S.PREFILLING, S.PREBUILT, S.DECODING],
}
LEGAL = sorted(((a, b) for a, bs in TRANSITIONS.items() for b in bs), key=lambda e: (e[0].name, e[1].name))
ILLEGAL = [(a, b) for a in RequestState for b in RequestState if b not in TRANSITIONS[a]]


class CountingHook(ResourceHook):
    """A hook whose pool is a counter of handles out."""

    def __init__(self, name, acquire_on, scope=HELD_STATES, *, before=(), after=()) -> None:
        super().__init__()
        self.name, self.pool = name, name
        self.acquire_on, self.scope = frozenset(acquire_on), frozenset(scope)
        self.before, self.after = tuple(before), tuple(after)
        self.held = 0
        self.release_calls = 0
        self.fail_acquire: Exception | None = None
        self.fail_release = False

    def acquire(self, request, into):
        if self.fail_acquire is not None:
            raise self.fail_acquire
        self.held += 1
        return Handle(self.name, request.request_id, amount=1)

    def release(self, request, handle):
        self.release_calls += 1
        if self.fail_release:
            raise RuntimeError(f"{self.name} release broke")
        self.held -= 1


def make_hooks() -> dict[str, CountingHook]:
    """Five hooks shaped like the built-ins, registered out of order; ordered by constraints."""
    hooks = [
        CountingHook("timing", {S.QUEUED}, after=("mm",)),
        CountingHook("kv", {S.PREFILLING, S.TRANSFERRING}, KV_SCOPE),
        CountingHook("mm", {S.QUEUED}, after=("kv",)),
        CountingHook("hisparse", {S.PREBUILT}, KV_SCOPE - {S.TRANSFERRING, S.PREFILLING}, before=("kv",)),
        CountingHook("moe", {S.QUEUED}, before=("hisparse",)),
    ]
    return {h.name: h for h in order_hooks(hooks)}


def make_machine(hooks=None, **kw) -> RequestMachine:
    """A machine over these hooks (in their order), or none."""
    return RequestMachine(list((hooks or {}).values()), **kw)


def step(machine: RequestMachine, req: Request, dst: RequestState) -> None:
    """One move to `dst`, through finish or try_release where the table says so."""
    if dst is S.FINISHED:
        assert machine.finish(req, FinishReason.ABORT)
    elif dst is S.RELEASED:
        assert machine.try_release(req)
    else:
        machine.advance(req, dst)


def drive(machine: RequestMachine, path: list[RequestState], rid: str = "r1") -> Request:
    """A new request started and moved along `path` (which begins at QUEUED)."""
    req = Request(rid, [1, 2, 3], None)
    machine.start(req)
    for dst in path[1:]:
        step(machine, req, dst)
    assert req.state is path[-1]
    return req


def expected_held(hooks: dict[str, CountingHook], path: list[RequestState]) -> list[str]:
    """The hooks the scopes say a request holds at the end of `path`, in release order."""
    held: set[str] = set()
    for state in path:
        held = {n for n in held if state in hooks[n].scope}
        held |= {n for n, h in hooks.items() if state in h.acquire_on}
    return [n for n in ORDER if n in held]


def events(logs, *names) -> list[tuple]:
    """The captured log events named `names`: (event, src, dst) for transitions, (event, resource) otherwise."""
    return [
        (e["event"], e["src"], e["dst"]) if e["event"] == "request.transition" else (e["event"], e["resource"])
        for e in logs
        if e["event"] in names
    ]


def finish_all(machine: RequestMachine, req: Request) -> None:
    """Finish and release `req` wherever it is, so no counting hook stays held."""
    if req.state is not S.RELEASED:
        machine.finish(req, FinishReason.SHUTDOWN)
        machine.try_release(req)
