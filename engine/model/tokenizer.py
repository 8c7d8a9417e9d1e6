"""Text <-> token ids: the `Tokenizer` protocol the engine reads, the
byte-level tokenizer of the embedded tiny model, a Hugging Face
``tokenizer.json`` that encodes as transformers does (the `tokenizers`
package, imported lazily), and the stand-in for a checkpoint without one.
"""

from __future__ import annotations

import codecs

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import structlog

from engine.errors import InvalidRequest
from engine.model.hf_config import CheckpointError
from engine.model.model_config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_IMAGE_ID, BYTE_PAD_ID, TINY_VOCAB_SIZE
from engine.model.token_bytes import PieceBytes

if TYPE_CHECKING:
    import tokenizers

    from engine.model.model_config import ModelConfig

log = structlog.get_logger("kvlife.model")

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
EXTRA_HINT = "pip install 'kvlife[checkpoints]'"

#: tokenizer_config.json keys whose values transformers registers as special tokens.
_NAMED_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_SPECIAL_LIST_KEYS = ("additional_special_tokens", "extra_special_tokens")


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer.

    `encode(text)` tokenizes as transformers' ``tokenizer(text)`` does: it
    adds the special tokens the tokenizer's own rules add (BOS, EOS), and
    never splits a special token written in the text; with
    ``add_special_tokens=False`` it adds none. `decode` drops special tokens
    (BOS, EOS, PAD, IMAGE and any other id the tokenizer marks special) and
    replaces invalid UTF-8 instead of raising, so any id sequence the model
    emits decodes.
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def image_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for: part of a multi-byte character is its raw bytes (where
        `decode([token_id])` gives U+FFFD); b"" for a token `decode` drops (BOS, EOS, ...)."""
        ...


class _SpecialIds:
    """The special-id properties every tokenizer here shares."""

    def __init__(self, *, bos_token_id: int | None, eos_token_id: int | None, pad_token_id: int | None,
                 image_token_id: int | None) -> None:
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self._image_token_id = image_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def image_token_id(self) -> int | None:
        return self._image_token_id

    def _named_special_ids(self) -> frozenset[int]:
        return frozenset(t for t in (self._bos_token_id, self._eos_token_id, self._pad_token_id, self._image_token_id)
                         if t is not None)


class ByteTokenizer(_SpecialIds):
    """UTF-8 bytes are token ids 0..255; specials sit above 255.

    `encode` adds BOS only when built with ``add_bos=True`` (the tiny model's
    default is without). Ids at or above 256 that are not text (BOS, EOS,
    PAD, IMAGE and the unused ids up to `vocab_size`) are dropped by `decode`.
    """

    def __init__(
        self,
        *,
        vocab_size: int = TINY_VOCAB_SIZE,
        bos_token_id: int | None = BYTE_BOS_ID,
        eos_token_id: int | None = BYTE_EOS_ID,
        pad_token_id: int | None = BYTE_PAD_ID,
        image_token_id: int | None = BYTE_IMAGE_ID,
        add_bos: bool = False,
    ) -> None:
        for name, token_id in (
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("pad_token_id", pad_token_id),
            ("image_token_id", image_token_id),
        ):
            if token_id is not None and not 256 <= token_id < vocab_size:
                raise ValueError(f"ByteTokenizer {name} must be in [256, vocab_size={vocab_size}), got {token_id}")
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         image_token_id=image_token_id)
        self._vocab_size = vocab_size
        self._add_bos = add_bos and bos_token_id is not None

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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self._add_bos:
            assert self._bos_token_id is not None
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def incremental_decoder(self) -> ByteStreamDecoder:
        """A decoder that turns ids into text as they come, O(1) per id (the engine's
        streaming path uses it instead of re-decoding a window)."""
        return ByteStreamDecoder()


class ByteStreamDecoder:
    """UTF-8 decoding of byte ids as they arrive; a character split over ids waits for its end."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(t for t in token_ids if 0 <= t < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class HFTokenizer(_SpecialIds):
    """A Hugging Face ``tokenizer.json`` behind the `Tokenizer` protocol,
    encoding as transformers does.

    - BOS/EOS: what ``tokenizer.json``'s post-processor adds (a template such
      as ``<s> $A``, or nothing). transformers 5 ignores
      ``tokenizer_config.json``'s ``add_bos_token``/``add_eos_token`` when a
      ``tokenizer.json`` is present, and so does kvlife; `from_directory`
      warns when they disagree with the post-processor.
    - Special tokens: every special token ``tokenizer_config.json`` declares
      (``bos_token`` ... ``additional_special_tokens``, ``added_tokens_decoder``)
      is registered as transformers registers it, so it is never split.

    Special token ids (BOS/EOS/PAD) come from the model config, the source of
    truth for the engine's stop ids.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None,
        image_token_id: int | None = None,
    ) -> None:
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         image_token_id=image_token_id)
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._special_ids = self._named_special_ids() | {i for i, token in added.items() if token.special}
        self._added = {i: token.content.encode() for i, token in added.items()}
        self._piece_bytes = PieceBytes.for_decoder(backend.decoder)

    @classmethod
    def from_file(cls, path: str | Path, config: ModelConfig,
                  tokenizer_config: dict[str, Any] | None = None) -> HFTokenizer:
        """``tokenizer.json`` at `path` with `config`'s special ids and the
        special tokens `tokenizer_config` (``tokenizer_config.json``) declares."""
        tokenizers = _import_tokenizers()
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise CheckpointError(str(path), f"unreadable tokenizer file ({exc})") from None
        if tokenizer_config:
            _register_declared_specials(backend, tokenizer_config, tokenizers)
            backend.encode_special_tokens = bool(tokenizer_config.get("split_special_tokens", False))
        return cls(backend, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                   pad_token_id=config.pad_token_id, image_token_id=config.image_token_id)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        kept = [t for t in token_ids if t not in self._special_ids]
        return self._backend.decode(kept, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids:
            return b""
        if token_id in self._added:  # added tokens are matched as written, never byte-mapped
            return self._added[token_id]
        piece = self._backend.id_to_token(token_id)
        return b"" if piece is None else self._piece_bytes(piece)

    def backend_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (the declared special tokens included),
        for libraries that build their own view of the vocabulary (structured output's)."""
        return self._backend.to_str()

    def added_by_encode(self) -> list[int]:
        """The ids `encode` adds around any text (e.g. ``[bos]``)."""
        return self._backend.encode("", add_special_tokens=True).ids

    def id_to_token(self, token_id: int) -> str:
        """The token's own string in the vocabulary (``Ġhello``), as transformers'
        ``convert_ids_to_tokens`` gives it (`/tokenize`'s ``token_strs``)."""
        return self._backend.id_to_token(token_id) or ""


class TokenIdsOnly(_SpecialIds):
    """The tokenizer of a checkpoint without ``tokenizer.json``: prompts must
    be token ids; encoding text raises `InvalidRequest` saying why, and
    `decode` gives "" (there is no vocabulary to decode with)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id, image_token_id=config.image_token_id)
        self._vocab_size = config.vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequest("prompt", f"token ids: this checkpoint has no {TOKENIZER_FILE}, so text prompts "
                             "cannot be encoded (send a list of token ids)", text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def load_tokenizer(directory: Path, config: ModelConfig, *, byte_level: bool = False) -> Tokenizer:
    """The tokenizer of checkpoint `directory`: its ``tokenizer.json`` (with
    ``tokenizer_config.json``) when present; else the byte tokenizer when the
    checkpoint says it is byte-level (kvlife's own); else `TokenIdsOnly`,
    with a warning."""
    path = directory / TOKENIZER_FILE
    if path.is_file():
        tokenizer_config = _read_optional_json(directory / TOKENIZER_CONFIG_FILE)
        tokenizer = HFTokenizer.from_file(path, config, tokenizer_config)
        _warn_on_ignored_flags(directory, tokenizer, tokenizer_config, config)
        return tokenizer
    if byte_level:
        return ByteTokenizer.for_config(config)
    log.warning("checkpoint.no_tokenizer", path=str(directory),
                detail=f"no {TOKENIZER_FILE}: text prompts are refused, token-id prompts work")
    return TokenIdsOnly(config)


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise CheckpointError(TOKENIZER_FILE, f"reading it needs the `tokenizers` package: {EXTRA_HINT}") from None
    return tokenizers


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(path), f"unreadable ({exc})") from None


def _content(value: Any) -> tuple[str, dict[str, Any]] | None:
    """(content, AddedToken flags) of a tokenizer_config.json token entry."""
    if isinstance(value, str):
        return value, {}
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        return value["content"], flags
    return None


def _register_declared_specials(backend: tokenizers.Tokenizer, tokenizer_config: dict[str, Any], tokenizers) -> None:
    """Add the tokens tokenizer_config.json declares that tokenizer.json
    does not already have, as transformers does on load."""
    declared: list[tuple[str, dict[str, Any]]] = []
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    entries = [*decoder.values()] if isinstance(decoder, dict) else []
    entries += [tokenizer_config.get(key) for key in _NAMED_SPECIAL_KEYS]
    for key in _SPECIAL_LIST_KEYS:
        listed = tokenizer_config.get(key) or []
        entries += list(listed.values()) if isinstance(listed, dict) else list(listed)
    for entry in entries:
        parsed = _content(entry)
        if parsed is not None:
            content, flags = parsed
            declared.append((content, {"special": True, "normalized": False, **flags}))
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    for content, flags in declared:
        if content not in present:
            present.add(content)
            token = tokenizers.AddedToken(content, **flags)
            (backend.add_special_tokens if flags["special"] else backend.add_tokens)([token])


def _warn_on_ignored_flags(directory: Path, tokenizer: HFTokenizer, tokenizer_config: dict[str, Any] | None,
                           config: ModelConfig) -> None:
    added = tokenizer.added_by_encode()
    for flag, token_id, where in (("add_bos_token", config.bos_token_id, 0), ("add_eos_token", config.eos_token_id, -1)):
        wanted = (tokenizer_config or {}).get(flag)
        if wanted is None or token_id is None:
            continue
        adds = bool(added) and added[where] == token_id
        if bool(wanted) != adds:
            log.warning("checkpoint.tokenizer_flag_ignored", path=str(directory), flag=flag, value=wanted,
                        detail=f"{TOKENIZER_FILE}'s post-processor {'adds' if adds else 'does not add'} it; "
                               "kvlife follows tokenizer.json, as transformers does")
