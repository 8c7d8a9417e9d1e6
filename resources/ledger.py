"""The ownership ledger, pool statistics, and the leak check.

Every pool records in the ledger who holds how much of it. A pool's own
view (its free list, the prefix cache's evictable pages) and the ledger's
view (what requests hold) are independent, which is what makes the check
worth having::

    free + evictable + held == capacity        (always, for every pool)
    held == quarantined                        (when the engine is idle)

`LeakError` names the pool, the amount and every owner with its state and
finish reason, so a leak says who leaked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import attrs
import structlog

from states import Request, RequestState

log = structlog.get_logger("kvlife.memory")


@attrs.frozen
class PoolStats:
    capacity: int
    free: int
    evictable: int
    held: int
    quarantined: int = 0
    suspect: bool = False
    unit: str = "items"

    @property
    def adds_up(self) -> bool:
        return self.free + self.evictable + self.held == self.capacity


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


class Pool(Protocol):
    """What the leak check needs from a pool."""

    name: str

    def stats(self) -> PoolStats: ...


class Ledger:
    """pool name -> owner request id -> amount held, plus quarantined amounts."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, int]] = {}
        self._totals: dict[str, int] = {}
        self._quarantined: dict[str, dict[str, int]] = {}
        self._requests: dict[str, Request] = {}
        self.suspect: set[str] = set()

    def hold(self, pool: str, request: Request, amount: int) -> None:
        if amount <= 0:
            return
        owners = self._held.setdefault(pool, {})
        owners[request.request_id] = owners.get(request.request_id, 0) + amount
        self._totals[pool] = self._totals.get(pool, 0) + amount
        self._requests[request.request_id] = request

    def drop(self, pool: str, request_id: str, amount: int | None = None) -> int:
        """Forget `amount` (default: all) held by `request_id` in `pool`; returns it."""
        owners = self._held.get(pool, {})
        have = owners.get(request_id, 0)
        amount = have if amount is None else amount
        if amount > have:
            raise ValueError(f"{request_id!r} drops {amount} from {pool!r} but holds {have}")
        if amount == have:
            owners.pop(request_id, None)
        else:
            owners[request_id] = have - amount
        self._totals[pool] = self._totals.get(pool, 0) - amount
        return amount

    def quarantine(self, pool: str, request_id: str) -> int:
        """Mark everything `request_id` holds in `pool` as quarantined (still held)."""
        amount = self._held.get(pool, {}).get(request_id, 0)
        if amount:
            q = self._quarantined.setdefault(pool, {})
            q[request_id] = q.get(request_id, 0) + amount
        return amount

    def held(self, pool: str) -> int:
        return self._totals.get(pool, 0)

    def quarantined(self, pool: str) -> int:
        return sum(self._quarantined.get(pool, {}).values())

    def request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def holding(self, pool: str, request_id: str) -> int:
        return self._held.get(pool, {}).get(request_id, 0)

    def owners(self, pool: str) -> list[Owner]:
        quarantined = self._quarantined.get(pool, {})
        out = []
        for rid, amount in self._held.get(pool, {}).items():
            req = self._requests.get(rid)
            out.append(
                Owner(
                    rid,
                    req.state if req else None,
                    req.finish_reason if req else None,
                    amount,
                    quarantined=rid in quarantined,
                )
            )
        return out

    def forget_request(self, request_id: str) -> None:
        """Drop the back-reference once a request holds nothing anywhere."""
        if not any(request_id in owners for owners in self._held.values()):
            self._requests.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)


class LeakError(Exception):
    """A pool does not add up, or something is held while the engine is idle."""

    def __init__(self, problems: list[str], report: "MemoryReport") -> None:
        super().__init__("memory leak detected: " + "; ".join(problems))
        self.problems = problems
        self.report = report


@attrs.frozen
class MemoryReport:
    idle: bool
    pools: dict[str, PoolStats]
    owners: dict[str, list[Owner]]
    live_requests: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "idle": self.idle,
            "live_requests": self.live_requests,
            "pools": {name: attrs.asdict(s) | {"adds_up": s.adds_up} for name, s in self.pools.items()},
            "owners": {
                name: [attrs.asdict(o, value_serializer=_enum_name) for o in owners]
                for name, owners in self.owners.items()
                if owners
            },
        }


def _enum_name(_inst: Any, _field: Any, value: Any) -> Any:
    return getattr(value, "name", value)


def memory_report(pools: Iterable[Pool], ledger: Ledger, *, idle: bool, live_requests: int = 0) -> MemoryReport:
    pools = list(pools)
    return MemoryReport(
        idle=idle,
        pools={p.name: p.stats() for p in pools},
        owners={p.name: p.owners() if hasattr(p, "owners") else ledger.owners(p.name) for p in pools},
        live_requests=live_requests,
    )


def check_memory(pools: Iterable[Pool], ledger: Ledger, *, idle: bool, live_requests: int = 0) -> MemoryReport:
    """Build the report; raise LeakError naming pool, amount and owners on any problem."""
    report = memory_report(pools, ledger, idle=idle, live_requests=live_requests)
    problems = []
    for name, stats in report.pools.items():
        owners = ", ".join(o.describe() for o in report.owners[name]) or "no recorded owner"
        if not stats.adds_up:
            problems.append(
                f"{name}: free {stats.free} + evictable {stats.evictable} + held {stats.held}"
                f" != capacity {stats.capacity} (owners: {owners})"
            )
        elif idle and stats.held != stats.quarantined:
            problems.append(
                f"{name}: {stats.held - stats.quarantined} {stats.unit} held while idle (owners: {owners})"
            )
    if problems:
        log.error("memory.leak", pool=problems[0].split(":")[0], owners=problems)
        raise LeakError(problems, report)
    return report
