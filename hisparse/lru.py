"""The per-layer LRU of a request's device buffer, in fixed-shape tensor ops.

A request's device buffer has N slots per layer (plus the reserved newest-token
slot, which is not managed here). For one layer::

    token_to_slot [C + 1]  token index -> local slot, -1 if not resident;
                           column C is scratch for masked writes
    slot_token    [N + 1]  local slot -> token it holds, -1 if empty;
                           entry N is scratch
    last_used     [N]      step stamp of the slot's last use (-1: never)

`assign` takes the step's selected tokens (distinct, at most N of them) and
makes every one resident: hits keep their slot, misses go to the least
recently used slots that hold no selected token (empty slots first, ties by
slot index), whose old tokens are unmapped. Every selected slot is stamped.
The caller copies the misses' K/V from host into their new slots.

NOTE: every op has a shape fixed by N and the selection's length, so on CUDA
nothing here waits for the device; only the caller's miss list does.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: larger than any step stamp: protects a slot from eviction
_PROTECTED = torch.iinfo(torch.int64).max


def assign(token_to_slot: Tensor, slot_token: Tensor, last_used: Tensor, selected: Tensor,
           stamp: int) -> tuple[Tensor, Tensor]:
    """Make `selected` resident; returns (local slot per selected token, miss mask).

    Mutates the three state tensors in place. Requires distinct `selected`
    tokens in ``[0, C)`` and ``len(selected) <= N``.
    """
    num_slots = last_used.shape[0]
    scratch_token = token_to_slot.shape[0] - 1
    local = token_to_slot.index_select(0, selected)
    hit = local >= 0
    miss = ~hit
    protect = torch.zeros(num_slots + 1, dtype=torch.bool, device=local.device)
    protect.index_fill_(0, torch.where(hit, local, num_slots), True)
    key = torch.where(protect[:num_slots], _PROTECTED, last_used)
    order = torch.sort(key, stable=True).indices
    # the i-th miss (in selection order) takes the i-th least recently used free slot
    rank = torch.cumsum(miss, 0) - 1
    victim = order.index_select(0, rank.clamp(min=0))
    local = torch.where(hit, local, victim)
    evicted = slot_token.index_select(0, victim)
    token_to_slot.index_fill_(0, torch.where(miss & (evicted >= 0), evicted, scratch_token), -1)
    token_to_slot.index_put_((torch.where(miss, selected, scratch_token),), torch.where(miss, victim, -1))
    token_to_slot[scratch_token] = -1
    slot_token.index_put_((torch.where(miss, victim, num_slots),), selected)
    slot_token[num_slots] = -1
    last_used.index_fill_(0, local, stamp)
    return local, miss


def preload(token_to_slot: Tensor, slot_token: Tensor, last_used: Tensor, num_tokens: int) -> None:
    """Tokens 0..num_tokens-1 resident in slots 0..num_tokens-1 (every layer's
    state may be passed at once, with a leading layer dimension)."""
    tokens = torch.arange(num_tokens, device=token_to_slot.device)
    token_to_slot[..., :num_tokens] = tokens
    slot_token[..., :num_tokens] = tokens
    last_used[..., :num_tokens] = 0
