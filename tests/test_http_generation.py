"""Text streaming rules of engine.serve.generation: what is held back until it is settled."""

from __future__ import annotations

import pytest

from engine.serve.generation import _holdback


class TestHoldback:
    @pytest.mark.parametrize(("text", "stops", "hold"), [
        ("abc", (), 0),
        ("abc", ("xy",), 0),
        ("ab", ("bc",), 1),  # "b" may start the stop string "bc"
        ("abb", ("bbc", "b!"), 2),  # the longest prefix wins
        ("a\ufffd", (), 1),  # an incomplete UTF-8 character
        ("ab\ufffd", ("b\u00e9",), 2),  # "b" + half of "é" may still become the stop string
    ])
    def test_holdback(self, text, stops, hold):
        """Held back: a stop string's prefix at the end and trailing U+FFFD, nothing else."""
        assert _holdback(text, stops) == hold
