"""The KV pages and request slots every engine has: the `kv` and `request_slot` hooks.

Their scope and admission states are what earlier installs left them
(HiSparse narrows both); a model whose every layer has a sliding window gets
the KV hook that trims.
"""

from __future__ import annotations

from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from resources.contract import ResourceHookProtocol
from resources.kv_hook import KVHook, SlidingWindowKVHook
from resources.request_slots import RequestSlotHook


def install_paged_kv(ctx: BuildContext, so_far: Installed) -> FeatureInstall:
    kv_pool, windows = ctx.kv_pool, ctx.model_config.layer_windows
    widths = [w for w in windows if w is not None]
    scope, acquire_on = so_far.kv_scope, so_far.kv_acquire_on
    kv_hook: KVHook
    if widths and len(widths) == len(windows):  # every layer windowed: the widest window bounds the reads
        kv_hook = SlidingWindowKVHook(kv_pool, window=max(widths), scope=scope, acquire_on=acquire_on)
    else:
        kv_hook = KVHook(kv_pool, scope=scope, acquire_on=acquire_on)
    hooks: list[ResourceHookProtocol] = [kv_hook, RequestSlotHook(kv_pool.slots, scope=scope, acquire_on=acquire_on)]
    return FeatureInstall(hooks=hooks, pools=[kv_pool, kv_pool.slots])
