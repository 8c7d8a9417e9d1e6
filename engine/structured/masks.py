"""The runner's `token_masks`: per sampled row, the tokens its request's grammar allows.

    pending = masks.begin(requests)     # None when no row holds a grammar
    ...                                 # the forward pass runs meanwhile
    bitmask = pending()                 # int32 [B, words] on the host, or None

A row is a bitmask of int32 words (bit j of word w allows token 32*w + j),
llguidance's layout, computed on the host by llguidance in this provider's
own thread while the step's thread runs the forward pass (llguidance drops
the GIL): each row's matcher first syncs to its request's output (consuming
the token the previous step sampled), then fills its row. The sampler
applies the bitmask to the logits (`engine.model.sampling.apply_allowed`).
Unconstrained rows, and rows before their grammar starts, allow everything
(-1 words). A dead end (a matcher in an error state, a token it refused, or
no token allowed) leaves its row all zero: the sampler then gives -1 for it,
never an unconstrained token, and the loop's check ends the request.

NOTE: the requests of a running step are never touched by the loop meanwhile
(the in-flight-step fence), so their matchers are this thread's alone until
the step returns; the forward pass only reads their token ids.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable, Sequence

import torch

from engine.structured.hook import GrammarHook
from engine.structured.matcher import GrammarState
from states import Request


class GrammarMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self._pin = device.type == "cuda"
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvlife-masks")
        weakref.finalize(self, self._thread.shutdown, False)

    def begin(self, requests: Sequence[Request]) -> Callable[[], torch.Tensor | None] | None:
        """Start the rows' masks; None (and nothing started) when no row holds a grammar."""
        rows = [(row, state) for row, request in enumerate(requests)
                if (state := GrammarHook.state(request)) is not None]
        if not rows:
            return None
        outputs = [requests[row].output_token_ids for row, _ in rows]
        future = self._thread.submit(self._fill, len(requests), rows, outputs)
        return future.result

    def __call__(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """The rows' masks, computed in the calling thread."""
        pending = self.begin(requests)
        return None if pending is None else pending()

    def _fill(self, batch: int, rows: list[tuple[int, GrammarState]], outputs: list[list[int]]) -> torch.Tensor | None:
        bitmask: torch.Tensor | None = None
        for (row, state), output in zip(rows, outputs):
            state.sync(output)  # a refused token sets state.error: a dead end below
            if not state.active and state.error is None:
                continue  # before its marker (a reasoning model's thinking): free
            if bitmask is None:
                bitmask = torch.full((batch, self.words), -1, dtype=torch.int32, pin_memory=self._pin)
            state.fill(bitmask, row)
        return bitmask
