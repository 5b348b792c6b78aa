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
