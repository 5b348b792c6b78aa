"""``--faults off`` (``faults=False`` in model_tests/stateful.py) injects no fault at all: no
armed fault, no SIGSTOP, no kill; and a campaign run that way passes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from enginewire.testing.campaign import _config, run_campaign
from enginewire.testing.oracle import OracleViolation
from enginewire.testing.stateful import EngineClientStateMachine, builtin_factory

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")


def _machine(kind: str) -> EngineClientStateMachine:
    factory = builtin_factory(kind, _config("null"), faults=False)
    # min_life=0: shutdown may run at once (it waits for 2 * min_life steps otherwise).
    return EngineClientStateMachine(factory, kind=kind, faults=False, min_life=0)


def test_engine_wait_mode_crash_drains_instead_with_faults_off() -> None:
    # The audit's reproducer: this crashed with AttributeError (no fault hook to arm).
    state = _machine("inproc")
    try:
        state.client_state_matches_model()
        state.engine_wait_mode(then="crash")
        state.client_state_matches_model()
        assert state.stats.faults == {}
        assert state._program[-1] == "state.engine_wait_mode(then='drained')"
    finally:
        state.teardown()


def test_shutdown_with_pending_sends_no_sigstop_with_faults_off() -> None:
    state = _machine("sync")
    try:
        state.echo(value=1)
        state.shutdown(with_pending=True)
        assert state.stats.faults == {}
    finally:
        state.teardown()


def test_arming_with_faults_off_fails_loudly() -> None:
    state = _machine("inproc")
    try:
        with pytest.raises(OracleViolation, match="faults off"):
            state._arm("step:1")
    finally:
        state.teardown()


def test_inproc_campaign_with_faults_off_passes_and_injects_nothing(tmp_path: Path) -> None:
    # The audit's CLI run (`campaign --faults off --client inproc --seed 3`): it failed with
    # step_raise=20 injected.
    assert run_campaign(client="inproc", examples=30, steps=25, seed=3, faults=False,
                        results_dir=str(tmp_path)) == 0
    (path,) = tmp_path.glob("campaign-*.json")
    (res,) = json.loads(path.read_text())["clients"]
    assert res["failure"] is None and res["faults"] == {}
    assert res["rules"].get("engine_wait_mode", 0) > 0  # the rule ran, without its crash
