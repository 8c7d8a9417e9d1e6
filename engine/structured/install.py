"""Structured output as one feature install: `install_structured(...)` returns what
assembly folds in (the `grammar` hook and its pool, the runner's token masks, the
loop's per-token check), or, where constraints cannot be served, only why.

Constraints are served when llguidance is installed (`kvlife[structured]`)
and the model has a vocabulary (the built-in byte tokenizer, or a checkpoint's
``tokenizer.json``). The llguidance vocabulary is built on the first compile,
in a compile thread, once per tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import torch

from engine.model.tokenizer import ByteTokenizer, HFTokenizer
from engine.structured.compiler import GrammarCompiler
from engine.structured.config import StructuredConfig
from engine.structured.hook import GrammarHook
from engine.structured.masks import GrammarMasks
from engine.structured.stats import GrammarStats
from engine.structured.vocabulary import INSTALL_HINT, llguidance_available
from states.validation import InvalidRequest


@attrs.define
class StructuredInstall:
    """One engine's structured output: its hook (None where unsupported, `unsupported` says why)."""

    stats: GrammarStats
    compiler: GrammarCompiler | None = None
    hook: GrammarHook | None = None
    masks: GrammarMasks | None = None
    unsupported: str | None = None

    def check_supported(self) -> None:
        """Raise InvalidRequest (naming SamplingParams.constraint) where constraints are not served."""
        if self.unsupported is not None:
            raise InvalidRequest("SamplingParams.constraint", f"None: {self.unsupported}", "a constraint")


def install_structured(config: StructuredConfig, *, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int],
                       device: torch.device, max_matchers: int) -> StructuredInstall:
    """The grammar hook, masks and check for an engine of this tokenizer and vocabulary."""
    stats = GrammarStats()
    if not llguidance_available():
        return StructuredInstall(stats, unsupported=f"structured output needs llguidance ({INSTALL_HINT})")
    if not isinstance(tokenizer, (ByteTokenizer, HFTokenizer)):
        return StructuredInstall(stats, unsupported="this model has no vocabulary to constrain "
                                                    "(a checkpoint without tokenizer.json)")
    mask_vocab = max(vocab_size, tokenizer.vocab_size)  # llguidance's view covers both
    stops = [t for t in stop_ids if 0 <= t < mask_vocab]
    compiler = GrammarCompiler.for_tokenizer(tokenizer, mask_vocab, stops, config)
    stop_words = np.zeros((mask_vocab + 31) // 32, dtype=np.int32)
    for t in stops:
        stop_words[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    hook = GrammarHook(compiler, tokenizer.decode, max_matchers, stats, stop_words)
    return StructuredInstall(stats, compiler, hook, GrammarMasks(mask_vocab, device))
