"""enginewire: a formally specified front-end <-> engine-core protocol for LLM engines.

The public surface is re-exported here and pinned by ``tests/test_exports.py``; everything
else is private to its layer (``enginewire.spec``, ``enginewire.protocol``,
``enginewire.runtime``).
"""

from __future__ import annotations

from .protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    UtilityOutput,
)
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

__version__ = "0.1.0"

# Runtime names load torch; resolve them on first use so `import enginewire` (and the CLI's
# --help) stays light.
_LAZY = {
    "AsyncMPClient": "async_mp_client",
    "EngineConfig": "config",
    "EngineCoreClient": "client",
    "InprocClient": "client",
    "SyncMPClient": "sync_mp_client",
    "make_client": "factory",
    "make_client_async": "factory",
    "run_engine_core": "engine_proc",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'enginewire' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".runtime.{module}", __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "AsyncMPClient",
    "ClientClosedError",
    "EngineConfig",
    "EngineCoreClient",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineDeadError",
    "EngineStartupError",
    "EngineWireError",
    "FinishReason",
    "InprocClient",
    "ProtocolError",
    "SamplingParams",
    "SpecViolation",
    "SyncMPClient",
    "UtilityError",
    "UtilityOutput",
    "UtilityTimeoutError",
    "__version__",
    "make_client",
    "make_client_async",
    "run_engine_core",
]
