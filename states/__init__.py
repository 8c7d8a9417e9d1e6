"""Request states, the transition table, the request record and the machine.

Pure Python: no torch, no I/O. Nothing here imports `resources`, `hisparse`
or `engine`.
"""

from states.handle import DoubleRelease, Fence, Handle, ResourceExhausted
from states.machine import FencePending, Quarantined, RequestMachine
from states.request import Request, RequestKind
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
    "Handle",
    "IllegalTransition",
    "Quarantined",
    "Request",
    "RequestKind",
    "RequestMachine",
    "RequestState",
    "ResourceExhausted",
]
