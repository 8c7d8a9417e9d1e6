"""Resource handles, the ownership ledger and leak check, and the torch pools.

The hook contract is documented in `resources.contract`.
"""

from resources.contract import HookOrderError, ResourceExhausted, ResourceHook, order_hooks
from resources.fences import CopyFence, ManualFence
from resources.kv_buffers import KVBuffers
from resources.kv_hook import KVBlock, KVHook
from resources.kv_pool import KV_PAGES, REQUEST_SLOTS, KVPool
from resources.ledger import (
    Ledger,
    LeakError,
    MemoryReport,
    Owner,
    PoolStats,
    check_memory,
    memory_report,
)
from resources.page_allocator import DoubleFree, ForeignPage, PageAllocator
from resources.plugins import ENTRY_POINT_GROUP, PluginContext, build_plugin_hooks
from resources.radix_cache import RadixCache
from resources.request_slots import RequestSlots
from resources.timing_hook import TimingHook

__all__ = [
    "ENTRY_POINT_GROUP",
    "KV_PAGES",
    "REQUEST_SLOTS",
    "CopyFence",
    "DoubleFree",
    "ForeignPage",
    "HookOrderError",
    "KVBlock",
    "KVBuffers",
    "KVHook",
    "KVPool",
    "LeakError",
    "Ledger",
    "ManualFence",
    "MemoryReport",
    "Owner",
    "PageAllocator",
    "PluginContext",
    "PoolStats",
    "RadixCache",
    "RequestSlots",
    "ResourceExhausted",
    "ResourceHook",
    "TimingHook",
    "build_plugin_hooks",
    "check_memory",
    "memory_report",
    "order_hooks",
]
