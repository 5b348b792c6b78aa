"""enginewire: a formally specified front-end <-> engine-core protocol for LLM engines.

The public surface is re-exported here and pinned by ``tests/test_exports.py``; everything
else is private to its layer (``enginewire.spec``, ``enginewire.protocol``,
``enginewire.runtime``).
"""

from __future__ import annotations

from .spec.errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
    EngineWireError,
    ProtocolError,
    SpecViolation,
    UtilityError,
    UtilityTimeoutError,
)
from .protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    UtilityOutput,
)

__version__ = "0.1.0"

__all__ = [
    "ClientClosedError",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineDeadError",
    "EngineStartupError",
    "EngineWireError",
    "FinishReason",
    "ProtocolError",
    "SamplingParams",
    "SpecViolation",
    "UtilityError",
    "UtilityOutput",
    "UtilityTimeoutError",
    "__version__",
]
