"""Resources: the hook contract for plugin authors, the ownership ledger and
leak check, and the torch pools (imported from their own modules; only the
plugin author's API is promised here).

The hook contract is documented in `resources.contract`.
"""

from resources.contract import (
    ExtendingHook,
    GrowingHook,
    HookOrderError,
    PublishingHook,
    QuarantiningHook,
    ResourceExhausted,
    ResourceHook,
    ResourceHookProtocol,
    RollingBackHook,
    TrimmingHook,
    order_hooks,
    validate_hook,
)
from resources.fences import CopyFence, ManualFence
from resources.ledger import LeakError, MemoryReport, Owner, PoolStats, PoolUsage
from resources.plugins import ENTRY_POINT_GROUP, PluginContext, PluginError

__all__ = [
    "ENTRY_POINT_GROUP",
    "CopyFence",
    "ExtendingHook",
    "GrowingHook",
    "HookOrderError",
    "LeakError",
    "ManualFence",
    "MemoryReport",
    "Owner",
    "PluginContext",
    "PluginError",
    "PoolStats",
    "PoolUsage",
    "PublishingHook",
    "QuarantiningHook",
    "ResourceExhausted",
    "ResourceHook",
    "ResourceHookProtocol",
    "RollingBackHook",
    "TrimmingHook",
    "order_hooks",
    "validate_hook",
]
