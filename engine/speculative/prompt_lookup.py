"""Prompt lookup: draft tokens from the request's own tokens, no model.

The last n tokens of the request (prompt and output so far) are looked up
earlier in the same tokens, n from `ngram_max` down to `ngram_min`; the
tokens that followed the most recent earlier occurrence are the draft (a copy
that runs past the end keeps copying what it has just proposed, so a loop
keeps looping)::

    tokens  ... a b c d e ... x y a b c
                      ^^^^^ the draft (up to k tokens): d e ...
    the last 3 tokens (a b c) occur earlier; what followed them is proposed

The search runs in C (`bytes.rfind` over the tokens packed as 32-bit ints);
a hit that is not aligned on a token boundary is skipped.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("i").itemsize


def propose_ngram(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens`, or [] when no n-gram of the last
    `ngram_max` .. `ngram_min` tokens occurs earlier in `tokens`."""
    length = len(tokens)
    if k <= 0 or length < ngram_min + 1:
        return []
    packed = array("i", tokens).tobytes()
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        pattern = packed[(length - n) * _WIDTH :]
        # an earlier occurrence ends before the last token: at least one token follows it
        end = (length - 1) * _WIDTH
        while True:
            at = packed.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % _WIDTH == 0:
                return _continue(tokens, at // _WIDTH + n, k)
            end = at + len(pattern) - 1  # misaligned: look further back
    return []


def _continue(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens copied from `start` on; past the end the copy reads its own output, so a
    repeating span keeps repeating (LZ77-style): ``a b a b a`` after ``a`` -> ``b a b a``."""
    length = len(tokens)
    draft = list(tokens[start : min(start + k, length)])
    while len(draft) < k:
        draft.append(draft[start + len(draft) - length])
    return draft
