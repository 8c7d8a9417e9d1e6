"""What a request carries besides its prompt and sampling parameters (issue 21).

    engine.generate(prompt, params, priority=-1, deadline=2.5)           # runs first; done within 2.5 s
    engine.generate(new_tokens, params, session=session_id)              # a turn of a session
    engine.generate(prompt_ids, SamplingParams(max_new_tokens=r), resume_output_ids=done_so_far)

- `priority`: an integer, lower runs first (vLLM's convention), 0 by default.
- `deadline`: seconds from submission after which the request finishes
  with `FinishReason.DEADLINE`, whatever state it is in (None: none).
- `session`: the id of an open session; the prompt is this turn's new tokens.
- `resume_output_ids`: token-level continuation. The tokens this request
  already generated elsewhere (an interrupted instance); the prompt is the
  original prompt and `max_new_tokens` the remaining budget. The request
  computes prompt + these tokens (prefix-cache hits included) and generates
  what the uninterrupted request would have: greedy exactly, and seeded too,
  since a seeded token is drawn from (seed, output position) and the
  positions continue from ``len(resume_output_ids)``. An unseeded random
  request cannot resume its random stream (its tokens are a fresh draw).
  Its outputs' `token_ids` and `text` include the resumed tokens;
  `new_token_ids` and `new_text` carry only what this engine generated.

Validated here, before anything is allocated, with `InvalidRequest` naming
the field and the limit; `apply` sets the requests' fields.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from engine.errors import InvalidRequest

#: priorities are any integers in this range (vLLM takes any int)
PRIORITY_BOUND = 2**31


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen
class SubmitOptions:
    priority: int = 0
    deadline: float | None = None
    session: str | None = None
    resume_output_ids: tuple[int, ...] = ()

    @classmethod
    def build(cls, *, priority: Any = 0, deadline: Any = None, session: Any = None,
              resume_output_ids: Any = None) -> SubmitOptions:
        if not _is_int(priority) or not -PRIORITY_BOUND <= priority < PRIORITY_BOUND:
            raise InvalidRequest("priority", "an integer in [-2**31, 2**31)", priority)
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not (math.isfinite(deadline) and deadline > 0)):
            raise InvalidRequest("deadline", "None or a finite number of seconds > 0", deadline)
        if session is not None and not (isinstance(session, str) and session):
            raise InvalidRequest("session", "None or a session id (a non-empty string)", session)
        resumed: tuple[int, ...] = ()
        if resume_output_ids is not None:
            if not isinstance(resume_output_ids, (list, tuple)) or not all(_is_int(t) for t in resume_output_ids):
                raise InvalidRequest("resume_output_ids", "a list of token ids", resume_output_ids)
            resumed = tuple(resume_output_ids)
        if resumed and session is not None:
            raise InvalidRequest("resume_output_ids", "empty for a session turn", len(resumed))
        return cls(priority, None if deadline is None else float(deadline), session, resumed)

    def check(self, *, vocab_size: int, n: int, images: Sequence[Any]) -> None:
        """What depends on the model and the request: token ids in range, one sequence."""
        bad = next((t for t in self.resume_output_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest("resume_output_ids", f"token ids in [0, {vocab_size})", bad)
        if (self.resume_output_ids or self.session is not None) and n != 1:
            field = "session" if self.session is not None else "resume_output_ids"
            raise InvalidRequest("SamplingParams.n", f"1 with {field}", n)
        if self.session is not None and images:
            raise InvalidRequest("mm_inputs", "none for a session turn (image KV is never cached)", len(images))

    def apply(self, request: Any) -> None:
        """Set a request's scheduling fields (its deadline counts from its arrival)."""
        request.priority = self.priority
        if self.deadline is not None:
            request.deadline = request.arrival_time + self.deadline
        if self.session is not None:
            request.session_id = self.session
            request.shares_prompt = True  # NOTE: its KV goes through the prefix cache even when it is off
            request.local_prefill = True  # the session's kept KV lives here, in the decode role too
