"""Readiness and liveness, apart, as Kubernetes and routers probe them. Neither runs a request.

    status, body = readiness(ctx)      # GET /health
    status, body = liveness(ctx)       # GET /live

- **Readiness** (``/health``, what SGLang Model Gateway and a Kubernetes readinessProbe call):
  200 ``{"status": "ok"}`` only while the engine can admit a request: it runs, its loop is alive,
  its last idle leak check was clean, no request is starving for memory, live requests are making
  progress (within ``--health-timeout``) and, for a decode with remote prefills, a prefill peer is
  up (`Engine.health()`). Else 503 ``{"status": "unavailable", "reason", "detail"}`` with the
  reason `Engine.health()` gives (``dead``, ``leaking``, ``no_prefill``, ``starved``, ``stuck``),
  or ``{"status": "stopping"}`` once SIGTERM was received (new requests would get 503).
- **Liveness** (``/live``, a livenessProbe): 200 ``{"status": "alive"}`` while the process serves
  HTTP and the engine's loop has not died, draining included (so a restart never cuts a drain
  short); 503 ``{"status": "dead"}`` otherwise. A dead loop also makes `kvlife serve` exit 1, so a
  restart policy acts even without a probe.

``/health_generate`` (engine.serve.health) stays the deeper check: progress, or a one-token probe
when idle.
"""

from __future__ import annotations

from typing import Any


def readiness(ctx: Any) -> tuple[int, dict[str, Any]]:
    engine = ctx.engine
    if ctx.draining:
        return 503, {"status": "stopping"}
    if not engine.running:
        return 503, {"status": "unavailable", "reason": "dead", "detail": "the engine is not running"}
    report = engine.health(stuck_after=ctx.settings.health_timeout)
    if not report.healthy:
        return 503, {"status": "unavailable", "reason": report.reason, "detail": report.detail}
    return 200, {"status": "ok"}


def liveness(ctx: Any) -> tuple[int, dict[str, Any]]:
    engine = ctx.engine
    if engine.errored is not None or not (engine.running or ctx.draining):
        return 503, {"status": "dead"}
    return 200, {"status": "alive"}
