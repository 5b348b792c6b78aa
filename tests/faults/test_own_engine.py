"""docs/faults.md "Worked example: your own engine": a WeightSource the test registers is
the one every launched engine loads, so the fault harness runs against the user's engine."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from enginewire.faults import Cell, Fault, Scenario, run_fault_matrix
from enginewire.runtime import model
from enginewire.runtime.config import EngineConfig
from enginewire.spec import EngineStartupError
from enginewire.testing.conformance import collect, open_client, request

# The user's own module: importable by name, as a test suite's helper module is (spawn gives
# the engine this process's sys.path).
MY_WEIGHTS = textwrap.dedent("""
    from enginewire.runtime.model import LlamaArch, TinyRandomSource

    def my_source(model, seed):
        return TinyRandomSource(seed, LlamaArch(num_layers=1), model)
""")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Registrations made by the test are undone: the process-wide table and its variable."""
    (tmp_path / "h5_my_weights.py").write_text(MY_WEIGHTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(model.WEIGHT_SOURCES_ENV, "{}")
    monkeypatch.setenv("ENGINEWIRE_ENGINE_THREADS", "1")
    saved = dict(model._SOURCES)
    try:
        yield
    finally:
        model._SOURCES.clear()
        model._SOURCES.update(saved)


def test_a_registered_source_reaches_the_fault_matrix_engines(registry: None,
                                                              tmp_path: Path) -> None:
    import h5_my_weights  # type: ignore[import-not-found]

    model.register_weight_source("h5-my-model", h5_my_weights.my_source)
    config = EngineConfig(model="h5-my-model", max_num_seqs=4)
    cell = Cell("sync", Scenario.GENERATE, Fault(point="forward", action="oom", at=2))
    # Before the fix the warm-up passed in process and the cell's engine failed to start
    # ("unknown model"): startup_error where the spec says dead.
    assert run_fault_matrix(["sync"], results_dir=str(tmp_path), config=config, cells=[cell],
                            extra_cells=[], echo=None) == 0


def test_a_source_an_engine_cannot_import_is_named_with_the_fix(registry: None) -> None:
    model.register_weight_source("h5-lambda-model", lambda m, seed: model.TinyRandomSource(seed))
    assert model.resolve_weight_source("h5-lambda-model", 0).name == "tiny"  # in process: fine
    with pytest.raises(EngineStartupError, match="module-level function or class"):
        open_client("sync", EngineConfig(model="h5-lambda-model"))


def test_a_launched_engine_generates_with_the_registered_source(registry: None) -> None:
    import h5_my_weights

    model.register_weight_source(".h5w", h5_my_weights.my_source)
    with open_client("sync", EngineConfig(model="/weights/mine.H5W", max_num_seqs=2)) as cut:
        cut.add_request(request("r", 3))
        assert len(collect(cut, ["r"])["r"].tokens) == 3


def test_bad_registrations_are_refused() -> None:
    with pytest.raises(TypeError, match="name"):
        model.register_weight_source("", lambda m, s: model.TinyRandomSource(s))
    with pytest.raises(TypeError, match="callable"):
        model.register_weight_source("x", "not a factory")  # type: ignore[arg-type]
