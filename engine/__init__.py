"""The kvlife engine: everything an embedding application needs, in one import.

    from engine import Engine, EngineConfig, SamplingParams
"""

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine, HealthReport
from engine.errors import (
    EngineClosed,
    EngineDead,
    EngineOverloaded,
    HealthCheckFailed,
    HealthCheckTimeout,
    InvalidConfig,
    InvalidRequest,
)
from engine.logging import LEVELS as LOG_LEVELS
from engine.model.hf_config import CheckpointError
from engine.logging import configure_logging, logging_configuration
from engine.outputs import RequestOutput, SpeculationStats, TokenLogprob
from engine.speculative.config import SpeculativeConfig
from engine.runtime.sessions import SessionInfo
from engine.stream import RequestStream
from engine.structured import Constraint, StructuredConfig
from hisparse.config import HiSparseConfig
from resources.ledger import LeakError, MemoryReport
from resources.plugins import PluginError
from states import FinishReason, RequestKind, RequestState

__all__ = [
    "CheckpointError",
    "Constraint",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineDead",
    "EngineOverloaded",
    "FinishReason",
    "HealthCheckFailed",
    "HealthCheckTimeout",
    "HealthReport",
    "HiSparseConfig",
    "InvalidConfig",
    "InvalidRequest",
    "LOG_LEVELS",
    "LeakError",
    "MemoryReport",
    "PluginError",
    "RequestKind",
    "RequestOutput",
    "RequestState",
    "RequestStream",
    "SamplingParams",
    "SpeculationStats",
    "SpeculativeConfig",
    "SessionInfo",
    "StructuredConfig",
    "TokenLogprob",
    "configure_logging",
    "logging_configuration",
]
