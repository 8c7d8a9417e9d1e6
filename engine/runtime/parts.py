"""`EngineParts`: everything one runtime runs on, as `engine.runtime.assembly` builds it.

The public seam between assembly and what runs the parts (the loop, the
prefill runtime, `Engine`, tests and tools: `engine.parts`). Its own module,
so what runs the parts never imports what builds them.
"""

from __future__ import annotations

import attrs
import torch

from engine.config import EngineConfig
from engine.disagg.decode.kv_transfer_hook import PrefillClient
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.runner import ModelRunner
from engine.model.tokenizer import Tokenizer
from engine.runtime.features.base import StepObserver
from engine.runtime.step_applier import TokenCheck
from engine.structured.install import StructuredInstall
from engine.runtime.role import Role
from engine.runtime.scheduler import Scheduler
from resources.contract import ResourceHookProtocol
from resources.kv_buffers import KVBuffers
from resources.kv_pool import KVPool
from resources.ledger import Ledger, Pool
from resources.moe_records import ExpertDistribution
from resources.session_hook import SessionStore
from states import RequestMachine


@attrs.define
class EngineParts:
    """Everything a runtime runs on (the public seam for tests and tools: `engine.parts`)."""

    config: EngineConfig
    device: torch.device
    model_config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    #: the effective limit on prompt + output tokens (see EngineConfig.max_context)
    max_context: int
    ledger: Ledger
    kv_buffers: KVBuffers
    kv_pool: KVPool
    hooks: list[ResourceHookProtocol]
    pools: list[Pool]
    machine: RequestMachine
    scheduler: Scheduler
    runner: ModelRunner
    role: Role = attrs.field(factory=Role)
    step_observers: list[StepObserver] = attrs.field(factory=list)
    expert_distribution: ExpertDistribution | None = None
    #: the decode role's prefill client (in-process prefill runtime, or remote prefill servers)
    prefill_client: PrefillClient | None = None
    mm_cache_bytes: int | None = None
    #: issue 21: open sessions' records and hooks (None when EngineConfig.max_sessions is 0)
    sessions: SessionStore | None = None
    #: structured output (the grammar hook, masks and compiler; or why constraints are refused)
    structured: StructuredInstall | None = None
    #: features' checks of each sampled token (the grammar's), run by the step applier before appending it
    token_checks: list[TokenCheck] = attrs.field(factory=list)
