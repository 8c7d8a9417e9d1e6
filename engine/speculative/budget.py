"""How many draft tokens a request may verify in its next step (pure policy)."""

from __future__ import annotations

from states import Request, RequestKind


def draft_budget(request: Request, draft_tokens: int, max_context: int) -> int:
    """At most `draft_tokens`, and never more than the request could still emit: a verify
    step emits up to budget + 1 tokens, within `max_new_tokens` and `max_context`. 0 for a
    request that opted out, asks for logprobs, follows a grammar (its mask is known for one
    position at a time), or is a health check."""
    params = request.params
    if (not params.speculative or params.logprobs is not None or params.constraint is not None
            or request.kind is not RequestKind.NORMAL):
        return 0
    room = min(params.max_new_tokens - request.num_output_tokens, max_context - request.num_tokens)
    return max(0, min(draft_tokens, room - 1))
