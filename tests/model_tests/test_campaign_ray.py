"""The data-parallel campaign's faults on Ray engines (issue 44): `enginewire campaign --engines
2 --backend ray` failed on both clients once a SIGSTOPped engine was declared dead by its
heartbeat, since its actor refused every replacement while the stopped engine lived. Here the
campaign's machine runs that program on one local Ray (127.0.0.1, as the campaign starts
it): stops and a kill with restarts on, the same index stopped twice, and each dead engine
gone before its replacement serves."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from enginewire.testing.campaign import _config
from enginewire.testing.stateful import CampaignStats
from enginewire.testing.stateful_dp import DataParallelStateMachine, DPClientPool, dp_factory

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

# (pick, how, observers): a stop found by the heartbeat with a call pending on it, the same
# index stopped again (its second replacement), then a kill of the other index.
PROGRAM = ((0, "sigstop", True), (0, "sigstop", False), (1, "sigkill", False))


@pytest.fixture(scope="module")
def on_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from multiprocessing import resource_tracker

    from enginewire.runtime.ray_backend import ray_session

    if ray.is_initialized():
        pytest.skip("needs Ray not initialized here (the campaign starts its own)")
    resource_tracker.ensure_running()  # started by the first spawn and kept: not a leak
    saved = os.environ.pop("RAY_ADDRESS", None)
    try:
        with ray_session() as session:
            yield session
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_stopped_and_killed_ray_engines_are_replaced(on_ray: Any, kind: str) -> None:
    pool = DPClientPool(dp_factory(kind, _config("null", 2, "ray")), CampaignStats())
    try:
        state = DataParallelStateMachine(pool, kind=kind, min_life=0)
        state.start(restarts=True)
        for pick, how, observers in PROGRAM:
            client = state.cut.client
            old = client.engine_client(pick).engine_pid
            state.kill_engine(pick=pick, observers=observers, how=how)  # SERVING again
            new = client.engine_client(pick).engine_pid
            assert new not in (None, old)
            # Reaped by its actor before the replacement started: not even a zombie.
            assert not psutil.pid_exists(old), f"engine {pick}'s {how} incarnation lives on"
        assert state.stats.faults["engine_sigstop"] == 2
        state.echo_all(value=2)
        state.drain()
        state.teardown()
    finally:
        pool.close()
