"""Incremental detokenization and stop strings: streamed pieces add up to the
whole-text decode, a character split over tokens is never printed half, and a stop
string is cut out wherever token boundaries fall."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.tokenizer import ByteTokenizer
from engine.runtime.output_builder import IncrementalDetokenizer, StopMatcher

TEXT = st.text(alphabet=st.sampled_from(list("ab é€😀\n")), max_size=24)


class _WindowOnly:
    """The byte tokenizer without its streaming decoder: exercises the window-diff path."""

    def __init__(self) -> None:
        self._inner = ByteTokenizer()

    def decode(self, ids):
        return self._inner.decode(ids)


def _split(data: bytes, cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [list(data[a:b]) for a, b in zip(points, points[1:])]


class TestIncrementalDetokenizer:
    @settings(max_examples=200, deadline=None)
    @given(text=TEXT, cuts=st.lists(st.integers(0, 100), max_size=8), window=st.booleans())
    def test_pieces_add_up_to_the_whole_decode(self, text, cuts, window):
        """However the bytes are split into chunks, the pieces join to the whole text, none ends in half a character."""
        tokenizer = _WindowOnly() if window else ByteTokenizer()
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add(chunk) for chunk in _split(text.encode(), cuts)]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + detok.flush() == text

    def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement(self):
        """A stream that ends inside a character gives U+FFFD once, at the flush."""
        for tokenizer in (ByteTokenizer(), _WindowOnly()):
            detok = IncrementalDetokenizer(tokenizer)
            assert detok.add(list("é".encode())[:1]) == "" and detok.flush() == "\ufffd"


class TestStopMatcher:
    @settings(max_examples=300, deadline=None)
    @given(text=TEXT, stops=st.lists(st.text(alphabet=st.sampled_from(list("ab é")), min_size=1, max_size=3),
                                     min_size=1, max_size=3), cuts=st.lists(st.integers(0, 40), max_size=8))
    def test_output_is_the_text_before_the_first_stop(self, text, stops, cuts):
        """Fed in any pieces, the emitted text is what precedes the stop string that completes first."""
        matcher = StopMatcher(stops)
        points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
        out, stopped = "", False
        for a, b in zip(points, points[1:]):
            emitted, stopped = matcher.feed(text[a:b])
            out += emitted
            if stopped:
                break
        if not stopped:
            out += matcher.flush()
        ends = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]  # the stop completing first wins
        first = min(ends)[1] if ends else None
        assert out == (text if first is None else text[:first]) and stopped == (first is not None)
