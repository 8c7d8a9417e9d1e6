"""The errors for bad input and the field validators every config uses.

Pure Python like the rest of `states`, so `hisparse` and `engine` validate
with the same code and raise the same types (`engine.errors` re-exports
them). Every message names the field and the limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    """A configuration field is invalid (same shape as InvalidRequest)."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require(ok: bool, error: type[InvalidRequest], field: str, limit: str, value: Any) -> None:
    if not ok:
        raise error(field, limit, value)


def int_at_least(low: int, error: type[InvalidRequest] = InvalidConfig) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: an integer >= `low` (not a bool), else `error` naming Class.field."""

    def check(inst: Any, attribute: Any, value: Any) -> None:
        require(is_int(value) and value >= low, error, f"{type(inst).__name__}.{attribute.name}",
                f"an integer >= {low}", value)

    return check


def optional_int_at_least(low: int, error: type[InvalidRequest] = InvalidConfig) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: None or an integer >= `low`."""

    def check(inst: Any, attribute: Any, value: Any) -> None:
        require(value is None or (is_int(value) and value >= low), error, f"{type(inst).__name__}.{attribute.name}",
                f"None or an integer >= {low}", value)

    return check


def number_above(low: float, error: type[InvalidRequest] = InvalidConfig) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: a finite number > `low`."""

    def check(inst: Any, attribute: Any, value: Any) -> None:
        require(is_number(value) and value > low, error, f"{type(inst).__name__}.{attribute.name}",
                f"a finite number > {low}", value)

    return check


def number_at_least(low: float, error: type[InvalidRequest] = InvalidConfig) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: a finite number >= `low`."""

    def check(inst: Any, attribute: Any, value: Any) -> None:
        require(is_number(value) and value >= low, error, f"{type(inst).__name__}.{attribute.name}",
                f"a finite number >= {low}", value)

    return check


def one_of(*choices: Any) -> Callable[[Any, Any, Any], None]:
    def check(inst: Any, attribute: Any, value: Any) -> None:
        require(value in choices, InvalidConfig, f"{type(inst).__name__}.{attribute.name}", f"one of {choices}", value)

    return check


def is_bool(error: type[InvalidRequest] = InvalidConfig) -> Callable[[Any, Any, Any], None]:
    def check(inst: Any, attribute: Any, value: Any) -> None:
        require(isinstance(value, bool), error, f"{type(inst).__name__}.{attribute.name}", "a bool", value)

    return check
