"""HiSparse's per-request records (the payloads of its hooks' handles) and the hooks' names.

Below the hooks and the shared state, so both read them without importing
each other.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from states import Request

HOST_HOOK, DEVICE_HOOK, MAP_HOOK = "hisparse_host", "hisparse_device", "hisparse_map"
STAGING_HOOK = "hisparse_staging"


@attrs.define(eq=False)
class HostRecord:
    """The host hook's record: pages in token order and their token locations.

    `locs[:len(pages) * page_size]` are valid (host rows, on the host, with
    `locs_np` its numpy view); `locs_dev` is the same on device (the same
    tensor on CPU); `pages_dev` holds the page ids on device, for page-wise
    gathers of index keys; `runs` lists them as [first page, count] runs of
    consecutive ids. `on_host` counts the leading tokens whose K/V has been
    copied in (or is being, under a fence). `backup_event` (CUDA only)
    follows the latest decode backup, for code that reads those rows on the
    host.
    """

    pages: list[int]
    locs: torch.Tensor
    locs_np: np.ndarray
    locs_dev: torch.Tensor
    pages_dev: torch.Tensor
    runs: list[list[int]] = attrs.field(factory=list)
    on_host: int = 0
    #: a decode-role transfer wrote the context straight into these rows (no device KV pages)
    landed_directly: bool = False
    backup_event: Any = None

    def sync_backups(self) -> None:
        if self.backup_event is not None:
            self.backup_event.synchronize()
            self.backup_event = None


@attrs.define(eq=False)
class DeviceBuffer:
    """The device hook's record: N + 1 slots (the last reserved for the newest
    token) and each layer's LRU state (see `hisparse.lru`, host memory)."""

    slots: torch.Tensor  # [N + 1] global slot ids on device
    slots_np: np.ndarray  # the same on the host
    slot_token: np.ndarray  # [layers, N]
    last_used: np.ndarray  # [layers, N]
    stamp: int = 0

    @property
    def size(self) -> int:
        return self.last_used.shape[1]


@attrs.define(eq=False)
class SlotMap:
    """The map hook's record: a row of the map table, [layers, max_context]."""

    row: int
    table: np.ndarray


def host_record(request: Request) -> HostRecord:
    """The host record of a request holding host pages."""
    payload = request.handles[HOST_HOOK].payload
    assert isinstance(payload, HostRecord)
    return payload
