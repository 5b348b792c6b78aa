"""The front-end model (spec/compose_fe.py): two front ends over two engines, safe and live,
its SESSION rows exercised (those of a front end's loss among them), each negative control
rejected by the explorer and by SPIN, and the runs issue 47 describes."""

from __future__ import annotations

import os

import pytest

from enginewire._tools.generate import ROOT
from enginewire.spec import SESSION, compose
from enginewire.spec import compose_fe as d
from enginewire.spec.compose_fe import BUGS, FEComposition, World
from enginewire.spec.explore import ExploreResult, explore_fe, uncovered_rows
from enginewire.spec.properties import FE_PROPERTIES, fe_control_targets
from enginewire.testing.spec_check import run_spin, spin_available

FE_PML = (ROOT / "spec" / "enginewire_fe.pml").read_text()
needs_spin = pytest.mark.skipif(
    not spin_available() and not os.environ.get("CI"), reason="spin not installed")

_LOSS_ROWS = {row for (mach, row) in compose.UNEXERCISED if mach == "session"
              and "GONE" in row and "REFUSED" not in row}


def test_the_front_end_model_satisfies_every_property(composed_fe: ExploreResult) -> None:
    res = composed_fe
    assert res.ok, "\n".join(v.render() for v in res.violations.values())
    assert res.states > 10_000 and res.quiescent > 0
    assert res.seconds < 60  # issue 3's bar, on two cores


def test_every_session_row_is_exercised_or_declared(composed_fe: ExploreResult) -> None:
    missing = uncovered_rows(composed_fe, d.COVERS)[SESSION.name]
    assert {(SESSION.name, row) for row in missing} == set(d.UNEXERCISED)
    assert all(reason.strip() for reason in d.UNEXERCISED.values())
    # the rows the one-engine model leaves to this one (a front end's loss) are exercised here
    assert len(_LOSS_ROWS) == 4 and not _LOSS_ROWS & set(missing)
    assert all("front-end model" in compose.UNEXERCISED["session", row] for row in _LOSS_ROWS)
    assert "ATTACHED --ATTACH_MISPLACED--> ATTACHED" not in missing  # the restart misindexed


def test_every_property_has_a_control_and_every_control_a_target() -> None:
    targets = fe_control_targets()
    assert set(targets) == set(BUGS) and all(targets.values())
    assert {p.name for p in FE_PROPERTIES} == {p for ps in targets.values() for p in ps}
    for bug, name in (("outputs_to_front_end_0", "fe_no_cross_delivery"),
                      ("ids_not_scoped", "fe_no_cross_delivery"),
                      ("dead_work_left_running", "fe_death_ends_own"),
                      ("death_ends_every_front_end", "fe_death_ends_own"),
                      ("power_notice_not_sent", "fe_power_view_converges"),
                      ("notice_before_ready", "fe_spec_conformance"),
                      ("dead_channel_read", "fe_request_ends_once"),
                      ("death_seen_by_one", "fe_request_ends")):
        assert name in targets[bug], (bug, name)


@pytest.mark.parametrize("bug", BUGS)
def test_each_negative_control_is_rejected_with_a_shortest_counterexample(bug: str) -> None:
    targets = fe_control_targets()[bug]
    res = explore_fe(bug, stop_when=frozenset(targets))
    for prop in targets:
        assert prop in res.violations, f"{bug} does not break {prop}: the property is vacuous"
        trace = res.violations[prop].trace
        assert _breaks(bug, trace, prop) and not _breaks(bug, trace[:-1], prop)


def _follow(trace: tuple[str, ...], bug: str | None = None) -> set[World]:
    comp = FEComposition(bug)
    frontier = {comp.initial()}
    for label in trace:
        frontier = {nxt for w in frontier for lab, nxt in comp.successors(w) if lab == label}
        assert frontier, f"step {label} not enabled"
    return frontier


def _breaks(bug: str, trace: tuple[str, ...], name: str) -> bool:
    comp = FEComposition(bug)
    prop = next(p for p in FE_PROPERTIES if p.name == name)
    for w in _follow(trace, bug):
        if prop.kind == "safety" and not prop.holds(w):  # type: ignore[misc]
            return True
        if (prop.kind == "liveness" and not any(True for _ in comp.successors(w))
                and prop.trigger(w) and not prop.discharged(w)):  # type: ignore[misc]
            return True
    return False


def test_unknown_negative_control_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="outputs_to_front_end_0"):
        FEComposition("no_such_bug")


# ---- the runs issue 47 describes ------------------------------------------------------------

def _names(w: World) -> dict[str, object]:
    return d.describe_world(w)


def _labels(w: World) -> set[str]:
    return {lab for lab, _ in FEComposition().successors(w)}


# "r1" from each front end, both to engine 0
_TWO = ("add_request_00", "add_request_10", "engine_receive_00", "engine_receive_10")


def test_the_same_id_from_two_front_ends_is_two_requests_each_answered_to_its_sender() -> None:
    run = (*_TWO, "engine_finish_10", "receive_output_10")
    for w in _follow(run):
        v = _names(w)
        assert (v["ereq00"], v["ereq10"]) == ("WAITING", "FINISHED_STOPPED")
        assert (v["creq0"], v["creq1"]) == ("SENT", "FINISHED_STOPPED")
        assert v["outq00"] == [] and not w[d.BAD]


def test_a_front_end_s_death_ends_its_own_work_at_each_engine_and_nobody_else_s() -> None:
    run = (*_TWO, "front_end_dies_0")
    for w in _follow(run):
        assert "front_end_lost_01" in _labels(w)  # its session at engine 1 goes too
    run = (*run, "front_end_lost_00")
    for w in _follow(run):
        v = _names(w)
        assert (v["sess00"], v["sess10"]) == ("GONE", "ATTACHED")
        assert (v["ereq00"], v["ereq10"]) == ("FINISHED_ABORTED", "WAITING")
        assert v["eng0"] == "RUNNING" and not w[d.BAD]
    # the other front end keeps being served, and a later sign of the loss loops in GONE
    for w in _follow((*run, "engine_finish_10", "receive_output_10", "front_end_lost_00")):
        v = _names(w)
        assert (v["creq1"], v["sess00"], v["eng0"]) == ("FINISHED_STOPPED", "GONE", "IDLE")


def test_a_restarted_front_end_attaches_again_and_sees_nothing_of_its_predecessor() -> None:
    run = ("add_request_00", "engine_receive_00", "engine_finish_00", "front_end_dies_0",
           "front_end_restarts_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["client0"], v["fgen0"], v["creq0"]) == ("CONSTRUCTING", 1, "UNKNOWN")
        assert v["outq00"] == []  # the predecessor's finish went with its connection
        assert "add_request_00" not in _labels(w)
    run = (*run, "engine_receive_00", "engine_receive_01", "receive_output_00",
           "receive_output_01")
    for w in _follow(run):
        v = _names(w)
        assert (v["client0"], v["sess00"], v["sess01"]) == ("READY", "ATTACHED", "ATTACHED")
        assert (v["sgen00"], v["sgen01"]) == (1, 1) and not w[d.BAD]


def test_a_restart_before_the_loss_is_seen_replaces_the_session_and_ends_its_work() -> None:
    run = ("add_request_00", "engine_receive_00", "front_end_dies_0", "front_end_restarts_0",
           "engine_receive_00")
    for w in _follow(run):
        v = _names(w)
        assert (v["sess00"], v["sgen00"], v["ereq00"]) == ("ATTACHED", 1, "FINISHED_ABORTED")
        assert "front_end_lost_00" not in _labels(w)  # its process lives again


def test_a_restart_under_the_other_index_is_refused_and_disturbs_nobody() -> None:
    run = ("add_request_10", "front_end_dies_0", "front_end_restarts_misindexed_0",
           "engine_receive_00", "receive_output_00")
    for w in _follow(run):
        v = _names(w)
        # The dead front end's session stays ATTACHED (its deadline still runs)...
        assert (v["client0"], v["sess00"], v["sess10"]) == ("SHUTDOWN", "ATTACHED", "ATTACHED")
        assert v["creq1"] == "SENT"
    for w in _follow((*run, "front_end_lost_00")):  # ...and ends it: a misplaced peer is no sign
        assert _names(w)["sess00"] == "GONE" and not w[d.BAD]
    for w in _follow((*run, "engine_receive_10", "engine_finish_10", "receive_output_10")):
        assert _names(w)["creq1"] == "FINISHED_STOPPED" and not w[d.BAD]


def test_a_sleep_from_one_front_end_is_noticed_by_the_other() -> None:
    run = ("sleep", "engine_receive_00", "engine_receive_01")
    for w in _follow(run):
        v = _names(w)
        assert (v["asleep0"], v["asleep1"]) == (1, 1)
        assert len(v["outq10"]) == len(v["outq11"]) == 1  # a notice each  # type: ignore[arg-type]
    run = (*run, "receive_output_00", "receive_output_01", "receive_output_10")
    for w in _follow(run):
        v = _names(w)
        assert (v["client0"], v["client1"], v["pcall"]) == ("SLEEPING", "SLEEPING", "none")
    run = (*run, "receive_output_11", "wake_up", "engine_receive_00", "engine_receive_01",
           "receive_output_10", "receive_output_11")
    for w in _follow(run):
        assert _names(w)["client1"] == "RUNNING" or _names(w)["client1"] == "READY"


def test_an_engine_s_death_is_seen_by_every_front_end_and_fails_only_its_own_work() -> None:
    run = ("add_request_00", "add_request_11", "engine_dies_0", "engine_death_noticed_00",
           "engine_death_noticed_10")
    for w in _follow(run):
        v = _names(w)
        assert (v["creq0"], v["creq1"]) == ("FINISHED_ERROR", "SENT")
        assert (v["knows00"], v["knows10"], v["client0"], v["client1"]) == (
            1, 1, "RUNNING", "RUNNING")


# ---- SPIN ---------------------------------------------------------------------------------

@pytest.mark.slow
@needs_spin
def test_spin_proves_every_property_of_the_committed_model(composed_fe: ExploreResult) -> None:
    results = run_spin([p.name for p in FE_PROPERTIES], pml=FE_PML, fe=True)
    failed = [r for r in results if r.errors]
    assert not failed, "\n\n".join(f"{r.prop}:\n{r.output[-3000:]}" for r in failed)
    # the same model: the explorer's worlds, plus init's two table-filling states
    assert {r.states for r in results if r.prop == "fe_spec_conformance"} == {
        composed_fe.states + 2}


@pytest.mark.slow
@needs_spin
@pytest.mark.parametrize("bug", BUGS)
def test_spin_rejects_each_negative_control(bug: str) -> None:
    for r in run_spin(list(fe_control_targets()[bug]), bug, pml=FE_PML, jobs=1, fe=True):
        assert r.errors > 0, f"SPIN accepts {bug} for {r.prop}: the property is vacuous"
        assert f"SPIN trail for {r.prop}:" in r.output, r.output[-2000:]
