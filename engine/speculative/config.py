"""`SpeculativeConfig`: how an engine speculates (`EngineConfig.speculative`).

Validated at construction; every error names the field and the limit.
"""

from __future__ import annotations

import attrs

from engine.errors import InvalidConfig
from states.validation import int_at_least, one_of, require

#: the most draft tokens one step may verify per request
MAX_SPECULATIVE_TOKENS = 16
#: the longest n-gram prompt lookup matches
MAX_NGRAM = 16


@attrs.frozen
class SpeculativeConfig:
    """Speculative decoding for every request that does not opt out
    (`SamplingParams.speculative=False`).

    - `method`: ``"ngram"`` (prompt lookup: the tokens that followed the most
      recent earlier occurrence of the request's last n tokens, n from
      `ngram_max` down to `ngram_min`, in its prompt and output so far) or
      ``"draft_model"`` (a small model, `draft_model`, proposes them).
    - `num_tokens`: draft tokens proposed and verified per step and request.
    - `draft_model`: ``"tiny"`` (the built-in tiny model: only useful as its
      own draft, for tests) or a checkpoint directory whose tokenizer is the
      target's (its vocabulary must match).
    """

    method: str = attrs.field(default="ngram", validator=one_of("ngram", "draft_model"))
    num_tokens: int = attrs.field(default=4, validator=int_at_least(1))
    ngram_min: int = attrs.field(default=1, validator=int_at_least(1))
    ngram_max: int = attrs.field(default=3, validator=int_at_least(1))
    draft_model: str | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        p = "SpeculativeConfig"
        require(self.num_tokens <= MAX_SPECULATIVE_TOKENS, InvalidConfig, f"{p}.num_tokens",
                f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]", self.num_tokens)
        require(self.ngram_max <= MAX_NGRAM, InvalidConfig, f"{p}.ngram_max", f"an integer in [1, {MAX_NGRAM}]",
                self.ngram_max)
        require(self.ngram_min <= self.ngram_max, InvalidConfig, f"{p}.ngram_min",
                f"an integer in [1, ngram_max = {self.ngram_max}]", self.ngram_min)
        if self.method == "draft_model":
            require(isinstance(self.draft_model, str) and self.draft_model != "", InvalidConfig,
                    f"{p}.draft_model", "'tiny' or a checkpoint directory when method is 'draft_model'",
                    self.draft_model)
        else:
            require(self.draft_model is None, InvalidConfig, f"{p}.draft_model", "None when method is 'ngram'",
                    self.draft_model)
