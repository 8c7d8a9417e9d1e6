"""Structured output: a request's grammar is a resource like any other.

A `Constraint` (JSON schema, any JSON object, regex, choice, Lark grammar)
rides on `SamplingParams.constraint`; the grammar is compiled off the event
loop's thread (`compiler.py`), held per request by the `grammar` hook
(`hook.py`, `matcher.py`), applied to the logits as a per-row mask
(`masks.py`, the sampler's `allowed`), and installed by assembly as one
feature (`install.py`). docs/structured.md is the user's guide.

Only the plain-data names are imported here, so `engine.config` can use them.
"""

from engine.structured.config import StructuredConfig
from engine.structured.constraint import Constraint

__all__ = ["Constraint", "StructuredConfig"]
