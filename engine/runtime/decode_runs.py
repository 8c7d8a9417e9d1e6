"""Decode runs on the loop's side: how many steps a decode batch runs without
the loop between them, the KV slots for them, and their outputs applied in
order (`EngineConfig.decode_steps`; the runner's side is
`engine.model.decode_run`).

A batch runs as a run only when every row is a decoding request's one next
token and no request waits to be admitted (a queue gets plain steps). A run
always takes the loop's step thread, however short (`inline_rule`: its one
hand-off is shared by its steps, and the loop keeps answering meanwhile),
and ends after the step in which a submission, an abort or anything else
that wakes the loop (a transfer that landed) arrives (`work_waiting`), so it
holds such work back by one step. Its length is at most
`decode_steps`, and no row may pass its `max_new_tokens` or the context
bound within it. Before it starts, each row's handles are extended through
the machine to cover every token the run computes (`StateMachine.extend`,
the same declared grow-and-give-back that speculative decoding's drafts
use); if a pool is short for any row, the batch runs one plain step and
what was extended goes back. After the run, a row that ran fewer steps than
its slots cover (the run stopped early) gives the rest back. A row that
finished within the run (a stop token, a stop string, an abort applied
after it) holds its slots until its release, like any other KV it holds:
release stays the hooks'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from engine.model.batch import ScheduledSeq
from engine.model.step_types import StepOutput
from engine.runtime.gateway import RequestGateway
from engine.runtime.stats import EngineStats
from engine.runtime.table import RequestTable
from states import RequestState

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner

S = RequestState


class DecodeRuns:
    def __init__(self, *, gateway: RequestGateway, table: RequestTable, stats: EngineStats, steps: int,
                 max_context: int, woken: Callable[[], bool] = lambda: False,
                 watch: Callable[[], object] = lambda: None) -> None:
        self.gateway = gateway
        self.table = table
        self.stats = stats
        #: whether the loop was woken since its iteration began (a fence completed, a request arrived);
        #: `watch()` has every pending fence that signals wake the loop (`loop_waker.fence_wait`)
        self.woken, self.watch = woken, watch
        #: the most model steps one decode run takes (1: every step is planned by the loop)
        self.steps = steps
        self.max_context = max_context

    def plan(self, batch: Sequence[ScheduledSeq]) -> int:
        """How many steps `batch` runs (1: one plain step), its rows' slots extended for them."""
        if self.steps <= 1 or not batch or self.table.waiting or self.table.unstarted:
            return 1
        steps = self.steps
        for s in batch:
            request = s.request
            if request.state is not S.DECODING or s.num_tokens != 1 or s.draft or s.draft_budget or not s.samples:
                return 1
            # NOTE: the run's j-th step appends the j-th token: none may pass a length limit
            steps = min(steps, request.params.max_new_tokens - request.num_output_tokens,
                        self.max_context - request.num_tokens)
        if steps <= 1:
            return 1
        for done, s in enumerate(batch):
            if not self.gateway.extend(s.request, s.request.kv_len + steps):  # it gave back its own
                for earlier in batch[:done]:
                    self.gateway.rollback(earlier.request, earlier.request.kv_len + 1)
                return 1
        self.stats.decode_runs += 1
        self.watch()  # NOTE: a fence that completes during the run (a transfer landing) ends it early
        return steps

    def runner_call(self, runner: ModelRunner, steps: int) -> Callable[[list[ScheduledSeq]], list[StepOutput]]:
        """What runs a batch (on the loop's thread or its step thread): one step, or a run of `steps`
        (`ModelRunner.run`), each output in order, that ends early once work waits for the loop."""
        if steps == 1:
            return lambda batch: [runner.step(batch)]
        return lambda batch: runner.run(batch, steps, self.work_waiting)

    def work_waiting(self) -> bool:
        """Whether work waits for the loop: a submission, an abort, or anything that woke it (a
        landed transfer's fence, say). Asked from the step thread: reads of lists the loop's
        thread appends to and of an event's flag."""
        return bool(self.table.unstarted or self.table.aborts) or self.woken()

    def apply(self, batch: Sequence[ScheduledSeq], outputs: Sequence[StepOutput],
              apply_step: Callable[[Sequence[ScheduledSeq], StepOutput], None]) -> None:
        """Hand each step's rows and output to the step applier's `apply_step`, in order."""
        if len(outputs) == 1:
            apply_step(batch, outputs[0])
            return
        for rows, output in self._applied(batch, outputs):
            apply_step(rows, output)

    def _applied(self, batch: Sequence[ScheduledSeq], outputs: Sequence[StepOutput]) -> Iterator[
            tuple[list[ScheduledSeq], StepOutput]]:
        """Each step of a run: its rows and output, in order; read lazily, so a later step keeps
        only the rows still decoding once the steps before it are applied."""
        self.stats.decode_run_steps += len(outputs)
        rows = list(batch)
        index = list(range(len(rows)))  # each kept row's place in the run's batch (its outputs' order)
        yield rows, outputs[0]
        for output in outputs[1:]:  # every row of a run samples: its token is at its place in the batch
            kept = [i for i, s in enumerate(rows) if s.request.state is S.DECODING]
            rows = [ScheduledSeq(rows[i].request, rows[i].start + 1, 1, True) for i in kept]
            index = [index[i] for i in kept]
            if not rows:
                return
            yield rows, _select(output, index)

    def settle(self, batch: Sequence[ScheduledSeq], planned: int, ran: int) -> None:
        """After a run of `planned` steps that ran `ran`: rows still decoding give back the slots
        of the steps that did not run."""
        if ran >= planned or planned == 1:  # NOTE: a plain step that failed finished its rows
            return
        for s in batch:
            if s.request.state is S.DECODING:
                self.gateway.rollback(s.request, s.request.num_tokens)


def _select(output: StepOutput, keep: list[int]) -> StepOutput:
    """`output` for the rows `keep` (indices into its rows, in order) only."""
    if len(keep) == len(output.tokens):
        return output
    routing = output.routing
    if routing:
        index = torch.tensor(keep)
        routing = [r.index_select(0, index) for r in routing]
    return StepOutput([output.tokens[i] for i in keep], routing,
                      [output.logprobs[i] for i in keep] if output.logprobs else [])
