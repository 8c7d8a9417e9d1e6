"""What happens to a body field no kvlife parser knows: ignored with one warning per field name,
unless its silent loss would change the answer (`engine.serve.unsupported_fields`): then a 400
naming it.

    unknown_field("", "no_stop_trim", False)          # ignored (one `http.ignored_field` warning)
    unknown_field("", "min_tokens", 5)                # InvalidRequest("min_tokens", "0 or absent (...)", 5)

`engine.serve.schemas.known_fields` calls it for every field outside a parser's known set, so a
field another parser learns later stops being "unknown" with no change here. The warning is
logged once per field name and location for the life of the process (list indices are folded:
``messages[].reasoning_content``), so a router that adds the same fields to every request does
not flood the log; `ignored_counts()` keeps how often each was seen.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import structlog

from engine.errors import InvalidRequest
from engine.serve.unsupported_fields import table_for

log = structlog.get_logger("kvlife.http")
_INDEX = re.compile(r"\[\d+\]")
_MAX_NAMES = 1024  # NOTE: clients choose the names; past this many, new names are neither counted nor warned
_ignored: Counter[str] = Counter()


def unknown_field(prefix: str, name: str, value: Any) -> None:
    """Refuse `prefix + name` if it is unsupported at a value that changes the answer, else ignore it."""
    unsupported = table_for(prefix).get(name)
    if unsupported is not None and not unsupported.allows(value):
        raise InvalidRequest(f"{prefix}{name}", unsupported.limit(), value)
    key = _INDEX.sub("[]", f"{prefix}{name}")
    if key not in _ignored and len(_ignored) >= _MAX_NAMES:
        return
    _ignored[key] += 1
    if _ignored[key] == 1:
        log.warning("http.ignored_field", field=key,
                    detail="not used by this server; the request is served without it (logged once per field)")


def ignored_counts() -> dict[str, int]:
    """How many times each ignored field name was seen in this process."""
    return dict(_ignored)
