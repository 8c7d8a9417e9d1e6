"""`StructuredConfig`: how grammars are compiled and bounded (`EngineConfig.structured`).

Validated at construction with `InvalidConfig` naming the field and the
limit, like every config.

- `compile_timeout`: seconds a request waits for its grammar to compile
  before it is refused (`InvalidRequest`, HTTP 400). A compile runs in a
  worker thread that cannot be stopped; llguidance's own limits below bound
  its work, so a timed-out compile ends soon after and its result is cached.
- `compile_threads`: compiles at once (the rest wait their turn, within their
  deadline).
- `cache_size`: compiled grammars kept, least recently used evicted.
- `max_grammar_size`, `step_max_items`, `step_lexer_fuel`: llguidance's
  parser limits (grammar symbols; Earley items and lexer fuel per token). A
  request whose grammar exceeds them mid-output ends with a dead end
  (`GrammarDeadEnd`), never with an unconstrained token.
"""

from __future__ import annotations

import attrs

from states.validation import int_at_least, number_above


@attrs.frozen
class StructuredConfig:
    compile_timeout: float = attrs.field(default=10.0, validator=number_above(0))
    compile_threads: int = attrs.field(default=2, validator=int_at_least(1))
    cache_size: int = attrs.field(default=256, validator=int_at_least(1))
    max_grammar_size: int = attrs.field(default=500_000, validator=int_at_least(1))
    step_max_items: int = attrs.field(default=50_000, validator=int_at_least(1))
    step_lexer_fuel: int = attrs.field(default=200_000, validator=int_at_least(1))
