"""Tests for engine.tokenizer: the byte tokenizer and the tokenizer.json wrapper."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.model.model_config import ModelConfig
from engine.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


class TestByteTokenizer:
    @given(st.text())
    def test_round_trip(self, text):
        """decode(encode(text)) == text for any text, with or without BOS."""
        tokenizer = ByteTokenizer()
        assert tokenizer.decode(tokenizer.encode(text)) == text
        assert tokenizer.decode(tokenizer.encode(text, add_bos=True)) == text

    def test_ids_are_utf8_bytes_with_optional_bos(self):
        """encode gives UTF-8 bytes, preceded by BOS only when asked."""
        tokenizer = ByteTokenizer()
        assert tokenizer.encode("hé") == [104, 0xC3, 0xA9]
        assert tokenizer.encode("hé", add_bos=True) == [256, 104, 0xC3, 0xA9]

    def test_decode_skips_specials_and_replaces_bad_utf8(self):
        """decode drops ids >= 256 and turns invalid UTF-8 into U+FFFD."""
        tokenizer = ByteTokenizer()
        assert tokenizer.decode([256, 104, 257, 258, 259, 263, 105]) == "hi"
        assert tokenizer.decode([0xC3]) == "\ufffd"

    def test_special_ids_match_tiny_config(self):
        """The default byte tokenizer's ids and vocabulary are tiny()'s."""
        tokenizer, config = ByteTokenizer(), ModelConfig.tiny()
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.image_token_id) == (
            config.bos_token_id,
            config.eos_token_id,
            config.pad_token_id,
            config.image_token_id,
        )
        assert tokenizer.vocab_size == config.vocab_size
        assert isinstance(tokenizer, Tokenizer)

    def test_special_id_inside_byte_range_is_rejected(self):
        """A special id below 256 would collide with a byte and raises ValueError."""
        with pytest.raises(ValueError, match="eos_token_id"):
            ByteTokenizer(eos_token_id=10)


class TestHFTokenizer:
    @pytest.fixture
    def tokenizer(self, tmp_path) -> HFTokenizer:
        tokenizers = pytest.importorskip("tokenizers")
        vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<image>": 3, "hello": 4, "world": 5, "[UNK]": 6}
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        backend.add_special_tokens(["<s>", "</s>", "<pad>", "<image>"])
        path = tmp_path / "tokenizer.json"
        backend.save(str(path))
        config = ModelConfig.tiny(vocab_size=8, bos_token_id=0, eos_token_id=1, pad_token_id=2, image_token_id=3)
        return HFTokenizer.from_file(path, config)

    def test_encode_adds_only_requested_bos(self, tokenizer):
        """encode adds no specials except BOS when asked."""
        assert tokenizer.encode("hello world") == [4, 5]
        assert tokenizer.encode("hello world", add_bos=True) == [0, 4, 5]

    def test_decode_skips_specials(self, tokenizer):
        """decode drops BOS, EOS, PAD and IMAGE."""
        assert tokenizer.decode([0, 4, 3, 5, 1, 2]) == "hello world"

    def test_interface(self, tokenizer):
        """HFTokenizer satisfies Tokenizer with the config's special ids."""
        assert isinstance(tokenizer, Tokenizer)
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.image_token_id) == (
            0,
            1,
            2,
            3,
        )
        assert tokenizer.vocab_size == 7
