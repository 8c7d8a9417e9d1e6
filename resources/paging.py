"""Page arithmetic, written once."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // page_size)


def round_up(num_tokens: int, page_size: int) -> int:
    """`num_tokens` rounded up to whole pages, in tokens."""
    return pages_for(num_tokens, page_size) * page_size
