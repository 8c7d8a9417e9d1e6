"""The runner's `token_masks`: per sampled row, the tokens its request's grammar allows.

    pending = masks.begin(requests)     # None when no row holds a grammar
    ...                                 # the forward pass runs meanwhile
    bitmask = pending()                 # int32 [B, words] on the host, or None

A row is a bitmask of int32 words (bit j of word w allows token 32*w + j),
llguidance's layout, computed on the host by llguidance when the runner asks
for it, after it has launched the forward pass (on a device, the masks are
computed while the forward runs): each row's matcher first syncs to its
request's output (consuming the token the previous step sampled), then
fills its row; what the masks say (nothing allowed, only the stop tokens)
is read for all rows at once. The sampler applies the bitmask to the logits
(`engine.model.sampling.sample`).
Unconstrained rows, and rows before their grammar starts, allow everything
(-1 words). A dead end (a matcher in an error state, a token it refused, or
no token allowed) leaves its row all zero: the sampler then gives -1 for it,
never an unconstrained token, and the loop's check ends the request.

NOTE: this runs in the model step's thread; the requests of a running step
are never touched by the loop meanwhile (the in-flight-step fence), so their
matchers are this thread's alone until the step returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.structured.hook import GrammarHook
from engine.structured.matcher import GrammarState
from states import Request


class GrammarMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self._pin = device.type == "cuda"

    def begin(self, requests: Sequence[Request]) -> Callable[[], torch.Tensor | None] | None:
        """Start the rows' masks; None (and nothing started) when no row holds a grammar."""
        rows = [(row, state) for row, request in enumerate(requests)
                if (state := GrammarHook.state(request)) is not None]
        if not rows:
            return None
        outputs = [requests[row].output_token_ids for row, _ in rows]
        return lambda: self._fill(len(requests), rows, outputs)

    def __call__(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """The rows' masks, now."""
        pending = self.begin(requests)
        return None if pending is None else pending()

    def _fill(self, batch: int, rows: list[tuple[int, GrammarState]], outputs: list[list[int]]) -> torch.Tensor | None:
        masked: list[tuple[int, GrammarState]] = []
        for (row, state), output in zip(rows, outputs):
            state.sync(output)  # a refused token sets state.error: a dead end below
            if state.active or state.error is not None:  # else: before its marker (a reasoning model's thinking)
                masked.append((row, state))
        if not masked:
            return None
        bitmask = torch.full((batch, self.words), -1, dtype=torch.int32, pin_memory=self._pin)
        host = bitmask.numpy()
        stride = host.strides[0]
        for row, state in masked:
            state.write_mask(host.ctypes.data + row * stride, stride)
        # NOTE: what the masks say, read for all rows at once (a numpy call per row costs more)
        index = [row for row, _ in masked]
        written = host[index]
        empty = np.asarray(~written.any(axis=1))
        stops = masked[0][1].stop_words
        only_stops = np.asarray((written == stops).all(axis=1) if stops is not None else np.zeros(len(index), bool))
        for i, (row, state) in enumerate(masked):
            state.settle(host[row], bool(only_stops[i]), bool(empty[i]))
        return bitmask
