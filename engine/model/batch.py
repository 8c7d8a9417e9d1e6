"""A step's batch row: which tokens of which request one model step computes;
and what an attention backend hands back besides its output: the fences of the
copies its step started.

The scheduler (`engine.runtime.scheduler`) builds a batch of these; the model
runner reads them; the step applier turns the step's output back into the
requests' progress. Defined here, below both, so the runner never imports the
runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from states import Fence, Request


@attrs.define
class ScheduledSeq:
    """One request's share of a step: tokens [start, start + num_tokens)."""

    request: Request
    start: int
    num_tokens: int
    #: this step produces the request's next token (decode, or the last prefill chunk)
    samples: bool


@runtime_checkable
class MakesFences(Protocol):
    """An attention backend whose step starts copies (HiSparse's host backups): it lists each
    copy's fence with its request, and the step's output carries them back to the loop."""

    @property
    def fences(self) -> Sequence[tuple[Request, Fence]]: ...
