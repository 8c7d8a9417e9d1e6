"""Proposers: the draft tokens of a step's speculating rows.

The runner hands its batch to its proposer at the start of a step (in the
step's thread). Rows with a `draft_budget` get up to that many draft tokens
(`ScheduledSeq.draft`, counted in `num_tokens`); every other row is returned
as it was. A proposer never touches a request's bookkeeping: the KV slots of
the drafts were grown through the machine before the step (the budget says
how many), and what the model rejects is given back through it after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from engine.model.batch import ScheduledSeq
from engine.speculative.config import SpeculativeConfig
from engine.speculative.prompt_lookup import propose_ngram


@attrs.frozen(eq=False)
class Proposal:
    """The batch with its drafts filled in, and the drafts' distributions when a draft
    model sampled them (``[S, K, V]`` over the sampled rows, K the longest draft; None:
    point-mass drafts)."""

    rows: list[ScheduledSeq]
    draft_probs: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return any(s.draft for s in self.rows)


def with_draft(s: ScheduledSeq, draft: Sequence[int]) -> ScheduledSeq:
    """A copy of the row that verifies `draft` after its last token (`attrs.evolve`, without
    its cost: this runs per row and step)."""
    return ScheduledSeq(s.request, s.start, s.num_tokens + len(draft), s.samples, s.draft_budget, tuple(draft))


class Proposer(Protocol):
    def propose(self, seqs: Sequence[ScheduledSeq]) -> Proposal: ...


class NgramProposer:
    """Prompt lookup (`engine.speculative.prompt_lookup`): no model, no memory of its own."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram_min = config.ngram_min
        self.ngram_max = config.ngram_max

    def propose(self, seqs: Sequence[ScheduledSeq]) -> Proposal:
        rows = []
        for s in seqs:
            if s.draft_budget and s.samples:
                draft = propose_ngram(s.request.all_token_ids, s.draft_budget, self.ngram_min, self.ngram_max)
                if draft:
                    s = with_draft(s, draft)
            rows.append(s)
        return Proposal(rows)
