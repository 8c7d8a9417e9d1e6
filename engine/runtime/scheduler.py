"""The scheduler: pure policy over who runs next.

It reads requests and pool availability and returns decisions; it never
transitions a request, allocates or frees anything. The decode loop carries
its decisions out through the machine.

A step's batch reads top to bottom: every decoding request contributes one
token, then prefill chunks fill what is left of the token budget (chunked
prefill, so a long prompt never stalls the running decodes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.model.batch import ScheduledSeq
from resources.paging import pages_for
from states import Request

__all__ = ["ScheduledSeq", "Scheduler"]


class Scheduler:
    def __init__(self, *, max_running: int, max_prefill_tokens: int, page_size: int) -> None:
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.page_size = page_size

    def select_admissions(
        self, waiting: Iterable[Request], *, num_running: int, free_slots: int, available_pages: int,
        takes_pages: Callable[[Request], bool] = lambda request: True,
    ) -> list[Request]:
        """Waiting requests to admit now, in order: FIFO while a slot and pages remain.

        One page per running request is kept back so that the next decode
        step does not have to retract what was just admitted; a request that
        would run alone needs no reserve (it fits the pool by construction:
        max_context never exceeds it). A request whose admission `takes_pages`
        says takes no KV pages and no slot (HiSparse's decode role: its transfer
        lands in host rows) costs neither.
        """
        chosen: list[Request] = []
        budget = available_pages - num_running
        slots = free_slots
        for request in waiting:
            if num_running + len(chosen) >= self.max_running:
                break
            if not takes_pages(request):
                chosen.append(request)
                continue
            if slots <= 0:
                break
            alone = num_running == 0 and not chosen
            need = pages_for(request.num_tokens, self.page_size) + (0 if alone else 1)
            if need > budget:
                break  # FIFO: later requests wait behind the head
            chosen.append(request)
            budget -= need
            slots -= 1
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

    def select_victim(self, decoding: Sequence[Request], *,
                      retractable: Callable[[Request], bool]) -> Request | None:
        """The request to retract under page pressure: the most recently admitted one."""
        candidates = [r for r in decoding if retractable(r)]
        if not candidates:
            return None
        return max(candidates, key=lambda r: r.admitted_seq)
