"""Assembles an engine's parts from an EngineConfig, each built whole.

Model and tokenizer, KV buffers and pools, the built-in and plugin resource
hooks in their one release order, the machine (with the ledger), the
scheduler and the model runner (constructed with its attention backend,
embedder and slot lookup). Optional parts (MoE records, HiSparse,
multimodal, the decode role's prefill client) plug in here and nowhere else.

Built-in registration order is the built-in release order::

    moe_record, kv_transfer, hisparse..., kv, request_slot, multimodal, plugins..., timing

(plugins may reorder themselves with before/after; timing is always last).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfig
from engine.model.attention import PagedAttention
from engine.model.llama import LlamaModel
from engine.model.loading import load_model
from engine.model.model_config import ModelConfig
from engine.model.runner import AttentionFactory, ModelRunner, NoComputeRunner, StepOutput
from engine.model.tokenizer import Tokenizer
from engine.model.batch import ScheduledSeq
from engine.runtime.role import Role
from engine.runtime.scheduler import Scheduler
from engine.testing import FaultInjector
from resources.kv_buffers import KVBuffers
from resources.kv_hook import KVHook, SlidingWindowKVHook
from resources.kv_pool import KVPool
from resources.ledger import Ledger, Pool
from resources.plugins import PluginContext, build_plugin_hooks, is_hook_instance
from resources.contract import ResourceHookProtocol, order_hooks
from resources.request_slots import RequestSlotHook
from resources.timing_hook import TimingHook
from states import Request, RequestMachine, RequestState

if TYPE_CHECKING:
    from engine.disagg.decode.kv_transfer_hook import PrefillClient, TransferJob
    from resources.moe_records import ExpertDistribution

#: called after every step with the batch and its output (the MoE record)
StepObserver = Callable[[Sequence[ScheduledSeq], StepOutput], None]


@attrs.define
class EngineParts:
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
    role: Role = Role()
    step_observers: list[StepObserver] = attrs.field(factory=list)
    expert_distribution: ExpertDistribution | None = None
    #: the decode role's prefill client
    prefill_client: PrefillClient | None = None
    mm_cache_bytes: int | None = None


def _device(config: EngineConfig) -> torch.device:
    try:
        device = torch.device(config.device)
    except RuntimeError as exc:
        raise InvalidConfig("EngineConfig.device", "a torch device string such as 'cpu' or 'cuda'",
                            config.device) from exc
    try:
        torch.empty(1, device=device).tolist()  # present and usable (not e.g. CUDA on a CPU build, or 'meta')
    except (RuntimeError, AssertionError, NotImplementedError) as exc:
        raise InvalidConfig("EngineConfig.device", "a device available to this torch build", config.device) from exc
    return device


def effective_max_context(config: EngineConfig, model_config: ModelConfig) -> int:
    """`config.max_context`, or the most the pool and the model allow."""
    limit = model_config.max_position_embeddings
    if config.max_context is not None and config.max_context > limit:
        raise InvalidConfig("EngineConfig.max_context", f"<= the model's max_position_embeddings = {limit}",
                            config.max_context)
    return min(config.context_bound, limit)


def build_parts(config: EngineConfig, *, faults: FaultInjector | None = None,
                model_bundle: tuple[ModelConfig, LlamaModel, Tokenizer] | None = None,
                expert_distribution: ExpertDistribution | None = None) -> EngineParts:
    """Every part of an engine for `config`; `faults` (tests only) injects failures."""
    device = _device(config)
    model_config, model, tokenizer = model_bundle or load_model(config, device)
    max_context = effective_max_context(config, model_config)
    ledger = Ledger()
    kv_buffers = KVBuffers(num_layers=model_config.num_layers, num_pages=config.num_kv_pages,
                           page_size=config.page_size, num_kv_heads=model_config.num_kv_heads,
                           head_dim=model_config.head_dim, dtype=model_config.torch_dtype, device=device)
    kv_pool = KVPool(num_pages=config.num_kv_pages, page_size=config.page_size, max_running=config.max_running,
                     max_context=max_context, device=device, prefix_cache=config.prefix_cache)
    kv_scope = None
    slot_of: Callable[[Request], int | None] = RequestSlotHook.slot
    attention_factory: AttentionFactory = PagedAttention.factory(kv_buffers, model_config.layer_windows)
    embedder = None
    before_kv: list[ResourceHookProtocol] = []  # the MoE record
    transfer_hooks: list[ResourceHookProtocol] = []  # kv_transfer: acquired after HiSparse's host pages (its landing)
    hisparse_hooks: list[ResourceHookProtocol] = []
    after_kv: list[ResourceHookProtocol] = []
    pools: list[Pool] = [kv_pool, kv_pool.slots]
    step_observers: list[StepObserver] = []
    parts_extra: dict[str, Any] = {}
    role_fields: dict[str, Any] = {}

    if model_config.is_moe:
        from resources.moe_records import ExpertDistribution, MoERecordHook, record_step

        if expert_distribution is None:
            expert_distribution = ExpertDistribution(model_config.num_layers, model_config.num_experts)
        before_kv.append(MoERecordHook(expert_distribution))
        step_observers.append(lambda batch, out: record_step(
            "moe_record", [s.request for s in batch], [s.num_tokens for s in batch], out.routing))

    if config.hisparse is not None:
        # HiSparse: KV pages only until staging; host pages + a bounded device buffer after.
        from hisparse.integration import install_hisparse

        hisparse = install_hisparse(config=config, max_context=max_context, model_config=model_config,
                                    device=device, kv_pool=kv_pool, kv_buffers=kv_buffers, faults=faults)
        hisparse_hooks.extend(hisparse.hooks)
        pools.extend(hisparse.pools)
        kv_scope = hisparse.kv_scope
        slot_of = hisparse.slot_of(slot_of)
        attention_factory = hisparse.attention_factory(attention_factory)
        role_fields["after_prefill"] = RequestState.STAGING

    if config.disaggregation == "decode":
        from engine.disagg.decode.kv_transfer_hook import KVTransferHook
        from engine.disagg.prefill.prefill_worker import PrefillWorker
        from engine.disagg.decode.transfer import LoopbackTransfer

        client: PrefillClient
        if config.remote_prefill is not None:  # prefill servers in other processes (engine.disagg.decode.remote_client)
            from engine.disagg.decode.remote_client import RemotePrefillClient

            client = RemotePrefillClient(config, model_config, kv_buffers, device=device, max_context=max_context)
        else:
            # NOTE: a configured hook *instance* has one pool, so it serves the decode engine only;
            # factories (and entry points) build the prefill worker a hook of its own.
            prefill_config = attrs.evolve(config, disaggregation="none", hisparse=None,
                                          resources=tuple(r for r in config.resources if not is_hook_instance(r)))
            prefill_parts = build_parts(prefill_config, faults=faults, model_bundle=(model_config, model, tokenizer),
                                        expert_distribution=expert_distribution)
            client = PrefillWorker(prefill_parts, LoopbackTransfer(kv_buffers, faults), faults=faults)
        landing = None
        if config.hisparse is not None:  # the KV lands straight in the host pages, never in device pages
            from engine.disagg.decode.destination import host_landing

            landing = lambda request, n: host_landing(hisparse.state, request, n)  # noqa: E731
        transfer_hooks.append(KVTransferHook(client, kv_pool, config.fence_timeout, landing=landing))
        pools.extend(client.pools)
        parts_extra.update(prefill_client=client)
        role_fields.update(name="decode", transfer_job=KVTransferHook.job, admit_into=RequestState.TRANSFERRING)

    if getattr(model, "vision_projector", None) is not None and model_config.image_token_id is not None:
        from engine.model.vision import make_embedder, projector
        from resources.multimodal_cache import MultimodalCache, MultimodalHook

        mm_cache = MultimodalCache(config.mm_cache_bytes)
        mm_hook = MultimodalHook(mm_cache, projector(model))
        after_kv.append(mm_hook)
        pools.append(mm_cache)
        embedder = make_embedder(model, model_config.image_token_id, mm_hook.embeddings)
        parts_extra["mm_cache_bytes"] = config.mm_cache_bytes

    runner_cls = NoComputeRunner if config.model == "null" else ModelRunner
    runner = runner_cls(model, kv_buffers, kv_pool.slots, device, slot_of=slot_of,
                        attention_factory=attention_factory, embedder=embedder, faults=faults)
    windows = [w for w in model_config.layer_windows if w is not None]  # every layer windowed: the widest
    kv_hook = (SlidingWindowKVHook(kv_pool, scope=kv_scope, window=max(windows))
               if windows and len(windows) == len(model_config.layer_windows) else KVHook(kv_pool, scope=kv_scope))
    slot_hook = RequestSlotHook(kv_pool.slots, scope=kv_scope)
    plugins = build_plugin_hooks(config.resources, PluginContext(device, config),
                                 use_entry_points=config.use_entry_points)
    timing = TimingHook()
    hooks: list[ResourceHookProtocol] = [*before_kv, *transfer_hooks, *hisparse_hooks, kv_hook, slot_hook, *after_kv,
                                         *plugins, timing]
    timing.after = tuple(h.name for h in hooks if h is not timing)
    ordered = order_hooks(hooks)
    if faults is not None:
        ordered = faults.wrap_hooks(ordered)
    machine = RequestMachine(ordered, ledger=ledger)
    for hook in plugins:
        pools.extend(getattr(hook, "pools", ()))
    scheduler = Scheduler(max_running=config.max_running, max_prefill_tokens=config.max_prefill_tokens,
                          page_size=config.page_size)
    return EngineParts(config, device, model_config, model, tokenizer, max_context, ledger, kv_buffers, kv_pool,
                       ordered, pools, machine, scheduler, runner, step_observers=step_observers,
                       expert_distribution=expert_distribution, role=Role(**role_fields), **parts_extra)
