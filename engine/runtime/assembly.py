"""Assembles an engine's parts from an EngineConfig.

Model and tokenizer, KV buffers and pools, the built-in and plugin resource
hooks in their one release order, the machine, the scheduler and the model
runner. Optional parts (MoE records, HiSparse, multimodal, the decode role's
prefill worker) plug in here and nowhere else.

Built-in registration order is the built-in release order::

    moe_record, hisparse..., kv_transfer, kv, multimodal, plugins..., timing

(plugins may reorder themselves with before/after; timing is always last).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfig
from engine.testing import FaultInjector
from engine.model.attention import PagedAttention
from engine.model.model_config import ModelConfig
from engine.model.runner import ModelRunner, NoComputeRunner
from engine.runtime.scheduler import Scheduler
from engine.model.loading import load_model
from resources import (
    KVBuffers,
    KVHook,
    KVPool,
    Ledger,
    PluginContext,
    TimingHook,
    build_plugin_hooks,
    order_hooks,
)
from states import RequestMachine, RequestState

@attrs.define
class EngineParts:
    config: EngineConfig
    device: torch.device
    model_config: ModelConfig
    model: Any
    tokenizer: Any
    ledger: Ledger
    kv_buffers: KVBuffers
    kv_pool: KVPool
    kv_hook: KVHook
    hooks: list
    pools: list
    machine: RequestMachine
    scheduler: Scheduler
    runner: ModelRunner
    after_prefill: RequestState = RequestState.DECODING
    admit_into: RequestState = RequestState.PREFILLING
    grow: Any = None
    step_observers: list = attrs.field(factory=list)
    expert_distribution: Any = None
    prefill_worker: Any = None


def build_parts(config: EngineConfig, *, faults: FaultInjector | None = None, model_bundle: tuple | None = None,
                expert_distribution: Any = None) -> EngineParts:
    """Every part of an engine for `config`; `faults` (tests only) injects failures."""
    try:
        device = torch.device(config.device)
    except RuntimeError as exc:
        raise InvalidConfig("EngineConfig.device", "a torch device string such as 'cpu' or 'cuda'",
                            config.device) from exc
    try:
        torch.empty(1, device=device).tolist()  # present and usable (not e.g. CUDA on a CPU build, or 'meta')
    except (RuntimeError, AssertionError, NotImplementedError) as exc:
        raise InvalidConfig("EngineConfig.device", "a device available to this torch build", config.device) from exc
    model_config, model, tokenizer = model_bundle or load_model(config, device)
    ledger = Ledger()
    kv_buffers = KVBuffers(num_layers=model_config.num_layers, num_pages=config.num_kv_pages,
                           page_size=config.page_size, num_kv_heads=model_config.num_kv_heads,
                           head_dim=model_config.head_dim, dtype=getattr(torch, config.dtype), device=device)
    kv_pool = KVPool(num_pages=config.num_kv_pages, page_size=config.page_size, max_running=config.max_running,
                     max_context=config.max_context, device=device, ledger=ledger,
                     prefix_cache=config.prefix_cache)
    kv_hook_scope = None
    slot_of = KVHook.slot
    attention_factory = PagedAttention.factory(kv_buffers)
    embedder = None
    before_kv: list = []
    after_kv: list = []
    pools: list = [*kv_pool.pools]
    step_observers: list = []

    if model_config.is_moe:
        from resources.moe_records import ExpertDistribution, MoERecordHook, record_step

        if expert_distribution is None:
            expert_distribution = ExpertDistribution(model_config.num_layers, model_config.num_experts)
        before_kv.append(MoERecordHook(expert_distribution))
        step_observers.append(lambda batch, out: record_step(
            "moe_record", [s.request for s in batch], [s.num_tokens for s in batch], out.routing))

    hisparse = None
    if config.hisparse is not None:
        # HiSparse: KV pages only until staging; host pages + a bounded device buffer after.
        from hisparse.integration import install_hisparse

        hisparse = install_hisparse(config=config, model_config=model_config, device=device, ledger=ledger,
                                    kv_pool=kv_pool, kv_buffers=kv_buffers, faults=faults)
        before_kv.extend(hisparse.hooks)
        pools.extend(hisparse.pools)
        kv_hook_scope = hisparse.kv_scope
        slot_of = hisparse.slot_of(slot_of)
        attention_factory = hisparse.attention_factory(attention_factory)

    worker = None
    if config.disaggregation == "decode":
        from engine.disagg.kv_transfer_hook import KVTransferHook
        from engine.disagg.prefill_worker import PrefillWorker, PrefixedPool
        from engine.disagg.transfer import LoopbackTransfer

        if config.remote_prefill is not None:  # prefill servers in other processes (engine.disagg.remote_client)
            from engine.disagg.remote_client import RemotePrefillClient

            worker = RemotePrefillClient(config, model_config, kv_buffers, device=device, faults=faults)
            pools.extend(worker.pools)
        else:
            prefill_config = attrs.evolve(config, disaggregation="none", hisparse=None)
            prefill_parts = build_parts(prefill_config, faults=faults, model_bundle=(model_config, model, tokenizer),
                                        expert_distribution=expert_distribution)
            worker = PrefillWorker(prefill_parts, LoopbackTransfer(kv_buffers, faults), faults=faults,
                                   fence_timeout=config.fence_timeout)
            pools.extend(PrefixedPool("prefill.", p, prefill_parts.ledger) for p in prefill_parts.pools)
        before_kv.append(KVTransferHook(worker, kv_pool, config.fence_timeout))

    if getattr(model, "vision_projector", None) is not None and model_config.image_token_id is not None:
        from engine.model.vision import make_embedder, projector
        from resources.multimodal_cache import MultimodalCache, MultimodalHook

        mm_cache = MultimodalCache(config.mm_cache_bytes, ledger)
        mm_hook = MultimodalHook(mm_cache, projector(model))
        after_kv.append(mm_hook)
        pools.append(mm_cache)
        embedder = make_embedder(model, model_config.image_token_id, mm_hook.embeddings)

    runner_cls = NoComputeRunner if config.model == "null" else ModelRunner
    runner = runner_cls(model, kv_buffers, kv_pool.slots, device, slot_of=slot_of,
                        attention_factory=attention_factory, embedder=embedder, faults=faults)
    kv_hook = KVHook(kv_pool, scope=kv_hook_scope)
    plugins = build_plugin_hooks(config.resources, PluginContext(ledger, device, config),
                                 use_entry_points=config.use_entry_points)
    timing = TimingHook()
    hooks = [*before_kv, kv_hook, *after_kv, *plugins, timing]
    timing.after = tuple(h.name for h in hooks if h is not timing)
    ordered = order_hooks(hooks)
    if faults is not None:
        ordered = faults.wrap_hooks(ordered)
    machine = RequestMachine(ordered)
    machine.release_error_observers.append(lambda hook, request, exc: ledger.suspect.add(hook.pool or hook.name))
    for hook in plugins:
        pools.extend(getattr(hook, "pools", ()))
    scheduler = Scheduler(max_running=config.max_running, max_prefill_tokens=config.max_prefill_tokens,
                          page_size=config.page_size)
    parts = EngineParts(config, device, model_config, model, tokenizer, ledger, kv_buffers, kv_pool, kv_hook,
                        ordered, pools, machine, scheduler, runner, step_observers=step_observers,
                        expert_distribution=expert_distribution, prefill_worker=worker)
    if worker is not None:
        parts.admit_into = RequestState.TRANSFERRING
    if hisparse is not None:
        parts.after_prefill = RequestState.STAGING
        parts.grow = hisparse.grow
        machine.transition_observers.append(hisparse.on_transition)  # entering STAGING starts the host copy
    return parts
