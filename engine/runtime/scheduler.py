"""The scheduler: pure policy over who runs next.

It reads requests and pool availability and returns decisions; it never
transitions a request, allocates or frees anything. The decode loop carries
its decisions out through the machine.

A step's batch reads top to bottom: every decoding request contributes one
token, then prefill chunks fill what is left of the token budget (chunked
prefill, so a long prompt never stalls the running decodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from resources.paging import pages_for
from states import Request


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
    #: the draft tokens the row verifies after its last token (the runner's proposer fills
    #: them in; `num_tokens` then counts them: positions past the request's tokens are drafts)
    draft: tuple[int, ...] = ()


class Scheduler:
    def __init__(self, *, max_running: int, max_prefill_tokens: int, page_size: int) -> None:
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.page_size = page_size

    def select_admissions(
        self, waiting: Iterable[Request], *, num_running: int, free_slots: int, available_pages: int
    ) -> list[Request]:
        """Waiting requests to admit now, in order: FIFO while a slot and pages remain.

        One page per running request is kept back so that the next decode
        step does not have to retract what was just admitted; a request that
        would run alone needs no reserve (it fits the pool by construction:
        max_context never exceeds it).
        """
        chosen: list[Request] = []
        budget = available_pages - num_running
        for request in waiting:
            if num_running + len(chosen) >= self.max_running or len(chosen) >= free_slots:
                break
            alone = num_running == 0 and not chosen
            need = pages_for(request.num_tokens, self.page_size) + (0 if alone else 1)
            if need > budget:
                break  # FIFO: later requests wait behind the head
            chosen.append(request)
            budget -= need
        return chosen

    def select_batch(self, prefilling: Sequence[Request], decoding: Sequence[Request]) -> list[ScheduledSeq]:
        """Decode rows for every decoding request, then prefill chunks within the budget."""
        batch = [ScheduledSeq(r, r.kv_len, 1, True) for r in decoding]
        budget = self.max_prefill_tokens
        for request in prefilling:
            if budget <= 0:
                break
            remaining = request.num_tokens - request.kv_len
            n = min(remaining, budget)
            batch.append(ScheduledSeq(request, request.kv_len, n, n == remaining))
            budget -= n
        return batch

    def select_victim(self, decoding: Sequence[Request], *, retractable) -> Request | None:
        """The request to retract under page pressure: the most recently admitted one."""
        candidates = [r for r in decoding if retractable(r)]
        if not candidates:
            return None
        return max(candidates, key=lambda r: r.admitted_seq)
