"""The bytes a token stands for, read from a Hugging Face tokenizer's decoder.

A token's text (``decode([id])``) is not its bytes: a token holding part of
a multi-byte UTF-8 character decodes to U+FFFD. OpenAI's logprob ``bytes``
and ``text_offset`` need the token's own bytes, so that the bytes of a
message's tokens, joined, are the message's UTF-8.

    piece_bytes = PieceBytes.for_decoder(backend.decoder)
    piece_bytes(backend.id_to_token(token_id))   # b"\\xc3" for half of "é"

The decoders a token's bytes depend on, applied to the one piece:

- ``ByteLevel`` (GPT-2, Llama 3, Qwen): each character of the piece stands
  for one byte (the GPT-2 byte-to-unicode table).
- ``ByteFallback`` (Llama 2, Mistral, Gemma): a piece ``<0xNN>`` is byte NN.
- ``Replace`` and ``Metaspace``: ``▁`` (or the pattern) becomes a space.
- ``Fuse`` and ``Strip`` act on a sequence of pieces (joining them,
  dropping the first piece's leading space), not on one: ignored here, so a
  sentencepiece token keeps its leading space.

Any other decoder (WordPiece, CTC, ...) falls back to the UTF-8 of the
piece as it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (character -> byte)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(kept)
    shifted = 0
    for byte in range(256):
        if byte not in kept:
            kept.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(char): byte for byte, char in zip(kept, chars)}


_BYTE_LEVEL = _byte_level_table()


class PieceBytes:
    """Maps a vocabulary piece to the bytes it decodes to, per the decoder's per-piece steps."""

    def __init__(self, *, byte_level: bool = False, byte_fallback: bool = False,
                 replacements: tuple[tuple[str, str], ...] = ()) -> None:
        self.byte_level = byte_level
        self.byte_fallback = byte_fallback
        self.replacements = replacements

    @classmethod
    def for_decoder(cls, decoder: Any) -> PieceBytes:
        """Read a `tokenizers` decoder (None: pieces are their text)."""
        if decoder is None:
            return cls()
        try:
            spec = json.loads(decoder.__getstate__())
        except Exception:  # noqa: BLE001 - an unreadable decoder: pieces are their text
            return cls()
        steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
        byte_level = byte_fallback = False
        replacements: list[tuple[str, str]] = []
        for step in steps:
            kind = step.get("type")
            if kind == "ByteLevel":
                byte_level = True
            elif kind == "ByteFallback":
                byte_fallback = True
            elif kind == "Metaspace":
                replacements.append((step.get("replacement", "\u2581"), " "))
            elif kind == "Replace" and isinstance(step.get("pattern"), dict) and "String" in step["pattern"]:
                replacements.append((step["pattern"]["String"], step.get("content", "")))
        return cls(byte_level=byte_level, byte_fallback=byte_fallback, replacements=tuple(replacements))

    def __call__(self, piece: str) -> bytes:
        if self.byte_fallback:
            match = _BYTE_PIECE.fullmatch(piece)
            if match is not None:
                return bytes([int(match.group(1), 16)])
        if self.byte_level and all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        for pattern, content in self.replacements:
            piece = piece.replace(pattern, content)
        return piece.encode("utf-8", errors="replace")
