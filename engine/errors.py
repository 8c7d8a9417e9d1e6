"""Errors the engine raises to its callers.

`InvalidRequest` and `InvalidConfig` are defined with the field validators in
`states.validation` (so `hisparse` raises the same types) and re-exported here.
"""

from __future__ import annotations

from states.validation import InvalidConfig, InvalidRequest

__all__ = ["EngineClosed", "EngineDead", "EngineOverloaded", "HealthCheckFailed", "HealthCheckTimeout",
           "InvalidConfig", "InvalidRequest"]


class EngineOverloaded(RuntimeError):
    """The engine's inbox is full; retry later."""


class EngineClosed(RuntimeError):
    """The engine is not running (not started, or shut down)."""


class EngineDead(RuntimeError):
    """The engine's loop died; `cause` is what killed it. Every open stream ends
    with this error and every new submission raises it."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the engine's loop died: {cause!r}")
        self.cause = cause


class HealthCheckFailed(RuntimeError):
    """A health-check request did not complete through the whole path."""


class HealthCheckTimeout(HealthCheckFailed):
    """A health-check request produced no token within its timeout (the engine may be stuck)."""
