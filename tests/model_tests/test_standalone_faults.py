"""The engine faults on an engine started on its own, and the in-process deferred calls: fixed
programs through every case, so each runs whatever the derandomized campaign draws.

A standalone engine's death reaches its attached front end through the heartbeat deadline
only; the campaign's ``crash`` judges it as the launched machine's, then the pool reaps the
dead engine (its exit, its leftovers) and a fresh one carries the program on.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

from enginewire.testing.campaign import _config
from enginewire.testing.stateful import (
    ATTACHED_HEARTBEAT_TIMEOUT_S,
    AttachPool,
    CampaignStats,
    EngineClientStateMachine,
    StandaloneEngine,
    StandaloneEngineStateMachine,
    builtin_factory,
)

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

_ADD = {"prompt": [5, 6], "max_tokens": 4, "seed": 1, "stop_at": None, "ignore_eos": True,
        "temperature": 0.0, "top_p": 1.0, "reuse": 7}


@contextlib.contextmanager
def _machine(stats: CampaignStats) -> Iterator[StandaloneEngineStateMachine]:
    """A standalone machine over a fresh engine; teardown as Hypothesis runs it, and the last
    engine stopped and judged (its exit status, every leak) at the end."""
    pool = AttachPool(StandaloneEngine(_config("null")), stats)
    try:
        state = StandaloneEngineStateMachine(pool, stats=stats, exact_tokens=True)
        try:
            yield state
        except BaseException:
            with contextlib.suppress(Exception):
                state.teardown()
            raise
        state.teardown()
    finally:
        pool.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sigkill", "sigstop", "step_raise", "step_exit"])
def test_a_standalone_engine_dies_and_is_replaced(how: str) -> None:
    """Each way to die, with and without witnesses (a blocked read, a call held pending):
    seen within the heartbeat bound, every call refused, then a new engine serves."""
    stats = CampaignStats()
    with _machine(stats) as state:
        for observers in (False, True):
            state._life = state.min_life  # crash waits until the engine has lived a while
            state._deaths = 0  # one death per example; this program is one example
            state.add(**_ADD)
            start = time.monotonic()
            state.crash(how=how, observers=observers)
            took = time.monotonic() - start
            assert state.cut.client.is_dead
            # Heartbeat deaths are seen at the deadline; the engine's sentinel (a raise) at once.
            assert took < ATTACHED_HEARTBEAT_TIMEOUT_S + 1.5, took
            state.client_state_matches_model()
            state.call_after_end()
            state.restart()
            state.add(**_ADD)
            state.drain()
            state.echo(value=[1, "a"])
    assert stats.engines_started == 2  # one per death (the campaign counts the first)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["malformed_frame", "step_delay", "utility_delay", "sigstop"])
def test_handover_after_a_fault_the_engine_survives(fault: str) -> None:
    stats = CampaignStats()
    with _machine(stats) as state:
        for how, kind in (("shutdown", "async"), ("vanish", "sync")):
            state.add(**_ADD)
            state.handover_after_fault(fault=fault, how=how, next_kind=kind)
            state.client_state_matches_model()
            state.drain()
    assert stats.engines_started == 0 and stats.faults[fault] == 2  # the first engine served


@pytest.mark.parametrize("level", [None, 0, 1, 2])
def test_an_in_process_wait_with_outputs_in_flight(level: int | None) -> None:
    """pause/sleep(wait) on the in-process client while requests stream: each output arrives
    once, the call returns when the engine is idle, and a wake-up resumes it."""
    stats = CampaignStats()
    state = EngineClientStateMachine(builtin_factory("inproc", _config("null")), kind="inproc",
                                     stats=stats, exact_tokens=True)
    try:
        for _ in range(3):
            state.add(**{**_ADD, "max_tokens": 24})
            state.poll()
            state.wait_mode(level=level)
            state.client_state_matches_model()
        state.drain()
    finally:
        state.teardown()
    assert stats.rules["wait_mode"] == 3
