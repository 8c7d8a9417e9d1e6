"""Speculative decoding as a feature install: the runner's verify step, and for a
draft model its KV hook and pool (`engine.speculative.draft_model`)."""

from __future__ import annotations

import attrs
import torch

from engine.config import EngineConfig
from engine.model.model_config import ModelConfig
from engine.speculative.proposers import NgramProposer, Proposer
from engine.speculative.step import SpeculativeStep
from resources.contract import ResourceHookProtocol
from resources.ledger import Pool


@attrs.frozen
class SpeculationInstall:
    step: SpeculativeStep
    #: resource hooks (released after the KV hook) and their pools
    hooks: tuple[ResourceHookProtocol, ...] = ()
    pools: tuple[Pool, ...] = ()


def install_speculation(config: EngineConfig, *, model_config: ModelConfig, device: torch.device,
                        max_context: int) -> SpeculationInstall:
    spec = config.speculative
    assert spec is not None  # installed only when the engine speculates
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec)
        return SpeculationInstall(SpeculativeStep(proposer))
    from engine.speculative.draft_model import build_draft

    draft = build_draft(config, model_config=model_config, device=device, max_context=max_context)
    return SpeculationInstall(SpeculativeStep(draft.proposer), (draft.hook,), (draft.pool,))
