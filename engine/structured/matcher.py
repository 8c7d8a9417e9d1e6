"""`GrammarState`: one request's matcher, kept in step with the request's output.

The state never trusts a count of its own: `sync(output)` brings the matcher
to the request's output tokens, consuming what is new and rolling back what
the output no longer has (a prefill whose first token was refused and is
recomputed, a retraction that kept fewer tokens). So a matcher always stands
exactly after the tokens the request keeps, whatever path moved them. The
runner's masks sync before each mask, in the step's mask thread: a token is
consumed when the next mask is computed, off the event loop's thread and
while the forward pass runs.

With `Constraint.starts_after` (a reasoning model's end-of-thinking text),
the matcher starts at the token after the one that completes that text; until
then the state is inactive and the output is free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.structured.constraint import Constraint


class GrammarState:
    """A matcher and where, in the request's output, its grammar starts."""

    def __init__(self, matcher: Any, constraint: Constraint, decode: Callable[[Sequence[int]], str],
                 stop_words: np.ndarray | None = None) -> None:
        self.matcher: Any = matcher
        #: the mask words of "only the stop tokens" (the mask of a complete grammar)
        self.stop_words = stop_words
        #: the latest mask allowed only the stop tokens: the grammar is complete there
        self.done = False
        self.constraint = constraint
        self._decode = decode
        self._marker = constraint.starts_after
        #: output index of the grammar's first token (None: still before `starts_after`)
        self.start: int | None = None if self._marker else 0
        #: output tokens scanned for the marker / consumed by the matcher (from `start`)
        self._scanned = 0
        self.consumed = 0
        #: why the grammar cannot go on (a refused token, a dead end), once it cannot
        self.error: str | None = None
        #: whether that is a dead end (the grammar could not take a token its own mask allowed)
        self.dead_end = False
        #: the latest mask row and how many tokens were consumed when it was computed
        self._mask: tuple[int, np.ndarray] | None = None

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (after any marker)."""
        return self.start is not None and self.matcher is not None

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more: the output so far is a whole match (asks the matcher)."""
        return self.active and self.matcher.is_stopped() and not self.matcher.is_error()

    def synced_to(self, num_output_tokens: int) -> bool:
        """Whether the matcher stands after exactly `num_output_tokens` output tokens."""
        return self.start is not None and self.start + self.consumed == num_output_tokens

    def close(self) -> None:
        """Drop the matcher (its memory goes with it); the state is then inert."""
        self.matcher = None

    # ------------------------------------------------------------ progress
    def sync(self, output: Sequence[int]) -> bool:
        """Bring the matcher to `output`; False if it refused a token (`error` says which)."""
        if self.matcher is None or self.error is not None:
            return self.error is None
        if self.start is not None and len(output) < self.start:  # the marker itself was dropped
            self.matcher.reset()
            self.start, self.consumed = None, 0
        if self.start is None:
            self._scanned = min(self._scanned, len(output))
            base = max(0, self._scanned - self._window() + 1)
            self._scan(output[base:], base)
            if self.start is None:
                return True
        want = len(output) - self.start
        if want != self.consumed:
            self.done = False  # known for the position of the latest mask only
        if want < self.consumed:
            self.matcher.rollback(self.consumed - want)
            self.consumed = want
        for token in output[self.start + self.consumed:]:
            if not self.matcher.consume_token(token):
                # NOTE: a token our own mask allowed cannot be a violation: the grammar hit a limit
                self.dead_end = self._allowed(token)
                detail = " ".join(self.matcher.get_error().split())[:400]
                self.error = (detail if self.dead_end else
                              f"token {token} is not allowed after {self.consumed} constrained tokens")
                return False
            self.consumed += 1
        return True

    def _allowed(self, token: int) -> bool:
        """Whether the latest mask, computed at the current position, allowed `token`."""
        if self._mask is None or self._mask[0] != self.consumed or not 0 <= token < 32 * len(self._mask[1]):
            return False
        return bool((int(self._mask[1][token >> 5]) >> (token & 31)) & 1)

    # ------------------------------------------------------------ masks
    def write_mask(self, address: int, nbytes: int) -> None:
        """Have llguidance write the allowed next tokens at `address` (int32 words, host memory),
        unless the grammar already cannot go on (`settle` then zeroes the row)."""
        if self.error is None:
            self.matcher.unsafe_compute_mask_ptr(address, nbytes)

    def settle(self, words: np.ndarray, only_stops: bool, empty: bool) -> bool:
        """After `write_mask`: read what the mask says (`only_stops`: it allows exactly the stop
        tokens; `empty`: nothing). False, and the row zeroed, at a dead end: an error state, or
        no token allowed. A mask of only the stop tokens means the grammar is complete (`done`).

        NOTE: the matcher's own state queries cost microseconds each; the mask says it all but for
        an error state (which also allows only the stop tokens), checked only then."""
        if self.error is None:
            if empty:
                self.error, self.dead_end = f"no token is allowed after {self.consumed} constrained tokens", True
            elif only_stops:
                if self.matcher.is_error():
                    self.error, self.dead_end = " ".join(self.matcher.get_error().split())[:400], True
                else:
                    self.done = True
        if self.error is not None:
            words[:] = 0
            return False
        self._mask = (self.consumed, words)
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """`write_mask` then `settle` for one row of a host int32 bitmask (the batch does it
        vectorized: `engine.structured.masks`)."""
        words = bitmask.numpy()[row]
        self.write_mask(words.ctypes.data, words.nbytes)
        only_stops = self.stop_words is not None and bool((words == self.stop_words).all())
        return self.settle(words, only_stops, not words.any())

    # ------------------------------------------------------------ the marker
    def _window(self) -> int:
        """Tokens enough to hold the marker however it is split (a token may decode to nothing)."""
        return 2 * len(self._marker or "") + 8

    def _scan(self, tokens: Sequence[int], base: int) -> None:
        """Look for the marker in the output tokens not scanned yet; `tokens` are the output
        from index `base` on (with enough before the unscanned ones to hold a split marker)."""
        marker = self._marker
        assert marker is not None
        window = self._window()
        for i in range(max(self._scanned, base), base + len(tokens)):
            lo = max(base, i + 1 - window)
            if marker in self._decode(tokens[lo - base: i + 1 - base]):
                self.start = i + 1
                break
        self._scanned = base + len(tokens) if self.start is None else self.start
