"""`install_hisparse`: what `engine.runtime.assembly` plugs in when HiSparse is on.

The returned `HiSparseInstall` carries:

- `hooks`: device slots, host pages, slot maps and staging, in release
  order, each declared to be released before "kv";
- `pools`: the three pools, for the memory report and the leak check;
- `kv_scope`: the KV (and request-slot) hooks' narrowed scope. Device KV
  pages are held only until the prompt is on the host: TRANSFERRING,
  PREFILLING, PREBUILT, STAGING and FINISHED (FINISHED so that an abort in
  STAGING keeps them until the staging copy's fence is done; TRANSFERRING
  because the KV hook acquires there in the decode role). STAGING ->
  DECODING releases them;
- `attention_factory(dense)` and `slot_of(paged)`: the runner's attention
  factory and slot lookup, built from the dense ones (sparse decode rows
  need no KV slot).

Growth (host pages per decode token) is the host hook's `grow`, which the
machine calls like any other; staging is the staging hook's acquisition.

Decode role (disaggregation): the host hook already acquires on TRANSFERRING,
so a transfer can land straight in `HostRecord.locs` rows; it then sets
`HostRecord.on_host` and `stage` copies only what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from hisparse.attention import make_factory
from hisparse.hooks import DEVICE_HOOK, DeviceBufferHook, HostPagesHook, SlotMapHook, StagingHook
from hisparse.state import HiSparseState
from resources.contract import ResourceHookProtocol
from resources.kv_buffers import KVBuffers
from resources.kv_pool import KVPool
from resources.ledger import Pool
from states import Request, RequestState

S = RequestState

KV_SCOPE = frozenset({S.TRANSFERRING, S.PREFILLING, S.PREBUILT, S.STAGING, S.FINISHED})


@attrs.define(eq=False)
class HiSparseInstall:
    """The parts of HiSparse that the engine wires in (see the module docstring)."""

    state: HiSparseState
    hooks: list[ResourceHookProtocol]
    pools: list[Pool]
    kv_scope: frozenset[RequestState]

    def attention_factory(self, dense_factory: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """The runner's attention factory: sparse decode rows here, the rest to `dense_factory`."""
        return make_factory(self.state, dense_factory)

    def slot_of(self, paged_slot_of: Callable[[Request], int | None]) -> Callable[[Request], int | None]:
        """The runner's slot lookup: sparse decode rows have no KV slot (their KV is in the buffer)."""
        return lambda request: None if DEVICE_HOOK in request.handles else paged_slot_of(request)


def install_hisparse(*, config: Any, max_context: int, model_config: Any, device: torch.device, kv_pool: KVPool,
                     kv_buffers: KVBuffers, faults: Any = None) -> HiSparseInstall:
    """Build HiSparse for an engine whose `config.hisparse` is a HiSparseConfig."""
    config.hisparse.validate_against(config, max_context)
    state = HiSparseState(config=config.hisparse, engine_config=config, model_config=model_config, device=device,
                          max_context=max_context, kv_pool=kv_pool, kv_buffers=kv_buffers, faults=faults)
    hooks: list[ResourceHookProtocol] = [DeviceBufferHook(state), HostPagesHook(state), SlotMapHook(state),
                                         StagingHook(state)]
    return HiSparseInstall(state=state, hooks=hooks, pools=state.pools, kv_scope=KV_SCOPE)
