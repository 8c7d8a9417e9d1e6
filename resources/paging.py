"""Page and size-class arithmetic, written once."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // page_size)


def round_up(num_tokens: int, page_size: int) -> int:
    """`num_tokens` rounded up to whole pages, in tokens."""
    return pages_for(num_tokens, page_size) * page_size


def size_class(n: int, cap: int | None = None) -> int:
    """`n` rounded up to its size class: exact up to 8, then four classes per doubling
    (10, 12, 14, 16, 20, 24, ...), so at most a quarter is slack; at most `cap`."""
    step = 1 << max(n.bit_length() - 3, 0)
    size = round_up(n, step)
    return size if cap is None else min(size, cap)


def size_class_below(n: int) -> int:
    """The largest size class at most `n` (n >= 1): `n` rounded down on the same grid as `size_class`."""
    step = 1 << max(n.bit_length() - 3, 0)
    return n // step * step
