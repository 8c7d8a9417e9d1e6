"""The runner's `token_masks`: per sampled row, the tokens its request's grammar allows.

    masks = GrammarMasks(vocab_words, device)
    if masks.wanted(requests): bitmask = masks(requests)   # int32 [B, words] on the host, or None

A row is a bitmask of int32 words (bit j of word w allows token 32*w + j),
llguidance's layout, computed on the host by llguidance (it drops the GIL)
while the forward pass runs on the device; the sampler applies it with plain
torch ops on the logits' device (`engine.model.sampling.apply_allowed`).
Unconstrained rows allow everything (-1 words). A dead end (the matcher is
in an error state or allows nothing) leaves its row all zero: the sampler
then gives -1 for it, never an unconstrained token, and the loop's check
ends the request with `GrammarDeadEnd`.

NOTE: this runs in the model step's thread; the requests of a running step
are never touched by the loop meanwhile (the in-flight-step fence), so their
matchers are this thread's alone until the step returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.structured.hook import GrammarHook
from states import Request


class GrammarMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self._pin = device.type == "cuda"

    def wanted(self, requests: Sequence[Request]) -> bool:
        """Whether any of the rows holds a grammar (cheap: no mask is computed)."""
        return any(GrammarHook.name in r.handles for r in requests)

    def __call__(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """The rows' bitmask, or None when no row is constrained now (before a reasoning end,
        or no grammar at all)."""
        bitmask: torch.Tensor | None = None
        for row, request in enumerate(requests):
            state = GrammarHook.state(request)
            if state is None:
                continue
            state.sync(request.output_token_ids)  # a refused token sets state.error: a dead end below
            if not state.active and state.error is None:
                continue
            if bitmask is None:
                bitmask = torch.full((len(requests), self.words), -1, dtype=torch.int32, pin_memory=self._pin)
            state.fill(bitmask, row)
        return bitmask
