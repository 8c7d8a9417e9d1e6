"""The per-layer LRU of a request's device buffer.

A request's device buffer has N slots per layer (plus the reserved
newest-token slot, which is not managed here). For one layer::

    token_to_slot [C]  token index -> local slot, -1 if not resident
    slot_token    [N]  local slot -> token it holds, -1 if empty
    last_used     [N]  step stamp of the slot's last use (-1: never)

`assign` takes the step's selected tokens (distinct, at most N of them) and
makes every one resident: hits keep their slot, misses go to the least
recently used slots that hold no selected token (empty slots first, ties by
slot index), whose old tokens are unmapped. Every selected slot is stamped.
The caller copies the misses' K/V from host into their new slots.

NOTE: this is bookkeeping, kept in host memory (numpy) on every device, like
the page allocator's free list: the swap-in needs the miss list on the host
anyway (to gather host rows), and numpy does these few small steps in
microseconds where torch ops cost several each.
"""

from __future__ import annotations

import numpy as np

#: larger than any step stamp: protects a slot from eviction
_PROTECTED = np.iinfo(np.int64).max


def assign(token_to_slot: np.ndarray, slot_token: np.ndarray, last_used: np.ndarray, selected: np.ndarray,
           stamp: int) -> tuple[np.ndarray, np.ndarray]:
    """Make `selected` resident; returns (local slot per selected token, miss mask).

    Mutates the three state arrays in place. Requires distinct `selected`
    tokens in ``[0, C)`` and ``len(selected) <= N``.
    """
    local = token_to_slot[selected]
    miss = local < 0
    num_missed = int(np.count_nonzero(miss))
    if num_missed:
        key = last_used.copy()
        key[local[~miss]] = _PROTECTED
        # the i-th miss (in selection order) takes the i-th least recently used free slot
        victims = np.argsort(key, kind="stable")[:num_missed]
        evicted = slot_token[victims]
        token_to_slot[evicted[evicted >= 0]] = -1
        incoming = selected[miss]
        token_to_slot[incoming] = victims
        slot_token[victims] = incoming
        local[miss] = victims
    last_used[local] = stamp
    return local, miss


def preload(token_to_slot: np.ndarray, slot_token: np.ndarray, last_used: np.ndarray, num_tokens: int) -> None:
    """Tokens 0..num_tokens-1 resident in slots 0..num_tokens-1 (every layer's
    state may be passed at once, with a leading layer dimension)."""
    tokens = np.arange(num_tokens)
    token_to_slot[..., :num_tokens] = tokens
    slot_token[..., :num_tokens] = tokens
    last_used[..., :num_tokens] = 0
