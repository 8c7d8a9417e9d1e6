"""Errors the engine raises to its callers."""

from __future__ import annotations

from typing import Any


class InvalidRequest(ValueError):
    """A request (or its sampling parameters) is invalid; nothing was allocated.

    `field` names the offending field and `limit` states what it must satisfy.
    """

    def __init__(self, field: str, limit: str, value: Any = None) -> None:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field} must be {limit}, got {shown}")
        self.field = field
        self.limit = limit
        self.value = value


class InvalidConfig(InvalidRequest):
    """An engine configuration field is invalid (same shape as InvalidRequest)."""


class EngineOverloaded(RuntimeError):
    """The engine's inbox is full; retry later."""


class EngineClosed(RuntimeError):
    """The engine is not running (not started, or shut down)."""


class HealthCheckFailed(RuntimeError):
    """A health-check request did not complete through the whole path."""
