"""Request states, the transition table, the request record and the machine.

Pure Python: no torch, no I/O. Nothing here imports `resources`, `hisparse`
or `engine`.
"""

from states.handle import DoubleRelease, Fence, Handle, ResourceExhausted
from states.machine import FencePending, Quarantined, RequestMachine
from states.protocols import (ExtendingHook, GrowingHook, Hook, Ledger, PublishingHook, QuarantiningHook,
                              RollingBackHook, TransitionObserver, TrimmingHook)
from states.request import Request, RequestKind, TokenLogprob
from states.request_state import (
    HELD_STATES,
    LIVE_STATES,
    TRANSITIONS,
    FinishReason,
    IllegalTransition,
    RequestState,
)

__all__ = [
    "HELD_STATES",
    "LIVE_STATES",
    "TRANSITIONS",
    "DoubleRelease",
    "Fence",
    "FencePending",
    "FinishReason",
    "ExtendingHook",
    "GrowingHook",
    "Handle",
    "Hook",
    "IllegalTransition",
    "Ledger",
    "PublishingHook",
    "QuarantiningHook",
    "RollingBackHook",
    "Quarantined",
    "Request",
    "RequestKind",
    "RequestMachine",
    "RequestState",
    "ResourceExhausted",
    "TokenLogprob",
    "TransitionObserver",
    "TrimmingHook",
]
