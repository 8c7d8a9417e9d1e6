"""The decode role of prefill/decode disaggregation: prefill workers,
transfer backends and the `kv_transfer` hook; and the multi-process roles
(docs/disaggregation.md):

    EngineConfig(disaggregation="decode", remote_prefill=RemotePrefill(peers=["host:31001"]))
    async with PrefillServer(EngineConfig(), PrefillServerConfig(bootstrap_port=31001)): ...
    await serve_prefill(EngineConfig(), PrefillServerConfig(...), "127.0.0.1", 30001)   # + HTTP

Imported lazily, so the in-process decode role never loads torch.distributed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PrefillServer", "PrefillServerConfig", "RemotePrefill", "TransferCollector", "serve_prefill"]

_WHERE = {"PrefillServer": "prefill_server", "PrefillServerConfig": "settings", "RemotePrefill": "settings",
          "TransferCollector": "observability", "serve_prefill": "prefill_http"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine.disagg' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"engine.disagg.{_WHERE[name]}"), name)
