"""Speculative decoding: drafts proposed cheaply, verified by the model in one pass.

`SpeculativeConfig` (the `EngineConfig.speculative` switch) picks the
proposer: prompt lookup (n-grams of the request's own tokens, no model) or a
small draft model with the same tokenizer. See docs/speculative.md.
"""

from engine.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
