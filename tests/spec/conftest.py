from __future__ import annotations

import pytest

from enginewire.spec.explore import ExploreResult, explore


@pytest.fixture(scope="session")
def composed() -> ExploreResult:
    """The full exploration of the real composed model, computed once per test session."""
    return explore()
