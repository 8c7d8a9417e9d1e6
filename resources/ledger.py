"""The ownership ledger, pool statistics, and the leak check.

The machine records in the ledger who holds how much of every pool: after
each acquisition, growth, release and quarantine (hooks never write it).
Owners are request *objects*, so a request id reused after a quarantine can
never touch another request's holdings. A pool reports only its own view
(`PoolUsage`: capacity, free, what it could evict, what it holds on behalf of
requests, such as locked prefix pages); the ledger's view (what requests
hold) is independent, which is what makes the check worth having::

    free + evictable + held == capacity        (always, for every pool)
    held == quarantined + kept                 (when the engine is idle)

where held = what the ledger says requests hold + what the pool holds
shared, and kept = what the pool keeps for live sessions (issue 21). The
first holds whether the engine is busy or idle: units a pool reports as used
that no live request holds are a leak either way (`resources.leak_watch` runs
the check while busy too). `LeakError` names the pool, the amount and every
owner with its state and finish reason, so a leak says who leaked. A pool
whose `stats()` raises cannot be checked: it is a problem of the check too
(`PoolStats.error`, `MemoryReport.unchecked`), never read as an empty pool
that adds up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import attrs
import structlog

from states import Request, RequestState

log = structlog.get_logger("kvlife.memory")
_RECENT = 8


@attrs.frozen
class PoolUsage:
    """What a pool says about itself (the ledger adds what requests hold).

    `evictable`: units nobody owns that the pool may evict (unlocked prefix
    pages, unreferenced cached embeddings). `shared`: units the pool holds on
    behalf of requests without any one request owning them (prefix pages a
    running request has locked, referenced embeddings). `kept`: of the held
    units, those kept for live sessions (issue 21: a session's slot and its
    kept KV), which stay held while the engine is idle.
    """

    capacity: int
    free: int
    evictable: int = 0
    shared: int = 0
    unit: str = "items"
    kept: int = 0


@attrs.frozen
class PoolStats:
    """One pool in a memory report: the pool's view and the ledger's, combined."""

    capacity: int
    free: int
    evictable: int
    held: int
    quarantined: int = 0
    suspect: bool = False
    unit: str = "items"
    #: held for live sessions (issue 21): allowed while idle
    kept: int = 0
    #: why the pool cannot be checked (its `stats()` raised; capacity, free and evictable are then
    #: unknown and shown as 0), or None
    error: str | None = None

    @property
    def adds_up(self) -> bool:
        """The pool's own numbers and the ledger's agree (never, when they could not be read)."""
        return self.error is None and self.free + self.evictable + self.held == self.capacity


@attrs.frozen
class Owner:
    request_id: str
    state: RequestState | None
    finish_reason: Any
    amount: int
    quarantined: bool = False

    def describe(self) -> str:
        state = self.state.name if self.state else "?"
        reason = self.finish_reason.name if self.finish_reason else "-"
        tag = " quarantined" if self.quarantined else ""
        return f"{self.request_id} ({state}, {reason}) {self.amount}{tag}"

    @classmethod
    def of(cls, request: Request, amount: int, quarantined: bool = False) -> Owner:
        return cls(request.request_id, request.state, request.finish_reason, amount, quarantined)


class Pool(Protocol):
    """What the leak check needs from a pool (a plugin's pool too).

    `stats()` reports capacity and free (and evictable/shared when the pool
    has them); the ledger supplies held, quarantined and suspect. A pool may
    also have `shared_owners() -> list[Owner]` naming who its shared units
    are held for.
    """

    name: str

    def stats(self) -> PoolUsage: ...


class Ledger:
    """pool name -> owner request -> amount held (and how many handles), plus quarantined amounts."""

    def __init__(self) -> None:
        self._held: dict[str, dict[Request, list[int]]] = {}  # [amount, handles]
        self._totals: dict[str, int] = {}
        self._quarantined: dict[str, dict[Request, int]] = {}
        #: per pool, the latest releases (request id, amount): a pool that stops adding up
        #: after a release that freed too little names who it was
        self.recent: dict[str, deque[tuple[str, int]]] = {}
        self.suspect: set[str] = set()

    # ------------------------------------------------- written by the machine
    def hold(self, pool: str, owner: Request, amount: int) -> None:
        """One more handle of `owner` in `pool`, holding `amount`."""
        entry = self._held.setdefault(pool, {}).setdefault(owner, [0, 0])
        entry[0] += amount
        entry[1] += 1
        self._totals[pool] = self._totals.get(pool, 0) + amount

    def adjust(self, pool: str, owner: Request, delta: int) -> None:
        """A held handle grew (or shrank) by `delta`."""
        entry = self._held.get(pool, {}).get(owner)
        if entry is None:
            log.error("ledger.unknown_owner", pool=pool, request_id=owner.request_id, delta=delta)
            self.suspect.add(pool)
            return
        entry[0] += delta
        self._totals[pool] = self._totals.get(pool, 0) + delta

    def drop(self, pool: str, owner: Request, amount: int) -> None:
        """One handle of `owner` in `pool`, holding `amount`, was released."""
        owners = self._held.get(pool, {})
        entry = owners.get(owner)
        if entry is None or entry[0] < amount:
            # NOTE: never raise inside a release sequence: record the inconsistency instead
            log.error("ledger.drop_mismatch", pool=pool, request_id=owner.request_id, amount=amount,
                      held=None if entry is None else entry[0])
            self.suspect.add(pool)
            if entry is None:
                return
            amount = entry[0]
        entry[0] -= amount
        entry[1] -= 1
        self._totals[pool] = self._totals.get(pool, 0) - amount
        if entry[1] <= 0:
            del owners[owner]
        self.recent.setdefault(pool, deque(maxlen=_RECENT)).append((owner.request_id, amount))

    def quarantine(self, pool: str, owner: Request, amount: int) -> None:
        """`amount` of what `owner` holds in `pool` is quarantined (still held)."""
        q = self._quarantined.setdefault(pool, {})
        q[owner] = q.get(owner, 0) + amount

    def unquarantine(self, pool: str, owner: Request, amount: int) -> None:
        """A quarantined `amount` is about to be released (its fence completed)."""
        q = self._quarantined.get(pool, {})
        left = q.get(owner, 0) - amount
        if left > 0:
            q[owner] = left
        else:
            q.pop(owner, None)

    def mark_suspect(self, pool: str) -> None:
        self.suspect.add(pool)

    # ------------------------------------------------------------- readers
    def held(self, pool: str) -> int:
        return self._totals.get(pool, 0)

    def quarantined(self, pool: str) -> int:
        return sum(self._quarantined.get(pool, {}).values())

    def holding(self, pool: str, owner: Request) -> int:
        entry = self._held.get(pool, {}).get(owner)
        return 0 if entry is None else entry[0]

    def owners(self, pool: str) -> list[Owner]:
        quarantined = self._quarantined.get(pool, {})
        return [Owner.of(request, amount, quarantined=request in quarantined)
                for request, (amount, _handles) in self._held.get(pool, {}).items()]

    @property
    def num_tracked_requests(self) -> int:
        """Distinct requests holding anything in any pool."""
        return len({request for owners in self._held.values() for request in owners})


class LeakError(Exception):
    """A pool does not add up, or something is held while the engine is idle."""

    def __init__(self, problems: list[str], report: MemoryReport) -> None:
        super().__init__("memory leak detected: " + "; ".join(problems))
        self.problems = problems
        self.report = report


@attrs.frozen
class MemoryReport:
    """Every pool's stats and owners at one moment.

    `idle`: no request outside RELEASED. `leaks_found` counts the idle leak
    checks that failed so far, `last_leak` holds the latest one's problems;
    `starved` names requests waiting past the starvation bound (with the
    pool they wait for), filled in by the engine.
    """

    idle: bool
    pools: dict[str, PoolStats]
    owners: dict[str, list[Owner]]
    live_requests: int = 0
    leaks_found: int = 0
    last_leak: tuple[str, ...] = ()
    starved: tuple[dict[str, Any], ...] = ()
    #: per pool, the latest releases into it (request id, amount), newest last
    recent_releases: dict[str, tuple[tuple[str, int], ...]] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "idle": self.idle,
            "live_requests": self.live_requests,
            "leaks_found": self.leaks_found,
            "last_leak": list(self.last_leak),
            "starved": list(self.starved),
            "pools": {name: attrs.asdict(s) | {"adds_up": s.adds_up} for name, s in self.pools.items()},
            "unchecked": self.unchecked,
            "owners": {
                name: [attrs.asdict(o, value_serializer=_enum_name) for o in owners]
                for name, owners in self.owners.items()
                if owners
            },
        }

    @property
    def unchecked(self) -> dict[str, str]:
        """The pools that cannot be checked, with why (their `stats()` raised)."""
        return {name: stats.error for name, stats in self.pools.items() if stats.error is not None}

    def problems(self) -> list[str]:
        """What the leak check would report, empty when everything adds up: the pools that cannot be
        checked, then the leaks (`leaks()`)."""
        unchecked = [f"{name}: cannot be checked: its stats() raised {error} (held by requests: "
                     f"{self.pools[name].held} {self.pools[name].unit}; owners: {self._owners(name)})"
                     for name, error in self.unchecked.items()]
        return unchecked + self.leaks()

    def leaks(self) -> list[str]:
        """The pools that do not add up, or hold something while idle (of those that could be read)."""
        leaks = []
        for name, stats in self.pools.items():
            if stats.error is not None:
                continue
            if not stats.adds_up:
                recent = ", ".join(f"{rid} ({amount})" for rid, amount in self.recent_releases.get(name, ()))
                leaks.append(f"{name}: free {stats.free} + evictable {stats.evictable} + held {stats.held}"
                             f" != capacity {stats.capacity} (owners: {self._owners(name)}; latest releases: "
                             f"{recent or 'none'})")
            elif self.idle and stats.held != stats.quarantined + stats.kept:
                leaks.append(f"{name}: {stats.held - stats.quarantined - stats.kept} {stats.unit} held while idle"
                             f" (owners: {self._owners(name)})")
        return leaks

    def _owners(self, name: str) -> str:
        return ", ".join(o.describe() for o in self.owners.get(name, [])) or "no recorded owner"


def _enum_name(_inst: Any, _field: Any, value: Any) -> Any:
    return getattr(value, "name", value)


def _own_ledger(pool: Pool, ledger: Ledger) -> tuple[Ledger, str]:
    """The ledger and pool name that account `pool` (a view of another engine's pool,
    such as a prefill worker's, carries its own)."""
    return getattr(pool, "ledger", None) or ledger, getattr(pool, "ledger_name", pool.name)


def _pool_stats(pool: Pool, ledger: Ledger) -> PoolStats:
    name = pool.name
    ledger, accounted = _own_ledger(pool, ledger)
    try:
        usage: PoolUsage = pool.stats()
        capacity, free, evictable, shared, unit = usage.capacity, usage.free, usage.evictable, usage.shared, usage.unit
        kept = usage.kept
    except Exception as exc:  # a plugin's broken stats() is reported, never raised from the check
        log.error("memory.stats_failed", pool=name, error=repr(exc))
        ledger.mark_suspect(accounted)
        return PoolStats(capacity=0, free=0, evictable=0, held=ledger.held(accounted),
                         quarantined=ledger.quarantined(accounted), suspect=True, error=repr(exc))
    return PoolStats(capacity=capacity, free=free, evictable=evictable, held=ledger.held(accounted) + shared,
                     quarantined=ledger.quarantined(accounted), suspect=accounted in ledger.suspect, unit=unit,
                     kept=kept)


def _pool_owners(pool: Pool, ledger: Ledger) -> list[Owner]:
    ledger, accounted = _own_ledger(pool, ledger)
    owners = ledger.owners(accounted)
    shared = getattr(pool, "shared_owners", None)
    if shared is not None:
        try:
            owners += shared()
        except Exception as exc:
            log.error("memory.owners_failed", pool=pool.name, error=repr(exc))
    return owners


def memory_report(pools: Iterable[Pool], ledger: Ledger, *, idle: bool, **extra: Any) -> MemoryReport:
    pools = list(pools)
    recent = {}
    for p in pools:
        own, accounted = _own_ledger(p, ledger)
        recent[p.name] = tuple(own.recent.get(accounted, ()))
    return MemoryReport(idle=idle, pools={p.name: _pool_stats(p, ledger) for p in pools},
                        owners={p.name: _pool_owners(p, ledger) for p in pools}, recent_releases=recent, **extra)


def check_memory(pools: Iterable[Pool], ledger: Ledger, *, idle: bool, **extra: Any) -> MemoryReport:
    """Build the report; raise LeakError naming pool, amount and owners on any problem."""
    report = memory_report(pools, ledger, idle=idle, **extra)
    problems = report.problems()
    if problems:
        log.error("memory.leak", pool=problems[0].split(":")[0], owners=problems)
        raise LeakError(problems, report)
    return report
