"""A decode run: several plain decode steps of one batch, back to back, with
no trip through the loop between them (`EngineConfig.decode_steps`).

Between two steps the loop takes in submissions, releases, plans, applies
the tokens and streams them: on a CPU at batch 1 that host work is about a
tenth of a step, and it runs with the caches cold after the forward. A run
pays it once per run instead of once per token, as vLLM's multi-step
scheduling did. Each later step's inputs are the rows' tokens sampled by the
step before, one position on, in KV slots the planner grew for the whole run
through the machine before the run started (`engine.runtime.decode_runs`).

The run stops early, after any step, when that step was not a plain decode
step (a grammar's masks need the token applied first; an extension or an
attention backend of its own; a step that started copies), when a row
sampled no token, or when the loop has work waiting (a submission, an abort
or a landed transfer arrived while the run ran on the loop's step thread:
it is taken in after one step, not after the whole run). The loop applies every step's output in order, as it would
have one by one; tokens a row sampled after it finished are dropped there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from engine.model.batch import ScheduledSeq
from engine.model.step_types import StepOutput


class Stepper(Protocol):
    """What a run needs of the model runner (`ModelRunner`, which calls it from `run`)."""

    @property
    def last_plain(self) -> bool: ...

    def step_in_scope(self, seqs: Sequence[ScheduledSeq], next_ids: Sequence[int] | None = None, ahead: int = 0,
                      steps: int = 1) -> StepOutput: ...


def run_decode_steps(runner: Stepper, seqs: Sequence[ScheduledSeq], steps: int,
                     stop: Callable[[], bool] | None = None) -> list[StepOutput]:
    """Up to `steps` model steps of the decode batch `seqs` (at least the first): each output in
    order; `stop()`, asked before each later step, ends the run early when true (the loop has
    work waiting: a submission or an abort). Called by `ModelRunner.run`, inside its scope."""
    outputs = [runner.step_in_scope(seqs, steps=steps)]
    for ahead in range(1, steps):
        tokens = outputs[-1].tokens
        if not runner.last_plain or len(tokens) != len(seqs) or min(tokens) < 0 or (stop is not None and stop()):
            break
        seqs = [ScheduledSeq(s.request, s.start + 1, 1, True) for s in seqs]
        outputs.append(runner.step_in_scope(seqs, next_ids=tokens, ahead=ahead))
    return outputs
