"""What a model step takes and gives: its tensors, its timing, its output (tokens, routing,
logprobs, speculative results, fences), and the token-mask seam of structured outputs.
Shared by the runner (`engine.model.runner`), the verify step (`engine.speculative.step`)
and the step applier, which reads the output back into the requests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch

from engine.model.attention import AttentionMetadata
from engine.model.batch import ScheduledSeq
from engine.model.prompt_logprobs import PromptEntries
from states import Fence, Request, TokenLogprob


#: the masks of one step: `allowed` [S, V] bool on the logits' device, and the rows that allow nothing
#: (they are sampled unmasked and answered -1: no token, never an unconstrained one)
StepMasks = tuple[torch.Tensor, list[int]]


class TokenMasks(Protocol):
    """Per sampled row, the tokens it may take (structured output's grammars); the runner's
    `token_masks`. Called from the step's thread with the sampled rows' requests."""

    def begin(self, requests: Sequence[Request], device: torch.device,
              vocab: int) -> Callable[[], StepMasks | None] | None:
        """None when no row needs a mask this step (nothing computed; a CUDA graph may run); else
        a callable, called once the forward pass is launched, giving the step's masks (or None)."""
        ...


@attrs.define
class StepOutput:
    """Tokens sampled for the sampling seqs (in batch order), MoE routing, and the fences of
    the copies the step started (the step applier adds them through the machine)."""

    tokens: list[int]
    #: per MoE layer, the routed expert ids [T, top_k] of the step's tokens (host tensors)
    routing: list[torch.Tensor] = attrs.field(factory=list)
    #: aligned with `tokens`: the token's `TokenLogprob` where its request asked, else None
    logprobs: list[TokenLogprob | None] = attrs.field(factory=list)
    #: speculative steps: aligned with `tokens`, each row's `Verified` (empty: none speculated)
    verified: list[Verified] = attrs.field(factory=list)
    #: the rows as they ran, drafts filled in (for observers that count tokens: MoE routing)
    rows: list[ScheduledSeq] | None = None
    #: (request, fence) of every copy the step started that may still be in flight
    fences: Sequence[tuple[Request, Fence]] = ()
    #: issue 21: prompt logprobs of the step's prefill chunks that asked (engine.model.prompt_logprobs)
    prompt_logprobs: list[PromptEntries] = attrs.field(factory=list)


@attrs.frozen
class Verified:
    """A speculating row's result: drafts verified, and those accepted (emitted before its token)."""

    proposed: int
    accepted: tuple[int, ...] = ()


@attrs.frozen
class StepTiming:
    """Where one step's time went (seconds): building the batch's tensors, and
    the forward pass with sampling (the model's own work)."""

    batch: int
    decode_only: bool
    prepare_s: float
    forward_s: float
    #: `time.perf_counter()` when the step ended (the time between two steps' ends is a step's interval)
    ended: float = 0.0


@attrs.frozen(eq=False)
class StepInputs:
    """A batch's tensors: token ids and positions ``[T]``, attention metadata,
    the rows of T whose logits are sampled (None: every row, in order), and
    the sampler's fields on the device (None when it needs none)."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None
    fields: torch.Tensor | None = None
    #: the extra int64 sections a caller asked `prepare` to upload, by name
    extra: dict[str, torch.Tensor] = attrs.field(factory=dict)
