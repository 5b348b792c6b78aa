"""model_tests/stateful_fe.py through the campaign (``enginewire campaign --front-ends 2``):
two front ends over one engine and over a data-parallel group, judged by the front-end
properties; and the bank's front-end mutants, each found by it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginewire.runtime._engine_trace import ENGINE_TRACE_ENV
from enginewire.testing import mutants
from enginewire.testing.campaign import _config, run_campaign
from enginewire.testing.campaign_stats import CampaignStats
from enginewire.testing.oracle import OracleViolation
from enginewire.testing.stateful_fe import FrontEndsEngine, FrontEndsStateMachine, fe_config

FE_MUTANTS = sorted(n for n, m in mutants.BANK.items() if m.kind == "front_ends")


def _report(tmp: Path, pattern: str) -> dict[str, Any]:
    (path,) = sorted(tmp.glob(pattern))
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.fixture(scope="module")
def engine() -> Iterator[FrontEndsEngine]:
    """One engine for the fixed programs, recording its trace as a campaign's do."""
    saved = os.environ.get(ENGINE_TRACE_ENV)
    os.environ[ENGINE_TRACE_ENV] = "on"
    try:
        eng = FrontEndsEngine(fe_config(_config("null")))
    finally:
        if saved is None:
            os.environ.pop(ENGINE_TRACE_ENV)
        else:
            os.environ[ENGINE_TRACE_ENV] = saved
    yield eng
    eng.close()


def test_a_short_front_ends_campaign_passes(tmp_path: Path) -> None:
    assert run_campaign(front_ends=2, examples=2, steps=20, results_dir=str(tmp_path)) == 0
    report = _report(tmp_path, "campaign-*.json")
    (res,) = report["clients"]
    assert res["client"] == "fe" and res["failure"] is None and res["examples"] >= 2
    assert report["settings"]["front_ends"] == 2 and res["engine_cores"] == 1
    # The engine's side was drained and judged too (its session machine among the rows).
    assert report["coverage"]["per_machine"]["session"]["reached"] >= 1


@pytest.mark.slow
def test_two_front_ends_over_two_engines(tmp_path: Path) -> None:
    assert run_campaign(front_ends=2, engines=2, examples=2, steps=15,
                        results_dir=str(tmp_path)) == 0
    (res,) = _report(tmp_path, "campaign-*.json")["clients"]
    assert res["client"] == "fe-dp" and res["failure"] is None and res["engine_cores"] == 2


def test_a_program_of_every_rule_on_one_engine(engine: FrontEndsEngine) -> None:
    """Each rule once, in the order that matters: a sleep from one front end that the other
    wakes, a silent loss with requests left and a goodbye loss, each followed by a restart
    whose probes reuse the lost front end's ids."""
    stats = CampaignStats()
    state = FrontEndsStateMachine(engine, stats=stats)
    state.add(index=0, prompt=[3, 4], max_tokens=12, seed=1)
    state.add(index=1, prompt=[3, 4], max_tokens=12, seed=1)  # the same id "r1" on both
    state.echo(index=1, value="x")
    state.sleep(index=0, level=1, mode="keep")
    state.add(index=1, prompt=[5], max_tokens=3, seed=2)  # queued while asleep
    state.poll(index=1)
    state.wake_up(index=1)
    state.abort(index=0, pick=0, unknown=True)
    state.drain(index=0)
    state.drain(index=1)
    state.crash(how="vanish", left=2)
    state.add(index=1, prompt=[6], max_tokens=4, seed=3)  # goes to front end 0 meanwhile
    state.restart(kind="sync")
    state.sleep(index=1, level=0, mode="abort")
    state.wake_up(index=0)
    state.crash(how="goodbye", left=1)
    state.restart(kind="async")
    state.teardown()
    assert stats.faults == {"front_end_vanish": 1, "front_end_goodbye": 1}
    assert stats.engine_drains >= 1


def test_an_output_of_another_front_end_is_an_isolation_failure(
        engine: FrontEndsEngine) -> None:
    from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs

    state = FrontEndsStateMachine(engine)
    try:
        fe0 = state.fes[0]
        assert fe0 is not None
        with pytest.raises(OracleViolation, match=r"isolation: front end 0 .* 'r9'"):
            state._observe(fe0, EngineCoreOutputs(outputs=[EngineCoreOutput("r9", [4])]))
        state.add(index=0, prompt=[3], max_tokens=2, seed=0)
        state.drain(index=0)
        with pytest.raises(OracleViolation, match=r"exactly-once: .* after it ended LENGTH"):
            state._observe(fe0, EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [])]))
    finally:
        state.teardown()


def test_bad_front_end_settings_are_refused(tmp_path: Path) -> None:
    for bad, match in (({"front_ends": 3}, "front_ends must be 1 or 2"),
                       ({"front_ends": 2, "client": "sync"}, "give client 'all'"),
                       ({"front_ends": 2, "elastic": True}, "without a factory, elastic"),
                       ({"front_ends": 2, "engines": 2, "mutant": FE_MUTANTS[0]},
                        "drop engines")):
        with pytest.raises(ValueError, match=match):
            run_campaign(**{"examples": 1, "steps": 1, "results_dir": str(tmp_path), **bad})


def test_the_cli_refuses_what_the_machine_cannot_run(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    from enginewire.cli import main

    for extra in (["--client", "sync"], ["--backend", "ray"], ["--engines", "2", "--mutant",
                                                               FE_MUTANTS[0]]):
        assert main(["campaign", "--front-ends", "2", "--results-dir", str(tmp_path),
                     *extra]) == 2
        assert "--front-ends 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["campaign", "--front-ends", "3"])


def test_every_property_has_a_mutant() -> None:
    assert FE_MUTANTS == ["fe_finish_sent_twice", "fe_gone_requests_left_running",
                          "fe_outputs_routed_to_front_end_0", "fe_power_notice_to_caller_only"]
    assert all(mutants.BANK[n].clients == ("fe",) for n in FE_MUTANTS)
