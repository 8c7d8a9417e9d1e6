"""How a transfer fails: `TransferFailed`, on both sides of a transfer.

The KV itself moves through the prefill role's `KVSender`
(`engine.disagg.prefill.send`): in process, `LoopbackSender` copies it into
the decode's `KVDestination`; across processes, `LinkSender` hands it to
its link (from the pages, or staged) and the decode's link receives it into
the destination's pages, or writes it there from staging. Either way a
destination's write runs on a side stream of its device that first waits
for the compute stream, and is waited for before the job ends: the transfer's
fence completes after the copy, never while it is only queued.
"""

from __future__ import annotations


class TransferFailed(RuntimeError):
    """A KV transfer did not complete."""
