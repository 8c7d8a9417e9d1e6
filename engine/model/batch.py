"""A step's batch row: which tokens of which request one model step computes.

The scheduler (`engine.runtime.scheduler`) builds a batch of these; the model
runner reads them; the step applier turns the step's output back into the
requests' progress. Defined here, below both, so the runner never imports the
runtime.
"""

from __future__ import annotations

import attrs

from states import Request


@attrs.define
class ScheduledSeq:
    """One request's share of a step: tokens [start, start + num_tokens)."""

    request: Request
    start: int
    num_tokens: int
    #: this step produces the request's next token (decode, or the last prefill chunk)
    samples: bool
