"""The data-parallel campaign (enginewire.testing.stateful_dp): a short run on two engines
passes on the sync and the async client, and the machine catches the data-parallel client's
seeded bugs (monkeypatched here: the mutant bank switches bugs on in a child process, and
these live in the parent's client) that a one-engine campaign cannot see."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginewire.runtime import dp_client
from enginewire.spec import EngineDeadError
from enginewire.testing import campaign
from enginewire.testing.campaign import _config, run_campaign
from enginewire.testing.oracle import OracleViolation
from enginewire.testing.stateful import CampaignStats
from enginewire.testing.stateful_dp import DataParallelStateMachine, DPClientPool, dp_factory
from enginewire.testing.stateful_dp_elastic import ElasticDPStateMachine

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

KINDS = ("sync", "async")
EXAMPLES = 8
STEPS = 15
# A fixed seed rather than the ci profile's derandomized draws: those first examples enable few
# rules each (Hypothesis' swarm flags) and kill no engine in 20 examples. What a seed draws
# still depends on what the process imported before (Hypothesis' constants pool), so no test
# here counts on a kill in a given number of examples: the mutant run allows many examples
# (cheap until the first kill fails it), and fixed programs below drive the kill paths.
SEED = 3
MUTANT_EXAMPLES = 40


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started by the first spawn and kept: not a leak


@pytest.mark.parametrize("kind", KINDS)
def test_short_dp_campaign_passes(kind: str, tmp_path: Path) -> None:
    assert run_campaign(client=kind, engines=2, examples=EXAMPLES, steps=STEPS, seed=SEED,
                        results_dir=str(tmp_path)) == 0
    (path,) = tmp_path.glob("campaign-*.json")
    report = json.loads(path.read_text())
    (res,) = report["clients"]
    assert res["client"] == kind and res["failure"] is None
    assert res["examples"] >= EXAMPLES and res["steps"] >= EXAMPLES * 5
    assert report["settings"]["engines"] == 2
    per = report["coverage"]["per_machine"]
    assert per["membership"]["reached"] >= 3  # started, served, shut down at least


def test_dp_campaign_refuses_what_does_not_apply(tmp_path: Path) -> None:
    for bad in ({"client": "inproc"}, {"client": "standalone"}, {"mutants_all": True},
                {"engines": 0}, {"backend": "slurm"}):
        with pytest.raises(ValueError):
            run_campaign(**{"client": "sync", "engines": 2, "examples": 1, "steps": 1,
                            "results_dir": str(tmp_path), **bad})


# --- seeded bugs in the data-parallel client ----------------------------------------------------


def _keep_errors_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead engine's live requests are never ended (its ERROR batch is dropped)."""
    real = dp_client._DPClient._drain_done

    def drain_done(self: Any, m: Any, client: Any) -> None:
        n = len(self._failed)
        real(self, m, client)
        del self._failed[n:]

    monkeypatch.setattr(dp_client._DPClient, "_drain_done", drain_done)


def _fail_everyone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead engine's ERROR batch also ends the requests the other engines run."""
    real = dp_client._DPClient._drain_done

    def drain_done(self: Any, m: Any, client: Any) -> None:
        others = [rid for rid in self.live_requests()
                  if self._router.owner(rid) not in (None, client)]
        n = len(self._failed)
        real(self, m, client)
        if len(self._failed) > n and others:
            batch = self._failed[-1]
            why = batch.outputs[0].error
            batch.outputs.extend(dp_client.EngineCoreOutput(r, [], dp_client.FinishReason.ERROR,
                                                            error=why) for r in others)
            for rid in others:
                del self._router._owner[rid]

    monkeypatch.setattr(dp_client._DPClient, "_drain_done", drain_done)


def _anonymous_death(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call pending on an engine that died raises an EngineDeadError that does not say
    which engine."""
    monkeypatch.setattr(dp_client._DPClient, "_engine_died",
                        lambda self, m, error: EngineDeadError("an engine died"))


@pytest.mark.slow
def test_the_campaign_catches_requests_left_live_by_a_dead_engine(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _keep_errors_back(monkeypatch)
    result, _ = campaign._run_client(
        "sync", examples=MUTANT_EXAMPLES, steps=STEPS, seed=SEED, faults=True, duration=None,
        model="null", profile="ci", results_dir=tmp_path, shrink=False, progress=None,
        dp=(2, "mp"))
    assert result.failure is not None
    assert "did not finish" in result.failure, result.failure
    assert result.reproducer is not None
    assert "state = DataParallelStateMachine(pool" in result.reproducer
    assert "state.kill_engine(" in result.reproducer
    compile(result.reproducer, "<reproducer>", "exec")


@pytest.fixture(params=KINDS)
def machine(request: pytest.FixtureRequest) -> Iterator[DataParallelStateMachine]:
    pool = DPClientPool(dp_factory(request.param, _config("null", 2)), CampaignStats())
    state = DataParallelStateMachine(pool, kind=request.param, min_life=0)
    state.start(restarts=False)
    try:
        yield state
    finally:
        if state.live is not None:
            state._finish_client(check=False)
        pool.close()


def test_an_error_for_another_engines_request_is_caught(
        machine: DataParallelStateMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_everyone(monkeypatch)
    # A long request on engine 0, still running when engine 1 dies.
    machine._send(*machine._request("kept", [4, 5], 2000, 1, None, rank=0, ignore_eos=True))
    caught = r"'kept' (ended with ERROR from engine 1|runs on engine 0, yet engine 1)"
    with pytest.raises(OracleViolation, match=caught):
        machine.kill_engine(pick=1, observers=False)


def test_a_death_that_does_not_name_its_engine_is_caught(
        machine: DataParallelStateMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    _anonymous_death(monkeypatch)
    with pytest.raises(OracleViolation, match="not naming it"):
        machine.kill_engine(pick=0, observers=True)


def test_the_same_programs_pass_on_the_real_client(machine: DataParallelStateMachine) -> None:
    machine._send(*machine._request("kept", [4, 5], 2000, 1, None, rank=0, ignore_eos=True))
    machine.kill_engine(pick=1, observers=True)
    assert machine.oracle.requests["kept"].finish is None or (
        machine.oracle.requests["kept"].finish.name == "LENGTH")
    machine.echo_all(value=3)
    machine.add(prompt=[9], max_tokens=3, seed=2, stop_at=None, pin=None, reuse=7)
    machine.add(prompt=[9], max_tokens=3, seed=2, stop_at=None, pin=1, reuse=7)  # refused
    machine.drain()
    machine.teardown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_restarted_engine_serves_again_and_the_client_is_released(kind: str) -> None:
    pool = DPClientPool(dp_factory(kind, _config("null", 2)), CampaignStats())
    try:
        state = DataParallelStateMachine(pool, kind=kind, min_life=0)
        state.start(restarts=True)
        first = set(state.cut.client.engine_pids)
        state.kill_engine(pick=0, observers=True)
        state.kill_engine(pick=1, observers=False)
        assert not first & set(state.cut.client.engine_pids)
        state.echo_all(value=1)
        state.sleep(level=1, mode="keep")
        state.wake_up(tags=None)
        state.shutdown(with_pending=True)
        state.new_client()
        state.teardown()
    finally:
        pool.close()


def test_a_stopped_engine_is_found_by_its_heartbeat(machine: DataParallelStateMachine) -> None:
    """SIGSTOP, left stopped: only the heartbeat deadline declares the engine dead; its
    requests and a call pending on it fail, the other engine serves on, and the stopped
    process is ended by the client's teardown (every pid reaped)."""
    machine._send(*machine._request("kept", [4, 5], 2000, 1, None, rank=0, ignore_eos=True))
    machine.kill_engine(pick=1, observers=True, how="sigstop")
    assert machine.cut.client.dead_engines == [1]
    assert machine.stats.faults["engine_sigstop"] == 1
    machine.echo_all(value=4)
    machine.drain()
    machine.teardown()


@pytest.mark.slow
def test_the_machine_on_ray_engines(tmp_path: Path) -> None:
    """`--backend ray`: the same machine over engines placed as Ray actors (a local Ray on
    127.0.0.1, one for the whole run): a kill of one, restarts on, the replacement serves;
    and a short campaign passes."""
    pytest.importorskip("ray")
    from enginewire.runtime.ray_backend import ray_session

    with ray_session():
        pool = DPClientPool(dp_factory("sync", _config("null", 2, "ray")), CampaignStats())
        try:
            state = DataParallelStateMachine(pool, kind="sync", min_life=0)
            state.start(restarts=True)
            state.kill_engine(pick=1, observers=False)
            state.echo_all(value=2)
            state.drain()
            state.teardown()
        finally:
            pool.close()
    assert run_campaign(client="sync", engines=2, backend="ray", examples=2, steps=10,
                        seed=SEED, results_dir=str(tmp_path)) == 0


# --- elastic: engines join and leave (issue 46, stateful_dp_elastic.py) -------------------------

ELASTIC_EXAMPLES = 4
ELASTIC_STEPS = 12


@pytest.mark.parametrize("kind", KINDS)
def test_short_elastic_campaign_passes(kind: str, tmp_path: Path) -> None:
    assert run_campaign(client=kind, engines=2, elastic=True, examples=ELASTIC_EXAMPLES,
                        steps=ELASTIC_STEPS, seed=SEED, results_dir=str(tmp_path)) == 0
    (path,) = tmp_path.glob("campaign-*.json")
    report = json.loads(path.read_text())
    (res,) = report["clients"]
    assert res["failure"] is None and report["settings"]["elastic"] is True
    assert sum(n for r, n in res["rules"].items() if r.startswith("scale_")) >= 1, res["rules"]


def test_elastic_needs_local_data_parallel_engines(tmp_path: Path) -> None:
    for bad in ({"engines": 1}, {"engines": 2, "backend": "ray"}, {"elastic": "yes"}):
        with pytest.raises(ValueError, match="elastic"):
            run_campaign(**{"client": "sync", "examples": 1, "steps": 1, "elastic": True,
                            "results_dir": str(tmp_path), **bad})


# The async client only (its scale runs in a worker thread, the loop serving meanwhile): the
# sync one runs the same rules in the short campaign above, and the fast tier's time is short.
@pytest.mark.parametrize("kind", ["async"])
def test_the_scale_rules_pass_on_the_real_client(kind: str) -> None:
    """Every scale rule's shape once, in an order that leaves each precondition met: a drain
    with streams, two joiners at once, a call pending on a leaver, a joiner killed before its
    handshake, a leaver killed during its drain, a scale refused while asleep."""
    pool = DPClientPool(dp_factory(kind, _config("null", 2)), CampaignStats())
    try:
        state = ElasticDPStateMachine(pool, kind=kind, min_life=0)
        state.start(restarts=False)
        client = state.cut.client
        state.scale_down(pick=0, default_leaver=True, drain=True, during="streaming")
        assert sorted(client.engines) == [0] and client.data_parallel_size == 1
        state.scale_up(by=2, during="streaming", joiner_dies=False)
        assert sorted(client.engines) == [0, 1, 2]
        state.scale_down(pick=1, default_leaver=False, drain=False, during="call_pending")
        assert sorted(client.engines) == [0, 2]
        state.scale_up(by=1, during="call", joiner_dies=True)
        assert sorted(client.engines) == [0, 2]
        state.scale_down(pick=0, default_leaver=False, drain=True, during="kill_leaver")
        assert sorted(client.engines) == [2]
        state.sleep(level=1, mode="keep")
        state.scale_up(by=1, during="idle", joiner_dies=False)  # refused, woken, then scaled
        assert sorted(client.engines) == [0, 2]
        state.drain()
        assert state.stats.faults["call_pending_on_leaver"] == 1
        assert state.stats.faults["leaver_sigkill"] == 1
        assert state.stats.faults["joiner_sigkill"] >= 1
        state.teardown()
    finally:
        pool.close()


ELASTIC_MUTANTS = {
    "dp_leaver_still_routed": ("down", "routed to an engine that was not serving"),
    "dp_leaver_leftovers_never_ended": ("down_no_drain", "did not finish"),
    "dp_joiner_serves_before_commit": ("one_then_three", "before the scale commits"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(ELASTIC_MUTANTS))
def test_each_elastic_mutant_is_caught_by_its_rule(kind: str, name: str) -> None:
    """Each seeded bug of the elastic class, on the one rule that shows it (the bank's own
    run, test_campaign.py's test_mutant_is_detected, finds each within its budget)."""
    from enginewire.testing import mutants

    mutants.apply(name)
    pool = DPClientPool(dp_factory(kind, _config("null", 2)), CampaignStats())
    state = ElasticDPStateMachine(pool, kind=kind, min_life=0)
    try:
        state.start(restarts=False)
        shape, symptom = ELASTIC_MUTANTS[name]
        with pytest.raises(OracleViolation, match=symptom):
            if shape == "one_then_three":
                state.scale_to_one_then_three(drain=False)
            else:
                state.scale_down(pick=0, default_leaver=True, drain=shape == "down",
                                 during="streaming")
    finally:
        if state.live is not None:
            state._finish_client(check=False)
        pool.close()
        mutants.revert()
