"""The verify step: drafts proposed, then checked by one forward pass of the model.

Replaces the runner's plain step for a batch with speculating rows (rows
with a `draft_budget`); every other row of the batch runs in the same pass
as it would have::

    propose: the proposer fills each speculating row's drafts (<= its budget)
    prepare: the rows' tensors in the runner's one upload, the drafts with them
    forward: one pass; logits at every sampled position of every row
    verify:  `engine.speculative.rejection.verify` -> accepted drafts, and the
             token after them, per row
    read back: accepted counts, tokens (and logprobs of the rows that asked)
               in one copy

A step in which no row got a draft is left to the plain step (None).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.prompt_logprobs import PromptLogprobPlan
from engine.model.runner import ModelRunner
from engine.model.step_types import StepOutput, Verified
from engine.model.sampling import SamplingBatch, format_logprobs, logprob_tensors, sample_tokens
from engine.outputs import TokenLogprob
from engine.model.batch import ScheduledSeq
from engine.speculative.proposers import Proposer
from engine.speculative.rejection import verify
from resources.device_io import read_back


class SpeculativeStep:
    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer

    def step(self, runner: ModelRunner, seqs: Sequence[ScheduledSeq]) -> StepOutput | None:
        if not any(s.draft_budget for s in seqs) or PromptLogprobPlan.build(seqs) is not None:
            return None  # NOTE: a step with prompt logprobs runs plain (its budgeted rows just do not speculate)
        proposal = self.proposer.propose(seqs)
        if not proposal.any:
            return None
        rows = proposal.rows
        sampled = [s for s in rows if s.samples]
        params, positions = [], []
        for s in sampled:
            first = s.request.num_output_tokens
            for j in range(len(s.draft) + 1):
                params.append(s.request.params)
                positions.append(first + j)
        batch = SamplingBatch(params, positions)
        width = max(len(s.draft) for s in sampled)
        drafts = [t for s in sampled for t in (*s.draft, *(-1,) * (width - len(s.draft)))]
        pending = None
        if runner.token_masks is not None:  # rows with a grammar never have drafts: one position each
            pending = runner.token_masks.begin([s.request for s in sampled], runner.device,
                                               runner.model.config.vocab_size)
        counts = [len(s.draft) for s in sampled]
        inputs = runner.prepare(rows, batch, extra=(("drafts", drafts), ("num_drafts", counts)))
        embeds = runner.embedder(rows, inputs.ids) if runner.embedder is not None else None
        attention = runner.attention_factory(rows, inputs.meta)
        routing: list[torch.Tensor] = []
        logits = runner.model(inputs.ids, inputs.positions, attention, embeds, output_rows=inputs.sample_rows,
                              routing=routing)
        masks = pending() if pending is not None else None
        allowed = None
        if masks is not None:  # each row's mask on each of its positions (drafted rows allow everything)
            repeat = torch.tensor([len(s.draft) + 1 for s in sampled], device=logits.device)
            allowed = masks[0].repeat_interleave(repeat, dim=0)
        tokens = sample_tokens(logits, batch, inputs.fields, allowed=allowed)
        accepted, final = verify(logits, batch, inputs.fields, inputs.extra["drafts"].view(len(sampled), width),
                                 inputs.extra["num_drafts"], proposal.draft_probs, sampled=tokens)
        parts = [accepted, final]
        if batch.wants_logprobs:
            parts.append(tokens)
            parts.extend(logprob_tensors(logits, tokens, batch, inputs.fields))
        if routing:
            parts.append(torch.stack(routing))
        host = read_back(parts)
        counts, finals = host[0].tolist(), host[1].tolist()
        for row in masks[1] if masks is not None else ():
            finals[row] = -1  # NOTE: nothing was allowed: no token (the loop ends the request)
        logprobs: list[TokenLogprob | None] = []
        if batch.wants_logprobs:  # NOTE: rows that ask for logprobs never speculate: their token is their row's
            per_position = format_logprobs(batch, host[2].tolist(), *host[3:6])
            starts = _starts(sampled)
            logprobs = [per_position[start + n] for start, n in zip(starts, counts)]
        return StepOutput(finals, list(host[-1].unbind(0)) if routing else [], logprobs,
                          verified=[Verified(len(s.draft), s.draft[:n]) for s, n in zip(sampled, counts)], rows=rows)


def _starts(sampled: Sequence[ScheduledSeq]) -> list[int]:
    starts, at = [], 0
    for s in sampled:
        starts.append(at)
        at += len(s.draft) + 1
    return starts
