"""The scheduler: pure policy over who runs next.

It reads requests and pool availability and returns decisions; it never
transitions a request, allocates or frees anything. The decode loop carries
its decisions out through the machine.

A step's batch reads top to bottom: every decoding request contributes one
token, then prefill chunks fill what is left of the token budget (chunked
prefill, so a long prompt never stalls the running decodes). With decode rows
in the step, the budget shrinks so that a full step's rows end on a size class
(`resources.paging.size_class`, the row counts the CPU projections are built
for): 4,096 prefill tokens and 32 decode rows would be 4,128 rows, padded to
5,120 in every projection, so the chunk takes 4,064. It never shrinks below
half the budget.

Priority (issue 21; vLLM's convention: lower runs first, equal priority keeps
arrival order). The waiting queue is admitted in `order_key` order: with
`priority_aging` = T seconds, a request of priority p that arrived at time a
ranks as if it had arrived at a + p * T, so each priority step is worth T
seconds of waiting and a low-priority request waits behind later
higher-priority arrivals for at most (its priority - theirs) * T seconds: the
lowest class is never starved forever. `priority_aging=None` is strict
priority (a lower class may wait for as long as higher ones keep arriving).
The key never changes, so a retracted request keeps its place in its class.
Under memory pressure the head of the queue may retract running requests
(`select_preemptions`) of a strictly lower declared priority whose key also
ranks after it, never the reverse; decode growth retracts the lowest priority,
newest admitted request first (`select_victim`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.model.batch import ScheduledSeq
from resources.paging import pages_for, size_class_below
from states import Request

__all__ = ["ScheduledSeq", "Scheduler"]


class Scheduler:
    def __init__(self, *, max_running: int, max_prefill_tokens: int, page_size: int,
                 priority_aging: float | None = None) -> None:
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.page_size = page_size
        #: seconds of waiting worth one priority step (None: strict priority)
        self.priority_aging = priority_aging

    # ------------------------------------------------------------ priority
    def order_key(self, request: Request) -> tuple[float, float]:
        """Where `request` ranks in the waiting queue (smaller first); fixed for its lifetime."""
        if self.priority_aging is None:
            return (request.priority, request.arrival_time)
        return (request.arrival_time + request.priority * self.priority_aging, request.arrival_time)

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        """The waiting requests in admission order (a stable sort: ties keep queue order)."""
        ready = list(waiting)
        if len(ready) > 1:
            ready.sort(key=self.order_key)
        return ready

    def select_preemptions(self, head: Request, running: Sequence[Request], *, num_running: int, free_slots: int,
                           available_pages: int, retractable: Callable[[Request], bool],
                           freed_pages: Callable[[Request], int]) -> list[Request]:
        """Running requests to retract so that `head` (the queue's first, which does not fit)
        can be admitted: lowest priority first, newest admitted first within a class; only
        requests of a strictly lower declared priority that also rank after `head`. Empty
        when retracting every candidate would still not make room."""
        key = self.order_key(head)
        candidates = sorted((r for r in running if r.priority > head.priority and self.order_key(r) > key
                             and retractable(r)), key=lambda r: (r.priority, r.admitted_seq), reverse=True)
        victims: list[Request] = []
        slots, pages, busy = free_slots, available_pages, num_running
        for victim in candidates:
            if self.select_admissions([head], num_running=busy, free_slots=slots, available_pages=pages):
                return victims
            victims.append(victim)
            slots, pages, busy = slots + 1, pages + freed_pages(victim), busy - 1
        if victims and self.select_admissions([head], num_running=busy, free_slots=slots, available_pages=pages):
            return victims
        return []

    def select_admissions(
        self, waiting: Iterable[Request], *, num_running: int, free_slots: int, available_pages: int,
        takes_pages: Callable[[Request], bool] = lambda request: True,
    ) -> list[Request]:
        """Waiting requests to admit now, in the given order (`order`) while a slot and pages remain.

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
                break  # in order: later requests wait behind the head
            chosen.append(request)
            budget -= need
            slots -= 1
        return chosen

    def select_batch(self, prefilling: Sequence[Request], decoding: Sequence[Request]) -> list[ScheduledSeq]:
        """Decode rows for every decoding request, then prefill chunks within the budget."""
        batch = [ScheduledSeq(r, r.kv_len, 1, True) for r in decoding]
        budget = self.max_prefill_tokens
        if batch:  # NOTE: a full step's rows end on a size class (module docstring); never below half the budget
            fitted = size_class_below(budget + len(batch)) - len(batch)
            budget = fitted if fitted * 2 >= budget else budget
        for request in prefilling:
            if budget <= 0:
                break
            remaining = request.num_tokens - request.kv_len
            n = min(remaining, budget)
            batch.append(ScheduledSeq(request, request.kv_len, n, n == remaining))
            budget -= n
        return batch

    def select_victim(self, decoding: Sequence[Request], *, retractable: Callable[[Request], bool]) -> Request | None:
        """The request to retract under page pressure: the lowest priority, then the most
        recently admitted one (a request that needs a page may be its own victim)."""
        candidates = [r for r in decoding if retractable(r)]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (r.priority, r.admitted_seq))
