"""Prefill/decode disaggregation below the runtime: the decode side (the
`kv_transfer` hook, where received KV lands, the remote prefill client and its
links), the prefill side (the prefill role's hooks and senders, its side of a
link) and what both share (settings, wire, transport, staging); the runtime
runs both roles (docs/disaggregation.md):

    EngineConfig(disaggregation="decode", remote_prefill=RemotePrefill(peers=["host:31001"]))
    async with PrefillServer(EngineConfig(), PrefillServerConfig(bootstrap_port=31001)): ...

The prefill server's HTTP routes (`serve_prefill`) and the transfer metrics'
Prometheus export live in `engine.serve` (prefill_http.py, transfer_metrics.py).

Imported lazily, so the in-process decode role never loads torch.distributed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Histogram", "PrefillServer", "PrefillServerConfig", "RemotePrefill", "TransferStats"]

#: where each name lives; the prefill server wraps a runtime, so it sits above this package
#: (engine.prefill_server) and is only re-exported here, lazily
_WHERE = {"PrefillServer": "engine.prefill_server", "PrefillServerConfig": "engine.disagg.link.settings",
          "RemotePrefill": "engine.disagg.link.settings", "TransferStats": "engine.disagg.link.observability",
          "Histogram": "engine.disagg.link.observability"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine.disagg' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_WHERE[name]), name)
