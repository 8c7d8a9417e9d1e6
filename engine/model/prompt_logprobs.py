"""Prompt logprobs (issue 21): each prompt token's log probability, from the step that computes it.

The model runner's one seam for them (`ModelRunner.step`): a prefill chunk
of tokens [start, start + n) of a request that asked for
`SamplingParams.prompt_logprobs` has the logits of its rows computed too,
not only the sampled row's. Row j (position start + j) predicts the prompt
token at position start + j + 1, so a chunk gives the entries of prompt
positions start + 1 ... min(start + n, prompt length - 1); position 0 has
none (the first entry is None).

    plan = PromptLogprobPlan.build(seqs)      # None when no chunk asked: one pass over the batch
    rows = plan.output_rows(sample_rows, device)
    logits = model(..., output_rows=rows)
    logits, entries = plan.split(logits, sample_rows, num_samples)

Entries are `TokenLogprob` (the token's logprob, its rank, and the request's
`prompt_logprobs` best alternatives), from ``log_softmax`` in float32 of the
model's logits: the model's own distribution. A request that asks computes
its whole prompt even when the prefix cache holds it (the KV hook skips its
match until the prompt is done), because a cached page keeps KV, not logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from engine.outputs import TokenLogprob
from states import Request

if TYPE_CHECKING:
    from engine.model.batch import ScheduledSeq

#: (request, first prompt position covered, entries for consecutive positions)
PromptEntries = tuple[Request, int, list[TokenLogprob]]


@attrs.frozen(eq=False)
class PromptLogprobPlan:
    #: rows of the step's tokens whose logits give prompt logprobs, and the token each predicts
    rows: list[int]
    targets: list[int]
    #: (request, first prompt position, number of rows, alternatives wanted), in row order
    spans: list[tuple[Request, int, int, int]]

    @classmethod
    def build(cls, seqs: Sequence[ScheduledSeq]) -> PromptLogprobPlan | None:
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[Request, int, int, int]] = []
        offset = 0
        for s in seqs:
            request = s.request
            top = getattr(request.params, "prompt_logprobs", None)
            if top is not None:
                prompt = request.prompt_token_ids
                count = min(s.start + s.num_tokens, len(prompt) - 1) - s.start
                if count > 0:
                    rows.extend(range(offset, offset + count))
                    targets.extend(prompt[s.start + 1 : s.start + 1 + count])
                    spans.append((request, s.start + 1, count, top))
            offset += s.num_tokens
        return cls(rows, targets, spans) if rows else None

    def output_rows(self, sample_rows: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """The rows the LM head computes: the sampled ones, then these (None: every row)."""
        if sample_rows is None:
            return None
        return torch.cat((sample_rows, torch.tensor(self.rows, dtype=torch.int64).to(device)))

    def split(self, logits: torch.Tensor, sample_rows: torch.Tensor | None,
              num_samples: int) -> tuple[torch.Tensor, list[PromptEntries]]:
        """(the sampled rows' logits, the prompt entries) from the logits of `output_rows`."""
        if sample_rows is None:
            mine = logits.index_select(0, torch.tensor(self.rows, dtype=torch.int64).to(logits.device))
            return logits, self.entries(mine)
        return logits[:num_samples], self.entries(logits[num_samples:])

    def entries(self, logits: torch.Tensor) -> list[PromptEntries]:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(self.targets, dtype=torch.int64).to(logits.device)[:, None]
        chosen = logprobs.gather(1, targets)
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        most = max(top for *_, top in self.spans)
        values, ids = torch.topk(logprobs, most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0].long())
        chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
        values_l, ids_l = values.tolist(), ids.tolist()
        out: list[PromptEntries] = []
        row = 0
        for request, first, count, top in self.spans:
            entries = [TokenLogprob(self.targets[r], chosen_l[r], tuple(zip(ids_l[r][:top], values_l[r][:top])),
                                    rank=ranks_l[r]) for r in range(row, row + count)]
            out.append((request, first, entries))
            row += count
        return out
