"""The kvlife engine: the public embedded API, config, loop and CLI."""

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.errors import EngineClosed, EngineOverloaded, HealthCheckFailed, InvalidConfig, InvalidRequest
from engine.outputs import RequestOutput
from engine.stream import RequestStream

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineOverloaded",
    "HealthCheckFailed",
    "InvalidConfig",
    "InvalidRequest",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
]
