"""The model's vocabulary as llguidance sees it: built once per model (per tokenizer object).

llguidance computes masks over token *bytes*, so it needs every token's
bytes and which ids are special. Two vocabularies are supported:

- the byte tokenizer of the built-in models: ids 0-255 are the bytes, the
  ids above are special (BOS, EOS, PAD, IMAGE, unused);
- a checkpoint's ``tokenizer.json`` (the `tokenizers` library's BPE,
  byte-level or with byte fallback), read by llguidance itself from the same
  JSON the engine tokenizes with, declared special tokens included.

The mask covers the model's whole vocabulary (`vocab_size`, which may be
larger than the tokenizer's: padding rows are never allowed). The model's
stop ids are llguidance's EOS: allowed exactly when the grammar is complete.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.model.tokenizer import ByteTokenizer, HFTokenizer

INSTALL_HINT = "pip install 'kvlife[structured]'"


class UnsupportedVocabulary(ValueError):
    """The model's tokenizer cannot drive a grammar (no vocabulary: a checkpoint without tokenizer.json)."""


def llguidance_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class _ByteTokens:
    """The byte tokenizer in the shape llguidance's `TokenizerWrapper` reads."""

    def __init__(self, tokenizer: ByteTokenizer, stop_ids: list[int]) -> None:
        vocab = tokenizer.vocab_size
        named = {tokenizer.bos_token_id: b"<s>", tokenizer.eos_token_id: b"</s>", tokenizer.pad_token_id: b"<pad>",
                 tokenizer.image_token_id: b"<image>"}
        self.tokens = [bytes([i]) for i in range(256)] + [named.get(i, b"<unused_%d>" % i) for i in range(256, vocab)]
        self.special_token_ids = list(range(256, vocab))
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: Any) -> list[int]:
        return list(text) if isinstance(text, bytes) else list(str(text).encode("utf-8"))


def build_vocabulary(tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> Any:
    """An `llguidance.LLTokenizer` for the model (raises UnsupportedVocabulary, or ImportError
    without llguidance)."""
    import llguidance

    stops = sorted(t for t in stop_ids if 0 <= t < vocab_size)
    if not stops:
        raise UnsupportedVocabulary("the model has no stop token id inside its vocabulary")
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(_ByteTokens(tokenizer, stops))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=stops)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=max(vocab_size, tokenizer.vocab_size),
                                      eos_token=stops)
    raise UnsupportedVocabulary(f"{type(tokenizer).__name__} has no vocabulary (a checkpoint without tokenizer.json)")
