"""Assembles an engine's parts from an EngineConfig.

Model and tokenizer, KV buffers and pools, the built-in and plugin resource
hooks in their one release order, the machine, the scheduler, the model
runner and the decode loop. Optional parts (HiSparse, disaggregation,
multimodal, MoE records) plug in here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfig
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, NoComputeRunner
from engine.scheduler import Scheduler
from engine.tiny_model import TinyLlama
from engine.tokenizer import ByteTokenizer
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

BUILTIN_MODELS = {"tiny": ModelConfig.tiny, "tiny-moe": ModelConfig.tiny_moe, "null": ModelConfig.tiny}


@attrs.define
class EngineParts:
    config: EngineConfig
    device: torch.device
    model_config: ModelConfig
    model: object
    tokenizer: object
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
    grow: Any = None


def load_model(config: EngineConfig, device: torch.device):
    """(model config, model, tokenizer) for `config.model`."""
    dtype = getattr(torch, config.dtype)
    if config.model in BUILTIN_MODELS:
        model_config = BUILTIN_MODELS[config.model]()
        model = TinyLlama.from_seed(model_config, config.seed, device=device, dtype=dtype)
        return model_config, model, ByteTokenizer.for_config(model_config)
    from engine.checkpoint import CheckpointError, load_checkpoint

    try:
        model, model_config, tokenizer = load_checkpoint(config.model, device=device, dtype=dtype)
    except CheckpointError as exc:
        raise InvalidConfig("EngineConfig.model", "'tiny', 'tiny-moe', 'null' or a checkpoint directory",
                            config.model) from exc
    return model_config, model, tokenizer


def build_parts(config: EngineConfig) -> EngineParts:
    try:
        device = torch.device(config.device)
    except RuntimeError as exc:
        raise InvalidConfig("EngineConfig.device", "a torch device string such as 'cpu' or 'cuda'",
                            config.device) from exc
    model_config, model, tokenizer = load_model(config, device)
    ledger = Ledger()
    kv_buffers = KVBuffers(
        num_layers=model_config.num_layers,
        num_pages=config.num_kv_pages,
        page_size=config.page_size,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        dtype=getattr(torch, config.dtype),
        device=device,
    )
    kv_pool = KVPool(
        num_pages=config.num_kv_pages,
        page_size=config.page_size,
        max_running=config.max_running,
        max_context=config.max_context,
        device=device,
        ledger=ledger,
        prefix_cache=config.prefix_cache,
    )
    hisparse = None
    if config.hisparse is not None:
        # HiSparse: KV pages only until staging; host pages + a bounded device buffer after.
        from hisparse.integration import install_hisparse

        hisparse = install_hisparse(config=config, model_config=model_config, device=device, ledger=ledger,
                                    kv_pool=kv_pool, kv_buffers=kv_buffers)
    kv_hook = KVHook(kv_pool, scope=hisparse.kv_scope if hisparse else None)
    plugins = build_plugin_hooks(
        config.resources, PluginContext(ledger, device, config), use_entry_points=config.use_entry_points
    )
    timing = TimingHook()
    # Built-in registration order is the built-in release order (MoE, HiSparse, KV,
    # multimodal, plugins, timing); plugins may reorder themselves with before/after.
    hooks = [*(hisparse.hooks if hisparse else ()), kv_hook, *plugins, timing]
    timing.after = tuple(h.name for h in hooks if h is not timing)
    ordered = order_hooks(hooks)
    if config.faults is not None:
        ordered = config.faults.wrap_hooks(ordered)
    machine = RequestMachine(ordered)
    machine.release_error_observers.append(lambda hook, request, exc: ledger.suspect.add(hook.pool or hook.name))
    pools = [*kv_pool.pools, *(hisparse.pools if hisparse else ())]
    for hook in plugins:
        pools.extend(getattr(hook, "pools", ()))
    runner_cls = NoComputeRunner if config.model == "null" else ModelRunner
    runner = runner_cls(model, kv_buffers, kv_pool.slots, device, slot_of=lambda r: r.handles["kv"].payload.slot,
                        faults=config.faults)
    scheduler = Scheduler(
        max_running=config.max_running, max_prefill_tokens=config.max_prefill_tokens, page_size=config.page_size
    )
    parts = EngineParts(config, device, model_config, model, tokenizer, ledger, kv_buffers, kv_pool, kv_hook,
                        ordered, pools, machine, scheduler, runner)
    if hisparse is not None:
        runner.attention_factory = hisparse.attention_factory(runner)
        parts.after_prefill = RequestState.STAGING
        parts.grow = hisparse.grow
    return parts
