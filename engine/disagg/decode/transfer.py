"""How a transfer fails: `TransferFailed`, on both sides of a transfer.

The KV itself moves through the prefill role's `KVSender`
(`engine.disagg.prefill.send`): in process, `LoopbackSender` copies it into
the decode's `KVDestination`; across processes, `StagingSender` stages it
for a link and the decode's link writes it into the destination.
"""

from __future__ import annotations


class TransferFailed(RuntimeError):
    """A KV transfer did not complete."""
