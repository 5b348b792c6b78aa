"""The public surface is small and explicit: adding or removing a name is a decision."""

from __future__ import annotations

import enginewire

EXPECTED = {
    "AsyncMPClient",
    "EngineConfig",
    "EngineCoreClient",
    "InprocClient",
    "SyncMPClient",
    "make_client",
    "make_client_async",
    "run_engine_core",
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
}


def test_public_names_are_pinned() -> None:
    assert set(enginewire.__all__) == EXPECTED


def test_every_public_name_resolves_and_nothing_private_leaks() -> None:
    for name in enginewire.__all__:
        assert hasattr(enginewire, name), name
    public = {n for n in vars(enginewire) if not n.startswith("_")}
    # Subpackages appear as attributes once imported; they are namespaces, not API names.
    namespaces = {"spec", "protocol", "runtime", "testing", "benchmarks", "cli", "faults"}
    assert public - namespaces - {"annotations"} <= EXPECTED


def test_error_family_is_closed() -> None:
    errors = [getattr(enginewire, n) for n in enginewire.__all__ if n.endswith("Error")]
    errors.append(enginewire.SpecViolation)
    for cls in errors:
        assert issubclass(cls, enginewire.EngineWireError), cls
    assert issubclass(enginewire.UtilityTimeoutError, enginewire.UtilityError)
