"""One-call structlog configuration: console for development, JSON lines for production.

    configure_logging(level="info", json=False)

Events are dotted nouns with fields (`request.transition` with request_id,
src, dst, reason). Below the configured level a call is a no-op method on a
filtering bound logger: no event dict is built and nothing is formatted.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at write time.

    NOTE: a logger factory keeps the stream it was given, so binding
    `sys.stderr` itself would keep writing to a stream that was swapped out
    (and closed) since, as pytest's capsys does.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def ensure_logging() -> None:
    """If the application has not configured structlog, log warnings and errors to
    stderr (structlog's own default prints every debug event to stdout)."""
    if not structlog.is_configured():
        configure_logging("warning")


#: the last `configure_logging` choice (level, json), for a child process that should log alike
_configured: tuple[str, bool] = ("warning", False)


def logging_configuration() -> tuple[str, bool]:
    """The level and format `configure_logging` was last called with (warning and console before)."""
    return _configured


def configure_logging(level: str = "info", *, json: bool = False, stream: TextIO | None = None) -> None:
    global _configured
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
    _configured = (level, json)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if json else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream or cast(TextIO, _CurrentStderr())),
        # NOTE: not cached: an embedding application (or a test) may reconfigure later.
        cache_logger_on_first_use=False,
    )
