from __future__ import annotations

import pytest

from enginewire.spec.explore import ExploreResult, explore, explore_dp, explore_fe


@pytest.fixture(scope="session")
def composed() -> ExploreResult:
    """The full exploration of the real composed model, computed once per test session."""
    return explore()


@pytest.fixture(scope="session")
def composed_dp() -> ExploreResult:
    """The full exploration of the two-engine model, computed once per test session."""
    return explore_dp()


@pytest.fixture(scope="session")
def composed_fe() -> ExploreResult:
    """The full exploration of the front-end model, computed once per test session."""
    return explore_fe()
