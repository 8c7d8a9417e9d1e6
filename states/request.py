"""The request: what was asked, what came out, and what it holds.

Two writers, and only two. The machine (`states.machine.RequestMachine`)
writes `state`, `history`, `handles`, `fences`, `finish_reason` and `error`;
the runtime's step applier (`engine.runtime.step_applier`) writes the
request's progress: `kv_len`, `output_token_ids`, `output_logprobs` and the
token times. Everything else reads them. Counters are plain properties so the
scheduler and the model runner need no bookkeeping of their own.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import attrs

from states.handle import Fence, Handle
from states.request_state import FinishReason, RequestState


@attrs.frozen
class TokenLogprob:
    """A generated token's log probability, and the top alternatives' (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    #: the token's rank in the distribution (1 = the most likely), where computed (prompt logprobs)
    rank: int | None = None


class RequestKind(enum.Enum):
    NORMAL = "normal"
    HEALTH_CHECK = "health_check"
    #: issue 21: a session's anchor, the owner of its kept KV (never admitted, never run)
    SESSION = "session"


@attrs.define(eq=False, repr=False)
class Request:
    """One generation request and its lifecycle record.

    `prompt_token_ids` never changes; `output_token_ids` grows by one per
    accepted token, and `output_logprobs` with it (one entry per output token,
    None where none was computed) when the request asks for logprobs. `kv_len`
    counts the leading tokens whose KV is complete in this engine: 0 before
    prefill, after retraction and while a transfer has not landed, so only
    complete KV is ever cached. `handles` maps hook name to the live handle the
    request holds; `fences` are the in-flight operations that must complete
    before FINISHED -> RELEASED frees their memory.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    kind: RequestKind = RequestKind.NORMAL
    mm_inputs: list[Any] = attrs.field(factory=list)
    output_token_ids: list[int] = attrs.field(factory=list)
    output_logprobs: list[TokenLogprob | None] = attrs.field(factory=list)
    state: RequestState = RequestState.QUEUED
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    history: list[tuple[RequestState, float]] = attrs.field(factory=list)
    handles: dict[str, Handle[Any]] = attrs.field(factory=dict)
    fences: list[Fence] = attrs.field(factory=list)
    kv_len: int = 0
    arrival_time: float = attrs.field(factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    completion_time: float | None = None
    #: order of the latest admission (the scheduler retracts the newest first); 0 before any
    admitted_seq: int = 0
    #: prompt tokens found in the prefix cache at the first admission (None before it)
    num_cached_tokens: int | None = None
    #: one of several sequences sampled from one prompt: the KV hook shares the prompt's
    #: pages through the prefix cache even when the cache is off for other requests
    shares_prompt: bool = False
    #: model steps that produced output tokens for it (a speculative step may produce several)
    num_token_steps: int = 0
    #: speculative decoding: draft tokens verified for it, and those the model accepted
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
    # -- issue 21: scheduling and sessions (engine/runtime/deadlines.py, scheduler.py, sessions.py)
    #: lower runs first (vLLM's convention); equal priority keeps arrival order
    priority: int = 0
    #: monotonic time past which the request finishes DEADLINE (None: none)
    deadline: float | None = None
    #: the session this request is a turn of (None: not a turn)
    session_id: str | None = None
    #: prefill here even in the decode role (a session's kept KV, prompt logprobs live here)
    local_prefill: bool = False
    #: compute the whole prompt even if the prefix cache holds it (prompt logprobs need every
    #: position's logits); cleared once the prompt is computed, so a re-admission matches
    skip_prefix_match: bool = False
    #: free-form per-request scratch for plugins' hooks; the engine itself never reads or writes it
    extras: dict[str, Any] = attrs.field(factory=dict)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.state.name}, reason={self.finish_reason})"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def first_tokens(self, n: int) -> list[int]:
        """The first `n` of prompt + output (one copy, however long the prompt)."""
        p = len(self.prompt_token_ids)
        if n <= p:
            return self.prompt_token_ids[:n]
        return self.prompt_token_ids + self.output_token_ids[: n - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.RELEASED)

    def entered_at(self, state: RequestState) -> float | None:
        """Monotonic time this request last entered `state`, if it did."""
        for s, t in reversed(self.history):
            if s is state:
                return t
        return None
