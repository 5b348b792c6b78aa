"""``campaign --model-coverage`` (model_tests/model_coverage.py): a report's coverage against
the transitions the composed model reaches."""

from __future__ import annotations

from typing import Any

import pytest

from enginewire.testing import model_coverage
from enginewire.testing.campaign import run_campaign


def test_the_comparison_counts_missed_and_beyond(monkeypatch: pytest.MonkeyPatch) -> None:
    model = frozenset({"client READY -SHUTDOWN-> SHUTDOWN", "engine IDLE -WORK_ARRIVED-> RUNNING",
                       "utility PENDING -CANCEL-> CANCELLED"})
    monkeypatch.setattr(model_coverage, "model_reach", lambda dp=False: (model, 0.5))
    cov: dict[str, Any] = {
        "transition_counts": {"client READY -SHUTDOWN-> SHUTDOWN": 3,
                              "engine IDLE -WORK_ARRIVED-> RUNNING": 1,
                              "client SHUTDOWN -SHUTDOWN-> SHUTDOWN": 1},
        "never_reached": [{"transition": "utility PENDING -CANCEL-> CANCELLED",
                           "why": "only the async client cancels"}],
    }
    got = model_coverage.compare_with_model(cov)
    assert (got["reaches"], got["reached"], got["percent"]) == (3, 2, 66.7)
    assert got["missed"] == [{"transition": "utility PENDING -CANCEL-> CANCELLED",
                              "why": "only the async client cancels"}]
    assert got["beyond_model"] == ["client SHUTDOWN -SHUTDOWN-> SHUTDOWN"]


def test_a_mutant_run_refuses_model_coverage(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="model_coverage"):
        run_campaign(mutant="abort_not_acknowledged", model_coverage=True,
                     results_dir=str(tmp_path))


def test_a_run_of_one_engine_and_data_parallel_clients_is_measured_against_both_models(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # --client all: its one-engine kinds drive the one-engine model's rows, its dp-sync and
    # dp-async the two-engine model's (membership); neither model alone is the denominator.
    one = frozenset({"client READY -SHUTDOWN-> SHUTDOWN", "attach BINDING -BOUND-> WAITING"})
    two = frozenset({"client READY -SHUTDOWN-> SHUTDOWN", "membership SERVING -LOST-> DEGRADED"})
    monkeypatch.setattr(model_coverage, "model_reach", lambda dp=False: (two if dp else one, 1.0))
    cov: dict[str, Any] = {
        "transition_counts": {"client READY -SHUTDOWN-> SHUTDOWN": 2,
                              "membership SERVING -LOST-> DEGRADED": 1},
        "never_reached": [{"transition": "attach BINDING -BOUND-> WAITING", "why": "a gap"}],
    }
    got = model_coverage.compare_with_model(cov, data_parallel=None)
    assert got["model"] == "one-engine and two-engine"
    assert (got["reaches"], got["reached"], got["explore_s"]) == (3, 2, 2.0)
    assert got["missed"] == [{"transition": "attach BINDING -BOUND-> WAITING", "why": "a gap"}]
    assert got["beyond_model"] == []
