"""Hierarchical sparse attention: every token's KV on the host, a bounded
per-request device buffer with a per-layer LRU, top-k selection by index
keys, and swap-in of the missing tokens each decode step.

Turn it on with ``EngineConfig(hisparse=HiSparseConfig(...))``; see
docs/hisparse.md. The engine wires it in through
`hisparse.integration.install_hisparse`.
"""

from hisparse.config import HiSparseConfig
from hisparse.pools import DEVICE_SLOTS, HOST_PAGES, SLOT_MAPS

__all__ = ["DEVICE_SLOTS", "HOST_PAGES", "SLOT_MAPS", "HiSparseConfig"]
