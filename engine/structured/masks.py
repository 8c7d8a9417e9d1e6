"""The runner's `token_masks`: per sampled row, the tokens its request's grammar allows.

    pending = masks.begin(requests, device, vocab)   # None when no row holds a grammar
    ...                                               # the forward pass is launched
    allowed, empty = pending()                        # [S, vocab] bool on the device; dead rows

Each row is computed on the host by llguidance as a bitmask of int32 words
(bit j of word w allows token 32*w + j), when the runner asks for it, once it
has launched the forward pass (on a device, the masks are computed while the
forward runs): each row's matcher first syncs to its request's output
(consuming the token the previous step sampled), then writes its row; what
the masks say (nothing allowed, only the stop tokens) is read for all rows at
once. The bits are then unpacked for the sampler's seam
(`engine.model.sampling.sample_tokens(..., allowed=...)`): by numpy on the
host, or on the device from the words (1/32 of the mask crosses the bus).
Unconstrained rows, and rows before their grammar starts, allow everything.
A dead end (a matcher in an error state, a token it refused, or no token
allowed) is reported in `empty`: the row is sampled unmasked (never a NaN)
and its token replaced by -1, never an unconstrained token, and the loop's
check ends the request.

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

#: the step's allowed-token mask [S, V] (bool, on the logits' device) and the rows that allow nothing
Masks = tuple[torch.Tensor, list[int]]


class GrammarMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self._pin = device.type == "cuda"

    def begin(self, requests: Sequence[Request], device: torch.device, vocab: int) -> Callable[[], Masks | None] | None:
        """The rows' masks, to compute when called; None (nothing to do) when no row holds a grammar."""
        rows = [(row, state) for row, request in enumerate(requests)
                if (state := GrammarHook.state(request)) is not None]
        if not rows:
            return None
        outputs = [requests[row].output_token_ids for row, _ in rows]
        return lambda: self._masks(len(requests), rows, outputs, device, vocab)

    def bitmask(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """The rows' host bitmask now (None: no row constrained), as llguidance wrote it."""
        rows = [(row, state) for row, request in enumerate(requests)
                if (state := GrammarHook.state(request)) is not None]
        return self._fill(len(requests), rows, [requests[row].output_token_ids for row, _ in rows])[0]

    def _masks(self, batch: int, rows: list[tuple[int, GrammarState]], outputs: list[list[int]],
               device: torch.device, vocab: int) -> Masks | None:
        bitmask, empty = self._fill(batch, rows, outputs)
        return None if bitmask is None else (unpack(bitmask, empty, device, vocab), empty)

    def _fill(self, batch: int, rows: list[tuple[int, GrammarState]],
              outputs: list[list[int]]) -> tuple[torch.Tensor | None, list[int]]:
        masked: list[tuple[int, GrammarState]] = []
        for (row, state), output in zip(rows, outputs):
            state.sync(output)  # a refused token sets state.error: a dead end below
            if state.active or state.error is not None:  # else: before its marker (a reasoning model's thinking)
                masked.append((row, state))
        if not masked:
            return None, []
        bitmask = torch.full((batch, self.words), -1, dtype=torch.int32, pin_memory=self._pin)
        host = bitmask.numpy()
        stride = host.strides[0]
        for row, state in masked:
            state.write_mask(host.ctypes.data + row * stride, stride)
        # NOTE: what the masks say, read for all rows at once (a numpy call per row costs more)
        written = host[[row for row, _ in masked]]
        empty = np.asarray(~written.any(axis=1))
        stops = masked[0][1].stop_words
        only_stops = np.asarray((written == stops).all(axis=1) if stops is not None else np.zeros(len(masked), bool))
        dead = [row for i, (row, state) in enumerate(masked)
                if not state.settle(host[row], bool(only_stops[i]), bool(empty[i]))]
        return bitmask, dead


def unpack(bitmask: torch.Tensor, empty: list[int], device: torch.device, vocab: int) -> torch.Tensor:
    """The host bitmask as the sampler's [S, vocab] bool mask on `device`; the `empty` rows
    allow everything (they are sampled unmasked, then discarded)."""
    batch = bitmask.shape[0]
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        if bits.shape[1] < vocab:  # a mask narrower than the logits allows nothing past its end
            bits = np.concatenate((bits, np.zeros((batch, vocab - bits.shape[1]), np.uint8)), axis=1)
        bits[empty] = 1
        return torch.from_numpy(bits[:, :vocab]).view(torch.bool)
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(batch, -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.cat((allowed, allowed.new_zeros(batch, vocab - allowed.shape[1])), dim=1)
    allowed = allowed[:, :vocab]
    if empty:
        allowed[empty] = True
    return allowed
