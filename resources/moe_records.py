"""MoE expert records: per-request routing counts, folded once at release.

Each request admitted by an MoE model holds a record handle: a
``[moe_layers, num_experts]`` count of the experts its tokens were routed to,
updated after every forward it ran in (`record_step`). Releasing the handle
folds it into the engine's `ExpertDistribution` exactly once, on every path:
normal finish, first-token finish, abort, error, shutdown. Retraction keeps
the record (its scope includes RETRACTED and QUEUED).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from resources.contract import ResourceHook
from states import HELD_STATES, Handle, Request, RequestState

S = RequestState


class ExpertDistribution:
    """Global routed-expert counts of every released request."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.counts = torch.zeros((num_layers, num_experts), dtype=torch.int64)
        self.records_folded = 0

    def fold(self, record: torch.Tensor) -> None:
        self.counts += record
        self.records_folded += 1


class MoERecordHook(ResourceHook):
    name = "moe_record"
    acquire_on = frozenset({S.PREFILLING, S.TRANSFERRING})
    scope = HELD_STATES

    def __init__(self, distribution: ExpertDistribution) -> None:
        self.distribution = distribution

    def acquire(self, request: Request, into: RequestState) -> Handle[torch.Tensor]:
        return Handle(self.name, request.request_id, torch.zeros_like(self.distribution.counts))

    def release(self, request: Request, handle: Handle[torch.Tensor]) -> None:
        self.distribution.fold(handle.payload)


def record_step(hook_name: str, requests: Sequence[Request], q_lens: Sequence[int],
                routing: Sequence[torch.Tensor]) -> None:
    """Add one forward's routing (per MoE layer, ``[T, top_k]`` expert ids over the
    batch's tokens, sequences contiguous with `q_lens` tokens each) to the
    records of `requests`."""
    if not routing:
        return
    num_experts = requests[0].handles[hook_name].payload.shape[1]
    batch = len(requests)
    seq_of_token = torch.repeat_interleave(torch.arange(batch), torch.tensor(list(q_lens)))
    stacked = torch.stack([r.cpu() for r in routing])  # [L, T, k]
    layers, tokens, top_k = stacked.shape
    index = (torch.arange(layers)[:, None, None] * batch + seq_of_token[None, :, None]) * num_experts + stacked
    counts = torch.bincount(index.reshape(-1), minlength=layers * batch * num_experts)
    counts = counts.view(layers, batch, num_experts)
    for b, request in enumerate(requests):
        handle = request.handles.get(hook_name)
        if handle is not None:
            handle.payload += counts[:, b]
            handle.amount = int(handle.payload.sum())
