"""Assembles an engine's parts from an EngineConfig: a fold over feature installs.

`assemble` builds the core (device, model and tokenizer, KV buffers and the KV
pool), then calls each install in order (`FEATURES`, with the role's install
in its place) and folds what they return (`features.base.Installed`): hooks,
pools, observers, the runner's attention and slot lookup, the role. Then the
hooks are put in their one release order (`order_hooks`, the timing hook
last), the machine is built with the ledger, and the runner with the folded
runner parts. Nothing is patched after it is built, and nothing recurses:
the decode role's in-process prefill is a second, separate `assemble` call
(`build_parts`), whose runtime is the decode role's prefill client.

Registration order (ties of the release order)::

    moe_record, hisparse_*, kv_transfer | kv_send, prefill_job, kv, request_slot, multimodal,
    session, session_turn, grammar, spec_draft_kv, plugins..., timing
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from engine.config import EngineConfig
from engine.disagg.decode.kv_transfer_hook import PrefillClient
from engine.disagg.prefill.loopback_sender import LoopbackSender
from engine.errors import InvalidConfig
from engine.model.attention import PagedAttention
from engine.model.native_kernels import kernels_for
from engine.model.llama import LlamaModel
from engine.model.loading import kv_cache_dtype, load_model
from engine.model.model_config import ModelConfig
from engine.model.runner import AttentionFactory, ModelRunner, NoComputeRunner
from engine.model.tokenizer import Tokenizer
from engine.runtime.features.base import BuildContext, Install, Installed, SlotLookup
from engine.runtime.features.hisparse import install_hisparse
from engine.runtime.features.moe import install_moe
from engine.runtime.features.paged_kv import install_paged_kv
from engine.runtime.features.plugins import install_plugins
from engine.runtime.features.roles import DecodeRole, PrefillRole
from engine.runtime.features.sessions import install_sessions
from engine.runtime.features.speculative import install_speculative
from engine.runtime.features.structured import install_structured
from engine.runtime.features.vision import install_vision
from engine.runtime.prefill_runtime import PrefillRuntime
from engine.runtime.parts import EngineParts
from engine.runtime.scheduler import Scheduler
from engine.testing import FaultInjector
from resources.contract import order_hooks
from resources.kv_buffers import KVBuffers
from resources.kv_pool import KVPool
from resources.ledger import Ledger
from resources.moe_records import ExpertDistribution
from resources.plugins import is_hook_instance
from resources.request_slots import RequestSlotHook
from resources.timing_hook import TimingHook
from states import RequestMachine

ModelBundle = tuple[ModelConfig, LlamaModel, Tokenizer]


def features(role: Install | None) -> list[Install]:
    """The installs of an engine, in order (the role's in its place)."""
    return [install_moe, install_hisparse, *([role] if role is not None else []), install_paged_kv, install_vision,
            install_sessions, install_structured, install_speculative, install_plugins]


def build_parts(config: EngineConfig, *, faults: FaultInjector | None = None) -> EngineParts:
    """Every part of an engine for `config`; `faults` (tests only) injects failures. The decode
    role without remote prefills gets an in-process prefill runtime of its own pools."""
    device = _device(config)
    bundle = load_model(config, device)
    role: Install | None = None
    distribution = None
    if config.disaggregation == "decode":
        if config.remote_prefill is not None:
            from engine.disagg.decode.remote_client import RemotePrefillClient

            def remote(ctx: BuildContext) -> PrefillClient:
                return RemotePrefillClient(ctx.config, ctx.model_config, ctx.kv_buffers, device=ctx.device,
                                           max_context=ctx.max_context)

            role = DecodeRole(remote).install
        else:
            local = build_local_prefill(config, device=device, bundle=bundle, faults=faults)
            distribution = local.parts.expert_distribution
            role = DecodeRole(lambda ctx: local).install
    return assemble(config, device=device, bundle=bundle, role=role, faults=faults,
                    expert_distribution=distribution)


def build_local_prefill(config: EngineConfig, *, device: torch.device, bundle: ModelBundle,
                        faults: FaultInjector | None) -> PrefillRuntime:
    """The decode role's in-process prefill: a prefill-role runtime over pools of its own and the
    same weights, copying into the decode's memory (its pools show as "prefill.*")."""
    # NOTE: a configured hook *instance* has one pool, so it serves the decode engine only;
    # factories (and entry points) build the prefill runtime a hook of its own.
    prefill_config = attrs.evolve(config, disaggregation="none", hisparse=None, remote_prefill=None, cuda_graphs=False,
                                  max_sessions=0,
                                  resources=tuple(r for r in config.resources if not is_hook_instance(r)))
    role = PrefillRole(lambda ctx: LoopbackSender(ctx.kv_buffers, fence_timeout=config.fence_timeout, faults=faults))
    parts = assemble(prefill_config, device=device, bundle=bundle, role=role.install, faults=faults)
    assert role.sender is not None  # set by its install
    return PrefillRuntime(parts, inbox=role.inbox, sender=role.sender, report_prefix="prefill.")


def assemble(config: EngineConfig, *, device: torch.device, bundle: ModelBundle, role: Install | None = None,
             faults: FaultInjector | None = None, expert_distribution: ExpertDistribution | None = None,
             installs: Sequence[Install] | None = None) -> EngineParts:
    """One runtime's parts: the core, then the fold over `installs` (default `features(role)`)."""
    model_config, model, tokenizer = bundle
    max_context = effective_max_context(config, model_config)
    decode_kernel = kernels_for(config.native_kernels, device, model_config.torch_dtype)
    kv_buffers = KVBuffers(num_layers=model_config.num_layers, num_pages=config.num_kv_pages,
                           page_size=config.page_size, num_kv_heads=model_config.num_kv_heads,
                           head_dim=model_config.head_dim, dtype=kv_cache_dtype(config, model_config), device=device)
    kv_pool = KVPool(num_pages=config.num_kv_pages, page_size=config.page_size, max_running=config.max_running,
                     max_context=max_context, device=device, prefix_cache=config.prefix_cache)
    ctx = BuildContext(config, device, model_config, model, tokenizer, max_context, kv_buffers, kv_pool, faults,
                       expert_distribution)
    installed = Installed()
    for install in features(role) if installs is None else installs:
        piece = install(ctx, installed)
        if piece is not None:
            installed = installed.plus(piece)

    timing = TimingHook(after=tuple(h.name for h in installed.hooks))
    ordered = order_hooks([*installed.hooks, timing])
    if faults is not None:
        ordered = faults.wrap_hooks(ordered)
    ledger = Ledger()
    machine = RequestMachine(ordered, ledger=ledger)
    machine.transition_observers.extend(installed.transition_observers)

    slot_of: SlotLookup = RequestSlotHook.slot
    attention: AttentionFactory = PagedAttention.factory(kv_buffers, model_config.layer_windows, decode_kernel)
    for wrap_slot in installed.slot_of:
        slot_of = wrap_slot(slot_of)
    for wrap_attention in installed.attention:
        attention = wrap_attention(attention)
    runner_cls = NoComputeRunner if config.model == "null" else ModelRunner
    runner = runner_cls(model, kv_buffers, kv_pool.slots, device, slot_of=slot_of, attention_factory=attention,
                        embedder=installed.embedder, faults=faults, cuda_graphs=config.cuda_graphs,
                        token_masks=installed.token_masks, extension=installed.step_extension)
    scheduler = Scheduler(max_running=config.max_running, max_prefill_tokens=config.max_prefill_tokens,
                          page_size=config.page_size, priority_aging=config.priority_aging)
    return EngineParts(config, device, model_config, model, tokenizer, max_context, ledger, kv_buffers, kv_pool,
                       ordered, installed.pools, machine, scheduler, runner, role=installed.role,
                       step_observers=installed.step_observers, expert_distribution=installed.expert_distribution,
                       prefill_client=installed.prefill_client, mm_cache_bytes=installed.mm_cache_bytes,
                       sessions=installed.sessions, structured=installed.structured,
                       token_checks=installed.token_checks)


def resolve_device(config: EngineConfig) -> torch.device:
    """The torch device `config.device` names, checked usable (else InvalidConfig naming the field)."""
    return _device(config)


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
