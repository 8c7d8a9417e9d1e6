"""Tests for engine.model.tokenizer: the byte tokenizer, tokenizer.json encoded as
transformers encodes it, and checkpoints without a tokenizer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from engine.errors import InvalidRequest
from engine.model.checkpoint import CheckpointError
from engine.model.model_config import ModelConfig
from engine.model.tokenizer import ByteTokenizer, HFTokenizer, TokenIdsOnly, Tokenizer, load_tokenizer


class TestByteTokenizer:
    @given(st.text())
    def test_round_trip(self, text):
        """decode(encode(text)) == text for any text, with or without BOS."""
        assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text
        assert ByteTokenizer().decode(ByteTokenizer(add_bos=True).encode(text)) == text

    def test_ids_are_utf8_bytes_with_optional_bos(self):
        """encode gives UTF-8 bytes, preceded by BOS only for a tokenizer built to add it."""
        assert ByteTokenizer().encode("hé") == [104, 0xC3, 0xA9]
        assert ByteTokenizer(add_bos=True).encode("hé") == [256, 104, 0xC3, 0xA9]
        assert ByteTokenizer(add_bos=True).encode("hé", add_special_tokens=False) == [104, 0xC3, 0xA9]

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


def _backend(template: str | None = None):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<image>": 3, "hello": 4, "world": 5, "[UNK]": 6, "<x>": 7}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>", "<pad>", "<image>"])
    if template is not None:
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    return backend


_CONFIG = ModelConfig.tiny(vocab_size=8, bos_token_id=0, eos_token_id=1, pad_token_id=2, image_token_id=3)


def _save(directory, backend, tokenizer_config=None):
    backend.save(str(directory / "tokenizer.json"))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


class TestHFTokenizer:
    @pytest.fixture
    def tokenizer(self, tmp_path) -> HFTokenizer:
        return HFTokenizer.from_file(_save(tmp_path, _backend()) / "tokenizer.json", _CONFIG)

    def test_no_post_processor_adds_nothing(self, tokenizer):
        """Without a post-processor encode adds no specials, as transformers does."""
        assert tokenizer.encode("hello world") == [4, 5]

    @pytest.mark.parametrize(("template", "ids"), [("<s> $A", [0, 4, 5]), ("<s> $A </s>", [0, 4, 5, 1])])
    def test_post_processor_adds_bos_and_eos(self, tmp_path, template, ids):
        """A template post-processor's BOS/EOS are added by encode, and not with add_special_tokens=False."""
        tokenizer = load_tokenizer(_save(tmp_path, _backend(template)), _CONFIG)
        assert tokenizer.encode("hello world") == ids
        assert tokenizer.encode("hello world", add_special_tokens=False) == [4, 5]

    def test_special_tokens_in_text_are_one_id(self, tokenizer):
        """A special token written in the text encodes to its id, never split."""
        assert tokenizer.encode("hello</s>world") == [4, 1, 5]

    def test_specials_declared_in_tokenizer_config_are_registered(self, tmp_path):
        """A special token only tokenizer_config.json declares is never split, and decode drops it."""
        directory = _save(tmp_path, _backend(), {"additional_special_tokens": ["<x>"], "eos_token": "</s>"})
        tokenizer = load_tokenizer(directory, _CONFIG)
        assert tokenizer.encode("hello<x>world") == [4, 7, 5]
        assert tokenizer.decode([4, 7, 5]) == "hello world"

    def test_split_special_tokens_is_honoured(self, tmp_path):
        """tokenizer_config.json's split_special_tokens=true splits them, as transformers does."""
        directory = _save(tmp_path, _backend(), {"split_special_tokens": True})
        assert 1 not in load_tokenizer(directory, _CONFIG).encode("hello </s> world")

    def test_add_bos_token_that_tokenizer_json_contradicts_is_warned_about(self, tmp_path):
        """add_bos_token=true with no BOS in the post-processor: a warning, and tokenizer.json wins."""
        directory = _save(tmp_path, _backend(), {"add_bos_token": True})
        with capture_logs() as logs:
            tokenizer = load_tokenizer(directory, _CONFIG)
        assert tokenizer.encode("hello") == [4]
        assert [e["flag"] for e in logs if e["event"] == "checkpoint.tokenizer_flag_ignored"] == ["add_bos_token"]

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
        assert tokenizer.vocab_size == 8

    def test_unreadable_tokenizer_json_is_named(self, tmp_path):
        """A corrupt tokenizer.json raises CheckpointError naming the file."""
        (tmp_path / "tokenizer.json").write_text("{not json")
        with pytest.raises(CheckpointError, match="tokenizer.json"):
            load_tokenizer(tmp_path, _CONFIG)


class TestWithoutTokenizer:
    def test_a_directory_without_tokenizer_json_warns_and_takes_ids_only(self, tmp_path):
        """No tokenizer.json: a warning naming the directory, and a tokenizer that refuses text with InvalidRequest."""
        with capture_logs() as logs:
            tokenizer = load_tokenizer(tmp_path, _CONFIG)
        assert [e["path"] for e in logs if e["event"] == "checkpoint.no_tokenizer"] == [str(tmp_path)]
        assert isinstance(tokenizer, TokenIdsOnly) and isinstance(tokenizer, Tokenizer)
        with pytest.raises(InvalidRequest, match="token ids: this checkpoint has no tokenizer.json") as caught:
            tokenizer.encode("hello")
        assert caught.value.field == "prompt"
        assert tokenizer.decode([4, 5]) == "" and tokenizer.vocab_size == 8

    def test_byte_level_checkpoints_get_the_byte_tokenizer(self, tmp_path):
        """A checkpoint marked byte-level (kvlife's own) gets the byte tokenizer, no warning."""
        with capture_logs() as logs:
            tokenizer = load_tokenizer(tmp_path, ModelConfig.tiny(), byte_level=True)
        assert isinstance(tokenizer, ByteTokenizer) and not logs


class TestTokenBytes:
    """`token_bytes`: the bytes a token stands for, so a token holding part of a character is not U+FFFD."""

    TEXT = "héllo wörld ✓"

    def test_byte_tokenizer(self):
        """The byte model's token t is byte t; special ids stand for no bytes."""
        tokenizer = ByteTokenizer()
        assert b"".join(tokenizer.token_bytes(t) for t in tokenizer.encode(self.TEXT)) == self.TEXT.encode()
        assert tokenizer.token_bytes(0xC3) == b"\xc3" and tokenizer.token_bytes(256) == b""

    def test_byte_level_bpe(self):
        """A GPT-2 style byte-level tokenizer (Llama 3, Qwen): joined, the tokens' bytes are the text's."""
        tokenizers = pytest.importorskip("tokenizers")
        alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
        vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
        vocab["<s>"] = len(vocab)
        backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = tokenizers.decoders.ByteLevel()
        tokenizer = HFTokenizer(backend, bos_token_id=vocab["<s>"], eos_token_id=None, pad_token_id=None)
        ids = tokenizer.encode(self.TEXT)
        assert any(tokenizer.decode([t]) == "\ufffd" for t in ids)  # some tokens hold part of a character
        assert b"".join(tokenizer.token_bytes(t) for t in ids) == self.TEXT.encode()
        assert tokenizer.token_bytes(vocab["<s>"]) == b""

    def test_sentencepiece_byte_fallback(self):
        """A sentencepiece-style tokenizer (Llama 2, Mistral, Gemma): `<0xNN>` pieces are their byte, `▁` a space."""
        tokenizers = pytest.importorskip("tokenizers")
        vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁h": 257, "llo": 258, "▁w": 259}
        backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], byte_fallback=True,
                                                             unk_token="<unk>"))
        backend.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                              tokenizers.normalizers.Replace(" ", "▁")])
        backend.decoder = tokenizers.decoders.Sequence([
            tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(" ", 1, 0)])
        tokenizer = HFTokenizer(backend, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        assert tokenizer.token_bytes(1 + 0xC3) == b"\xc3" and tokenizer.token_bytes(257) == b" h"
        ids = [257, 1 + 0xC3, 1 + 0xA9, 258]  # "▁h", "é" as two byte pieces, "llo"
        assert tokenizer.decode(ids) == "héllo"
        assert b"".join(tokenizer.token_bytes(t) for t in ids).decode() == " héllo"  # the piece's own space
