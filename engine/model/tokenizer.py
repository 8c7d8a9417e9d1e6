"""Text <-> token ids: the `Tokenizer` protocol the engine reads, the
byte-level tokenizer of the embedded tiny model, and a wrapper around a
Hugging Face ``tokenizer.json`` (the `tokenizers` package, imported lazily).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.model.model_config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_IMAGE_ID, BYTE_PAD_ID, TINY_VOCAB_SIZE

if TYPE_CHECKING:
    import tokenizers

    from engine.model.model_config import ModelConfig


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer.

    `encode` never adds special tokens except BOS when `add_bos` is true and
    the tokenizer has one. `decode` drops special tokens (BOS, EOS, PAD,
    IMAGE and any other id the tokenizer marks special) and replaces invalid
    UTF-8 instead of raising, so any id sequence the model emits decodes.
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def pad_token_id(self) -> int: ...
    @property
    def image_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are token ids 0..255; specials sit above 255.

    Ids at or above 256 that are not text (BOS, EOS, PAD, IMAGE and the unused
    ids up to `vocab_size`) are dropped by `decode`.
    """

    def __init__(
        self,
        *,
        vocab_size: int = TINY_VOCAB_SIZE,
        bos_token_id: int | None = BYTE_BOS_ID,
        eos_token_id: int = BYTE_EOS_ID,
        pad_token_id: int = BYTE_PAD_ID,
        image_token_id: int | None = BYTE_IMAGE_ID,
    ) -> None:
        for name, token_id in (
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("pad_token_id", pad_token_id),
            ("image_token_id", image_token_id),
        ):
            if token_id is not None and not 256 <= token_id < vocab_size:
                raise ValueError(f"ByteTokenizer {name} must be in [256, vocab_size={vocab_size}), got {token_id}")
        self._vocab_size = vocab_size
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self._image_token_id = image_token_id

    @classmethod
    def for_config(cls, config: ModelConfig) -> ByteTokenizer:
        """A byte tokenizer using `config`'s special token ids."""
        return cls(
            vocab_size=config.vocab_size,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            image_token_id=config.image_token_id,
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    @property
    def image_token_id(self) -> int | None:
        return self._image_token_id

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos and self._bos_token_id is not None:
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` behind the `Tokenizer` protocol.

    Special token ids come from the model config (config.json is the source
    of truth for BOS/EOS/PAD), not from the tokenizer file.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int,
        pad_token_id: int,
        image_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self._image_token_id = image_token_id
        self._special_ids = frozenset(
            t for t in (bos_token_id, eos_token_id, pad_token_id, image_token_id) if t is not None
        )

    @classmethod
    def from_file(cls, path: str | Path, config: ModelConfig) -> HFTokenizer:
        """Load ``tokenizer.json`` at `path`, with `config`'s special ids."""
        import tokenizers

        return cls(
            tokenizers.Tokenizer.from_file(str(path)),
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            image_token_id=config.image_token_id,
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    @property
    def image_token_id(self) -> int | None:
        return self._image_token_id

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and self._bos_token_id is not None:
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        kept = [t for t in token_ids if t not in self._special_ids]
        return self._backend.decode(kept, skip_special_tokens=True)
