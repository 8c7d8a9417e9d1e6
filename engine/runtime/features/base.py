"""What a feature installs, and what it is given to do it.

A feature (MoE records, HiSparse, vision, a disaggregation role, plugins, and
later a grammar hook, sessions, speculative draft slots) is one function::

    def install(ctx: BuildContext, so_far: Installed) -> FeatureInstall | None

It reads the engine's config and core parts from `ctx` and what earlier
installs provided from `so_far` (HiSparse's landing for the decode role, the
narrowed KV scope for the KV install), and returns only its own parts: hooks
(with their release-order constraints), pools, transition and step
observers, wrappers of the runner's attention factory and slot lookup, an
embedder, a change of the role, a prefill client. `engine.runtime.assembly`
calls the installs in order and folds their parts into one `Installed`;
nothing is patched after it is built. Adding a feature is adding one install
function to `assembly.FEATURES` (or to a role's list).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from engine.config import EngineConfig
from engine.disagg.decode.kv_transfer_hook import Landing, PrefillClient
from engine.model.batch import ScheduledSeq
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.runner import AttentionFactory, StepExtension
from engine.model.step_types import TokenMasks
from engine.model.tokenizer import Tokenizer
from engine.runtime.role import Role
from engine.runtime.step_applier import StepObserver, TokenCheck
from engine.structured.install import StructuredInstall

__all__ = ["BuildContext", "Embedder", "FeatureInstall", "Install", "Installed", "SlotLookup", "StepObserver"]
from engine.testing import FaultInjector
from resources.contract import ResourceHookProtocol
from resources.kv_buffers import KVBuffers
from resources.kv_pool import KVPool
from resources.ledger import Pool
from resources.moe_records import ExpertDistribution
from resources.session_hook import SessionStore
from states import Request, RequestState, TransitionObserver

#: the runner's lookup of a request's token-table row (None: its backend keeps its KV itself)
SlotLookup = Callable[[Request], "int | None"]
#: token embeddings with substitutions (images), or None for the plain lookup
Embedder = Callable[[Sequence[ScheduledSeq], torch.Tensor], "torch.Tensor | None"]


@attrs.frozen
class BuildContext:
    """An engine's core parts, built before any feature installs."""

    config: EngineConfig
    device: torch.device
    model_config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    #: the effective limit on prompt + output tokens (see EngineConfig.max_context)
    max_context: int
    kv_buffers: KVBuffers
    kv_pool: KVPool
    faults: FaultInjector | None = None
    #: shared by the decode engine and its in-process prefill (one distribution)
    expert_distribution: ExpertDistribution | None = None


@attrs.define
class FeatureInstall:
    """One feature's parts (every field optional)."""

    hooks: list[ResourceHookProtocol] = attrs.field(factory=list)
    pools: list[Pool] = attrs.field(factory=list)
    transition_observers: list[TransitionObserver] = attrs.field(factory=list)
    step_observers: list[StepObserver] = attrs.field(factory=list)
    #: checks of each sampled token before it is appended (a grammar's)
    token_checks: list[TokenCheck] = attrs.field(factory=list)
    #: the sampled rows' allowed-token masks (a grammar's), the runner's `token_masks`
    token_masks: TokenMasks | None = None
    #: wraps the runner's attention factory (HiSparse: sparse decode rows)
    attention: Callable[[AttentionFactory], AttentionFactory] | None = None
    #: wraps the runner's slot lookup
    slot_of: Callable[[SlotLookup], SlotLookup] | None = None
    embedder: Embedder | None = None
    #: narrows the KV and request-slot hooks' scope / admission states (HiSparse)
    kv_scope: frozenset[RequestState] | None = None
    kv_acquire_on: frozenset[RequestState] | None = None
    #: where a transfer lands when not in the KV pages (HiSparse's host rows)
    landing: Landing | None = None
    #: changes the role (HiSparse: STAGING after the first token; the disaggregation roles)
    role: Callable[[Role], Role] | None = None
    prefill_client: PrefillClient | None = None
    expert_distribution: ExpertDistribution | None = None
    mm_cache_bytes: int | None = None
    #: open sessions' records and hooks (issue 21)
    sessions: SessionStore | None = None
    #: structured output: the grammar hook, masks and compiler, or why constraints are refused
    structured: StructuredInstall | None = None
    #: speculative decoding's verify step, the runner's `extension`
    step_extension: StepExtension | None = None


@attrs.define
class Installed:
    """Every install so far, folded (`plus`)."""

    hooks: list[ResourceHookProtocol] = attrs.field(factory=list)
    pools: list[Pool] = attrs.field(factory=list)
    transition_observers: list[TransitionObserver] = attrs.field(factory=list)
    step_observers: list[StepObserver] = attrs.field(factory=list)
    token_checks: list[TokenCheck] = attrs.field(factory=list)
    token_masks: TokenMasks | None = None
    attention: list[Callable[[AttentionFactory], AttentionFactory]] = attrs.field(factory=list)
    slot_of: list[Callable[[SlotLookup], SlotLookup]] = attrs.field(factory=list)
    embedder: Embedder | None = None
    kv_scope: frozenset[RequestState] | None = None
    kv_acquire_on: frozenset[RequestState] | None = None
    landing: Landing | None = None
    role: Role = attrs.field(factory=Role)
    prefill_client: PrefillClient | None = None
    expert_distribution: ExpertDistribution | None = None
    mm_cache_bytes: int | None = None
    sessions: SessionStore | None = None
    structured: StructuredInstall | None = None
    step_extension: StepExtension | None = None

    def plus(self, piece: FeatureInstall) -> Installed:
        """This fold with one more feature's parts (a feature only adds; two features that
        both set a single-valued part are a bug, raised here)."""
        for name in ("embedder", "landing", "prefill_client", "expert_distribution", "mm_cache_bytes",
                     "token_masks", "sessions", "structured", "step_extension"):
            if getattr(piece, name) is not None and getattr(self, name) is not None:
                raise ValueError(f"two features install {name}")
        return Installed(
            hooks=[*self.hooks, *piece.hooks], pools=[*self.pools, *piece.pools],
            transition_observers=[*self.transition_observers, *piece.transition_observers],
            step_observers=[*self.step_observers, *piece.step_observers],
            token_checks=[*self.token_checks, *piece.token_checks],
            token_masks=piece.token_masks or self.token_masks,
            attention=[*self.attention, *([piece.attention] if piece.attention else [])],
            slot_of=[*self.slot_of, *([piece.slot_of] if piece.slot_of else [])],
            embedder=piece.embedder or self.embedder,
            kv_scope=_narrow(self.kv_scope, piece.kv_scope), kv_acquire_on=_narrow(self.kv_acquire_on,
                                                                                    piece.kv_acquire_on),
            landing=piece.landing or self.landing,
            role=piece.role(self.role) if piece.role is not None else self.role,
            prefill_client=piece.prefill_client or self.prefill_client,
            expert_distribution=piece.expert_distribution or self.expert_distribution,
            mm_cache_bytes=piece.mm_cache_bytes if piece.mm_cache_bytes is not None else self.mm_cache_bytes,
            sessions=piece.sessions or self.sessions, structured=piece.structured or self.structured,
            step_extension=piece.step_extension or self.step_extension,
        )


def _narrow(a: frozenset[RequestState] | None, b: frozenset[RequestState] | None) -> frozenset[RequestState] | None:
    if a is None:
        return b
    return a if b is None else a & b


#: a feature's install function
Install = Callable[[BuildContext, Installed], "FeatureInstall | None"]
