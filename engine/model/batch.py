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
    #: speculative decoding: how many draft tokens this row may verify (its KV slots are held)
    draft_budget: int = 0
    #: the draft tokens the row computes after the request's own tokens (the proposer fills them
    #: in; `num_tokens` counts them). The row samples every position from the request's last
    #: token on: a verify row's last token and each draft; a draft model's pass, its last draft
    draft: tuple[int, ...] = ()


@runtime_checkable
class MakesFences(Protocol):
    """An attention backend whose step starts copies (HiSparse's host backups): it lists each
    copy's fence with its request, and the step's output carries them back to the loop."""

    @property
    def fences(self) -> Sequence[tuple[Request, Fence]]: ...


def row_tokens(s: ScheduledSeq) -> list[int]:
    """The token ids of a batch row: the request's own, then the row's draft tokens."""
    end = s.start + s.num_tokens
    if not s.draft:
        return token_range(s.request, s.start, end)
    return token_range(s.request, s.start, end - len(s.draft)) + list(s.draft)


def token_range(request: Request, start: int, end: int) -> list[int]:
    """Token ids [start, end) of the request's prompt followed by its output."""
    prompt = request.prompt_token_ids
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return request.output_token_ids[start - p : end - p]
    return prompt[start:] + request.output_token_ids[: end - p]
