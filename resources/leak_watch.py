"""When the leak check runs while an engine serves, and what a starved request waits for.

The check (`ledger.check_memory`'s problems) holds busy or idle: every pool
adds up (free + evictable + held == capacity, held being what live requests
hold in the ledger plus what the pool holds shared for them), so units a
pool reports as used that no live request holds are a leak whatever the
engine is doing; idle, nothing but quarantine is held. `LeakWatch` runs it:

- when the engine goes idle (and again after releases that made it idle);
- while it is busy, at most every `interval` seconds (`BUSY_CHECK_INTERVAL`):
  a pool drained by a leaking hook keeps the engine from ever going idle,
  so an idle-only check would never see it;
- at once when a request starves (`check_now`), so its starvation record
  (`starvation_record`) says which pool it waits for and who holds that:
  each owner in the ledger, and the units no live request holds.

A failed check is counted, logged once per new finding (``memory.leak``),
and kept as `problems` until a check passes; it never raises into the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from resources.ledger import MemoryReport

log = structlog.get_logger("kvlife.memory")

#: seconds between two leak checks of a busy engine
BUSY_CHECK_INTERVAL = 1.0


class LeakWatch:
    """Runs `report()`'s leak check at idle, periodically while busy, and on demand.

    `counters` has `leak_checks` and `leak_check_failures` (the engine's stats), counted here."""

    def __init__(self, report: Callable[[], MemoryReport], *, enabled: bool, counters: Any,
                 interval: float = BUSY_CHECK_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self.report = report
        self.enabled = enabled
        self.counters = counters
        self.interval = interval
        self.clock = clock
        #: the latest failed check's problems; () once a check passes
        self.problems: tuple[str, ...] = ()
        self._checked_idle = True
        self._next_busy_check = 0.0

    @property
    def idle_checked(self) -> bool:
        """Whether the check has run since the engine last went idle."""
        return self._checked_idle

    def on_idle(self, *, recheck: bool) -> None:
        """The engine is idle: check once (again if `recheck`: something was released since)."""
        if not self.enabled or (self._checked_idle and not recheck):
            return
        self._checked_idle = True
        self.check_now()

    def on_busy(self) -> None:
        """The engine is busy: check if the interval has passed since the last busy check."""
        self._checked_idle = False
        now = self.clock()
        if self.enabled and now >= self._next_busy_check:
            self._next_busy_check = now + self.interval
            self.check_now()

    def check_now(self) -> MemoryReport:
        """Run the check now (when enabled) and return the report it read."""
        report = self.report()
        if not self.enabled:
            return report
        self.counters.leak_checks += 1
        problems = tuple(report.problems())
        if problems:
            self.counters.leak_check_failures += 1
            if problems != self.problems:
                log.error("memory.leak", pool=problems[0].split(":")[0], owners=list(problems), idle=report.idle)
        self.problems = problems
        return report


def _holders(report: MemoryReport, name: str) -> list[str]:
    stats = report.pools[name]
    if stats.error is not None:
        return [f"cannot be checked: {stats.error}"]
    holders = [owner.describe() for owner in report.owners.get(name, [])][:8]
    unowned = stats.capacity - stats.free - stats.evictable - stats.held
    if unowned > 0:
        holders.append(f"{unowned} {stats.unit} held by no live request (leaked)")
    return holders


def starvation_record(report: MemoryReport, request_id: str, waited_s: float) -> dict[str, Any]:
    """What a request waiting past the starvation bound waits for: the pools with nothing free or
    evictable (else every pool in use), their numbers, and who holds them."""
    dry = [n for n, s in report.pools.items() if s.error is not None or (s.capacity and s.free + s.evictable == 0)]
    waiting_for = dry or [n for n, s in report.pools.items() if s.free + s.evictable < s.capacity]
    return {"request_id": request_id, "waited_s": round(waited_s, 3), "waiting_for": waiting_for,
            "pools": {n: {"free": report.pools[n].free, "evictable": report.pools[n].evictable,
                          "held": report.pools[n].held, "capacity": report.pools[n].capacity} for n in waiting_for},
            "holders": {n: _holders(report, n) for n in waiting_for},
            "leaks": list(report.problems())}
