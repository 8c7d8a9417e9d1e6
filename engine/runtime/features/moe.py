"""MoE expert records: a record per admitted request, folded into the distribution at release."""

from __future__ import annotations

from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from resources.moe_records import ExpertDistribution, MoERecordHook, record_step


def install_moe(ctx: BuildContext, so_far: Installed) -> FeatureInstall | None:
    mc = ctx.model_config
    if not mc.is_moe:
        return None
    distribution = ctx.expert_distribution or ExpertDistribution(mc.num_layers, mc.num_experts)
    hook = MoERecordHook(distribution)
    return FeatureInstall(hooks=[hook], expert_distribution=distribution, step_observers=[
        lambda batch, out: record_step(hook.name, [s.request for s in batch], [s.num_tokens for s in batch],
                                       out.routing)])
