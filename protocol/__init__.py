"""enginewire.protocol: typed wire messages and their codec."""

from __future__ import annotations

from ..spec.errors import ProtocolError
from .messages import (
    ENGINE_DEAD_SENTINEL,
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ReadyResponse,
    RequestType,
    SamplingParams,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)

__all__ = [
    "ENGINE_DEAD_SENTINEL",
    "PROTOCOL_VERSION",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "FinishReason",
    "ProtocolError",
    "ReadyResponse",
    "RequestType",
    "SamplingParams",
    "SchedulerStats",
    "UtilityOutput",
    "UtilityRequest",
]
