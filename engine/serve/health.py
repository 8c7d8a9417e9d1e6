"""``GET /health_generate``: healthy means the engine makes progress, not that a slot is free.

    status, body = await health_generate(ctx)

1. `engine.health(stuck_after=health_timeout)` first, which runs no request:
   503 with its reason when the engine is ``dead`` (not running, or its
   loop died), ``leaking`` (its last idle leak check failed), ``starved``
   (a request that fits has waited too long for memory) or ``stuck``
   (requests are live but no step finished and no token came for
   `health_timeout` seconds).
2. Busy (a request waits, or every running slot is taken): a probe would
   only queue behind the traffic, so none is sent; the engine is healthy
   because step 1 saw it make progress. ``"checked": "progress"``.
3. Idle enough to admit: `engine.health_check()`, a one-token request
   through the whole path (counted apart from traffic): 200, or 503
   ``stuck`` (no token in time) or ``failing`` (it finished with an error).
   ``"checked": "request"``.

The body is ``{"status": "ok" | "unhealthy", "reason", "checked",
"last_progress_age_s"}``, with ``detail`` when unhealthy.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from engine.errors import EngineClosed, EngineOverloaded, HealthCheckFailed, HealthCheckTimeout, InvalidRequest
from states import RequestState

log = structlog.get_logger("kvlife.http")
_WAITING = (RequestState.QUEUED, RequestState.RETRACTED)
_DONE = (RequestState.FINISHED, RequestState.RELEASED)


def _progress_age(ctx: Any) -> float:
    last = ctx.engine.stats.last_progress
    return time.monotonic() - (ctx.started_at if last is None else max(last, ctx.started_at))


def _unhealthy(reason: str, detail: str, age: float, checked: str) -> tuple[int, dict[str, Any]]:
    log.warning("health.unhealthy", reason=reason, detail=detail, last_progress_age_s=round(age, 3))
    return 503, {"status": "unhealthy", "reason": reason, "detail": detail, "checked": checked,
                 "last_progress_age_s": round(age, 3)}


def _ok(age: float, checked: str) -> tuple[int, dict[str, Any]]:
    return 200, {"status": "ok", "reason": "ok", "checked": checked, "last_progress_age_s": round(age, 3)}


async def health_generate(ctx: Any) -> tuple[int, dict[str, Any]]:
    engine, timeout = ctx.engine, ctx.settings.health_timeout
    age = _progress_age(ctx)
    if not engine.running:
        return _unhealthy("dead", "the engine is not running", age, "state")
    report = engine.health(stuck_after=timeout)
    if not report.healthy:
        return _unhealthy(report.reason, report.detail, age, "state")
    by_state = engine.requests_by_state()
    waiting = sum(by_state.get(state, 0) for state in _WAITING)
    running = sum(n for state, n in by_state.items() if state not in _WAITING and state not in _DONE)
    if waiting or running >= engine.config.max_running:
        return _ok(age, "progress")
    try:
        await engine.health_check(timeout=timeout)
    except HealthCheckFailed as exc:
        reason = "stuck" if isinstance(exc, HealthCheckTimeout) else "failing"
        return _unhealthy(reason, str(exc), _progress_age(ctx), "request")
    except (EngineClosed, EngineOverloaded, InvalidRequest) as exc:
        return _unhealthy("dead" if isinstance(exc, EngineClosed) else "failing", str(exc), age, "request")
    return _ok(_progress_age(ctx), "request")
