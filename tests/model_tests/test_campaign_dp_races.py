"""The data-parallel machine's race rules (issue 44, items 2 and 8): a utility call whose
engine dies and is being replaced between the pick and the send, and a sleep racing a stopped
engine that then sleeps late or dies. Each passes on the real client, and each finds its seeded
bug (mutants ``dp_member_client_read_outside_lock`` and ``dp_power_follows_combined_reply``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from enginewire.testing import mutants
from enginewire.testing.campaign import _config
from enginewire.testing.campaign_stats import CampaignStats
from enginewire.testing.oracle import OracleViolation
from enginewire.testing.stateful_dp import DataParallelStateMachine, DPClientPool, dp_factory

KINDS = ("sync", "async")


def _machine(kind: str, restarts: bool) -> tuple[DPClientPool, DataParallelStateMachine]:
    pool = DPClientPool(dp_factory(kind, _config("null", 2)), CampaignStats())
    state = DataParallelStateMachine(pool, kind=kind, min_life=0)
    state.start(restarts=restarts)
    return pool, state


@pytest.fixture
def mutant() -> Iterator[None]:
    try:
        yield
    finally:
        mutants.revert()


@pytest.mark.parametrize("kind", KINDS)
def test_the_race_rules_pass_on_the_real_client(kind: str) -> None:
    pool, state = _machine(kind, restarts=True)
    try:
        state.kill_engine(pick=0, observers=False, how="after_pick")
        state.kill_engine(pick=0, observers=True, how="after_pick")
        state.kill_engine(pick=1, observers=False, how="sleep_then_resume")
        state.kill_engine(pick=0, observers=False, how="sleep_then_kill")
        state.add(prompt=[9], max_tokens=3, seed=2, stop_at=None, pin=None, reuse=7)
        state.drain()
        assert state.stats.faults["engine_sigkill_after_pick"] == 2
        state.teardown()
    finally:
        pool.close()


@pytest.mark.parametrize("kind", KINDS)
def test_races_losing_an_engine_for_good(kind: str) -> None:
    pool, state = _machine(kind, restarts=False)
    try:
        # A long request pinned to the engine the sleep loses: aborted or failed, judged.
        state._send(*state._request("kept", [4, 5], 2000, 1, None, rank=1, ignore_eos=True))
        state.kill_engine(pick=1, observers=False, how="sleep_then_kill")
        assert state.cut.client.dead_engines == [1]
        state.kill_engine(pick=0, observers=False, how="after_pick")  # the last one
        assert state.cut.client.is_dead
        state.teardown()
    finally:
        pool.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("broadcast", [False, True])
def test_a_member_read_outside_the_lock_is_found(kind: str, broadcast: bool,
                                                 mutant: None) -> None:
    mutants.apply("dp_member_client_read_outside_lock")
    pool, state = _machine(kind, restarts=True)
    try:
        with pytest.raises((AttributeError, OracleViolation)) as caught:
            state.kill_engine(pick=0, observers=broadcast, how="after_pick")
        assert "NoneType" in str(caught.value) or "call_utility" in str(caught.value)
    finally:
        if state.live is not None:
            state._finish_client(check=False)
        pool.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("then", ["resume", "kill"])
def test_a_power_state_left_behind_is_found(kind: str, then: str, mutant: None) -> None:
    mutants.apply("dp_power_follows_combined_reply")
    pool, state = _machine(kind, restarts=False)
    try:
        with pytest.raises(OracleViolation, match="sleep, yet the client is READY"):
            state.kill_engine(pick=1, observers=False, how=f"sleep_then_{then}")
    finally:
        if state.live is not None:
            state._finish_client(check=False)
        pool.close()
