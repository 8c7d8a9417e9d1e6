"""`install_hisparse`: what `engine.build` plugs in when HiSparse is on.

The returned `HiSparseInstall` carries:

- `hooks`: device slots, host pages, slot maps, in release order, each
  declared to be released before "kv";
- `pools`: the three pools, for the memory report and the leak check;
- `kv_scope`: the KV hook's narrowed scope. Device KV pages are held only
  until the prompt is on the host: TRANSFERRING, PREFILLING, PREBUILT,
  STAGING and FINISHED (FINISHED so that an abort in STAGING keeps them
  until the staging copy's fence is done; TRANSFERRING because the KV hook
  acquires there in the decode role). STAGING -> DECODING releases them;
- `attention_factory(runner)`: installs the composite attention and lets
  the runner prepare sparse decode rows without a KV slot;
- `grow(request, num_tokens)`: the loop's per-step growth (host pages);
- `on_transition`: a machine observer that starts the staging copy.

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
from hisparse.hooks import DEVICE_HOOK, DeviceBufferHook, HostPagesHook, SlotMapHook
from hisparse.state import HiSparseState
from states import Request, RequestState

S = RequestState

KV_SCOPE = frozenset({S.TRANSFERRING, S.PREFILLING, S.PREBUILT, S.STAGING, S.FINISHED})


@attrs.define(eq=False)
class HiSparseInstall:
    """The parts of HiSparse that the engine wires in (see the module docstring)."""

    state: HiSparseState
    hooks: list[Any]
    pools: list[Any]
    kv_scope: frozenset[RequestState]

    def attention_factory(self, runner: Any) -> Callable[[Any, Any], Any]:
        """Wrap `runner`'s dense factory; its sparse decode rows need no KV slot."""
        paged_slot_of = runner.slot_of
        runner.slot_of = lambda r: None if DEVICE_HOOK in r.handles else paged_slot_of(r)
        return make_factory(self.state, runner.attention_factory)

    def grow(self, request: Request, num_tokens: int) -> bool:
        return self.state.grow(request, num_tokens)

    def on_transition(self, request: Request, src: RequestState, dst: RequestState) -> None:
        self.state.on_transition(request, src, dst)


def install_hisparse(*, config: Any, model_config: Any, device: torch.device, ledger: Any, kv_pool: Any,
                     kv_buffers: Any) -> HiSparseInstall:
    """Build HiSparse for an engine whose `config.hisparse` is a HiSparseConfig."""
    state = HiSparseState(config=config.hisparse, engine_config=config, model_config=model_config,
                          device=device, ledger=ledger, kv_pool=kv_pool, kv_buffers=kv_buffers)
    host_hook = HostPagesHook(state)
    state.host_hook = host_hook
    hooks = [DeviceBufferHook(state), host_hook, SlotMapHook(state)]
    return HiSparseInstall(state=state, hooks=hooks, pools=state.pools, kv_scope=KV_SCOPE)
