"""The two-engine model (spec/compose_dp.py): safe and live, every membership row exercised,
each negative control rejected by the explorer and by SPIN, and the runs the membership
docstring describes."""

from __future__ import annotations

import os

import pytest

from enginewire._tools.generate import ROOT
from enginewire.spec import MEMBERSHIP, SCALE
from enginewire.spec import compose_dp as d
from enginewire.spec.compose_dp import BUGS, DPComposition, World
from enginewire.spec.explore import ExploreResult, explore_dp, uncovered_rows
from enginewire.spec.properties import DP_PROPERTIES, dp_control_targets
from enginewire.testing.spec_check import run_spin, spin_available

DP_PML = (ROOT / "spec" / "enginewire_dp.pml").read_text()
needs_spin = pytest.mark.skipif(
    not spin_available() and not os.environ.get("CI"), reason="spin not installed")


def test_the_two_engine_model_satisfies_every_property(composed_dp: ExploreResult) -> None:
    res = composed_dp
    assert res.ok, "\n".join(v.render() for v in res.violations.values())
    assert res.states > 10_000 and res.quiescent > 0


def test_every_membership_row_is_exercised(composed_dp: ExploreResult) -> None:
    # the scale operation's rows too: LEAVE, DRAINED, REMOVE from STARTING, DEAD and
    # RESTARTING, a draining leaver's death and shutdown, REMOVED's loops, and SCALE's own
    missing = uncovered_rows(composed_dp, d.COVERS)
    assert missing[MEMBERSHIP.name] == []
    assert {(SCALE.name, row) for row in missing[SCALE.name]} == set(d.UNEXERCISED)
    assert all(reason.strip() for reason in d.UNEXERCISED.values())


def test_every_property_has_a_control_and_every_control_a_target() -> None:
    targets = dp_control_targets()
    assert set(targets) == set(BUGS) and all(targets.values())
    assert {p.name for p in DP_PROPERTIES} == {p for ps in targets.values() for p in ps}
    # the four the data-parallel issue (#29) asks for, each with a control of its own
    for name in ("dp_death_fails_its_own", "dp_routes_to_serving", "dp_request_ends_once",
                 "dp_fresh_channel"):
        assert any(name in ps for ps in targets.values()), name
    # the elastic issue's (#46): routing, a leaver's work, a scale's end, a removed engine's
    # frames, the client's death; and the two bugs of vLLM PR #37357
    for bug, name in (("route_to_leaver", "dp_routes_to_serving"),
                      ("deadline_forgets_live", "dp_leaver_work_ends"),
                      ("join_waiter_after_event", "dp_scale_terminates"),
                      ("joiner_death_unwaited", "dp_scale_terminates"),
                      ("removed_identity_reused", "dp_removed_engine_silent"),
                      ("draining_not_counted", "dp_client_dead_iff_none_left")):
        assert name in targets[bug], (bug, name)


@pytest.mark.parametrize("bug", BUGS)
def test_each_negative_control_is_rejected_with_a_shortest_counterexample(bug: str) -> None:
    targets = dp_control_targets()[bug]
    res = explore_dp(bug, stop_when=frozenset(targets))
    for prop in targets:
        assert prop in res.violations, f"{bug} does not break {prop}: the property is vacuous"
        trace = res.violations[prop].trace
        assert _breaks(bug, trace, prop) and not _breaks(bug, trace[:-1], prop)


def _follow(trace: tuple[str, ...], bug: str | None = None) -> set[World]:
    comp = DPComposition(bug)
    frontier = {comp.initial()}
    for label in trace:
        frontier = {nxt for w in frontier for lab, nxt in comp.successors(w) if lab == label}
        assert frontier, f"step {label} not enabled"
    return frontier


def _breaks(bug: str, trace: tuple[str, ...], name: str) -> bool:
    comp = DPComposition(bug)
    prop = next(p for p in DP_PROPERTIES if p.name == name)
    for w in _follow(trace, bug):
        if prop.kind == "safety" and not prop.holds(w):  # type: ignore[misc]
            return True
        if (prop.kind == "liveness" and not any(True for _ in comp.successors(w))
                and prop.trigger(w) and not prop.discharged(w)):  # type: ignore[misc]
            return True
    return False


def test_unknown_negative_control_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="route_to_restarting"):
        DPComposition("no_such_bug")


# ---- the runs spec/membership.py describes ---------------------------------------------------

_UP = ("engine_start_0", "engine_start_1", "receive_output_0", "receive_output_1")
# one request on each engine, both admitted there
_TWO = ("add_request_0", "add_request_1", "engine_receive_0", "engine_receive_1")


def _names(w: World) -> dict[str, object]:
    return d.describe_world(w)


def test_the_client_is_ready_once_every_engine_has_handshaken() -> None:
    for w in _follow(("construct", *_UP[:3])):
        assert _names(w)["client"] == "CONSTRUCTING"
        assert (_names(w)["mem0"], _names(w)["mem1"]) == ("SERVING", "STARTING")
    for w in _follow(("construct", *_UP)):
        assert _names(w)["client"] == "READY"


def test_a_death_fails_exactly_the_dead_engines_request() -> None:
    for w in _follow(("construct", *_UP, *_TWO, "crash_silently_0", "process_exit_noticed_0")):
        v = _names(w)
        assert (v["mem0"], v["mem1"]) == ("DEAD", "SERVING")
        assert (v["creq0"], v["creq1"]) == ("FINISHED_ERROR", "SENT")
        assert v["client"] == "RUNNING" and v["inq0"] == v["outq0"] == []
    # the survivor's request still ends as its engine says
    run = ("construct", *_UP, *_TWO, "crash_silently_0", "process_exit_noticed_0",
           "engine_finish_1", "receive_output_1")
    for w in _follow(run):
        assert _names(w)["creq1"] == "FINISHED_STOPPED"


def test_the_client_dies_with_its_last_engine_only() -> None:
    run = ("construct", *_UP, "crash_silently_0", "process_exit_noticed_0")
    for w in _follow(run):
        assert _names(w)["client"] == "READY"
    for w in _follow((*run, "crash_with_sentinel_1", "receive_output_1")):
        assert _names(w)["client"] == "DEAD"
    # the monitor's later notice loops in DEAD
    for w in _follow((*run, "crash_with_sentinel_1", "receive_output_1",
                      "process_exit_noticed_1")):
        assert _names(w)["mem1"] == "DEAD" and not w[d.BAD]


def test_a_replacement_gets_a_fresh_channel_and_requests_only_once_it_serves() -> None:
    comp = DPComposition()
    run = ("construct_with_restarts", *_UP, "add_request_0", "crash_silently_0",
           "process_exit_noticed_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["mem0"], v["gen0"], v["creq0"]) == ("RESTARTING", 1, "FINISHED_ERROR")
        assert v["inq0"] == v["outq0"] == [] and not w[d.EXITED[0]]
        labels = {lab for lab, _ in comp.successors(w)}
        assert "add_request_0" not in labels and "add_request_1" in labels
    for w in _follow((*run, "engine_start_0", "receive_output_0")):
        assert _names(w)["mem0"] == "SERVING"
        assert "add_request_0" in {lab for lab, _ in comp.successors(w)}
    # a failed replacement leaves the member dead: no second restart
    for w in _follow((*run, "crash_silently_0", "process_exit_noticed_0")):
        assert _names(w)["mem0"] == "DEAD" and _names(w)["client"] == "RUNNING"


def test_an_engine_lost_during_construction_fails_it() -> None:
    for w in _follow(("construct", "crash_silently_0", "process_exit_noticed_0")):
        v = _names(w)
        assert v["client"] == "SHUTDOWN" and (v["mem0"], v["mem1"]) == ("SHUT_DOWN", "SHUT_DOWN")
        assert all(w[x] for x in d.EXITED)


# ---- scale: the runs spec/membership.py's "Elastic scaling" describes ----------------------

def _labels(w: World) -> set[str]:
    return {lab for lab, _ in DPComposition().successors(w)}


def test_a_leaver_takes_no_new_work_and_its_requests_finish_before_it_is_removed() -> None:
    run = ("construct", *_UP, "add_request_0", "engine_receive_0", "scale_leave_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["mem0"], v["scale"], v["creq0"]) == ("DRAINING", "SCALING", "SENT")
        labels = _labels(w)
        assert "add_request_0" not in labels and "call_utility_0" not in labels
        assert "add_request_1" in labels and not any(x.startswith("scale_") for x in labels)
    run = (*run, "engine_finish_0", "receive_output_0", "leaver_drained_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["mem0"], v["scale"], v["creq0"]) == ("REMOVED", "IDLE", "FINISHED_STOPPED")
        assert w[d.EXITED[0]] and v["client"] == "RUNNING"
    # the monitor's report of the exit the client caused loops in REMOVED
    for w in _follow((*run, "process_exit_noticed_0")):
        assert _names(w)["mem0"] == "REMOVED" and not w[d.BAD]


def test_at_the_drain_deadline_a_leaver_s_work_ends_with_abort_and_its_call_fails() -> None:
    run = ("construct", *_UP, "add_request_0", "call_utility_0", "scale_leave_0",
           "drain_deadline_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["mem0"], v["scale"]) == ("REMOVED", "IDLE")
        assert (v["creq0"], v["util"]) == ("FINISHED_ABORTED", "FAILED_DEAD")
        assert v["inq0"] == v["outq0"] == [] and w[d.EXITED[0]]


def test_a_leaver_that_dies_is_gone_never_restarted() -> None:
    run = ("construct_with_restarts", *_UP, "add_request_0", "scale_leave_0",
           "crash_silently_0", "process_exit_noticed_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["mem0"], v["gen0"], v["scale"]) == ("REMOVED", 0, "IDLE")
        assert v["creq0"] == "FINISHED_ERROR" and v["client"] == "RUNNING"


def test_a_dead_index_is_removed_at_once_and_the_client_dies_with_its_last_member() -> None:
    run = ("construct", *_UP, "crash_silently_0", "process_exit_noticed_0", "scale_leave_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["mem0"], v["mem1"], v["scale"], v["client"]) == (
            "REMOVED", "SERVING", "IDLE", "READY")
    for w in _follow(("construct", *_UP, "scale_leave_1", "crash_silently_0",
                      "process_exit_noticed_0")):
        assert _names(w)["client"] == "READY"  # the draining leaver still counts
    for w in _follow(("construct", *_UP, "scale_leave_1", "crash_silently_0",
                      "process_exit_noticed_0", "leaver_drained_1")):
        assert _names(w)["client"] == "DEAD"


def test_a_removed_index_joins_again_as_a_new_slot_serving_only_after_its_handshake() -> None:
    run = ("construct", *_UP, "scale_leave_0", "leaver_drained_0", "scale_join_0")
    for w in _follow(run):
        v = _names(w)
        assert (v["mem0"], v["gen0"], v["scale"]) == ("STARTING", 1, "SCALING")
        labels = _labels(w)
        assert "add_request_0" not in labels and "add_request_1" in labels
    for w in _follow((*run, "engine_start_0", "receive_output_0")):
        v = _names(w)
        assert (v["mem0"], v["scale"]) == ("SERVING", "IDLE")
        assert "add_request_0" in _labels(w)
    # a joiner that dies before its handshake, or misses its deadline, fails the scale
    for tail in (("crash_silently_0", "process_exit_noticed_0"), ("scale_join_times_out_0",)):
        for w in _follow((*run, *tail)):
            v = _names(w)
            assert (v["mem0"], v["scale"], v["mem1"]) == ("REMOVED", "IDLE", "SERVING"), tail


def test_one_scale_at_a_time_and_none_while_the_client_sleeps() -> None:
    for w in _follow(("construct", *_UP, "scale_leave_0")):
        assert not any(x.startswith(("scale_leave", "scale_join")) for x in _labels(w))
    for w in _follow(("construct", *_UP, "sleep", "engine_receive_0", "engine_receive_1",
                      "receive_output_0", "receive_output_1")):
        assert _names(w)["client"] == "SLEEPING"
        assert not any(x.startswith("scale_") for x in _labels(w))


def test_a_power_call_and_a_scale_refuse_each_other() -> None:
    for w in _follow(("construct", *_UP, "scale_leave_0")):
        assert "sleep" not in _labels(w) and "wake_up" not in _labels(w)
    for w in _follow(("construct", *_UP, "sleep")):
        assert _names(w)["scale"] == "POWERING"
        assert not any(x.startswith("scale_") for x in _labels(w))
    for w in _follow(("construct", *_UP, "sleep", "power_call_times_out")):
        assert _names(w)["scale"] == "IDLE"  # the call is over for its caller


def test_shutdown_ends_a_running_scale() -> None:
    for w in _follow(("construct", *_UP, "scale_leave_0", "shutdown")):
        v = _names(w)
        assert (v["mem0"], v["mem1"], v["scale"]) == ("SHUT_DOWN", "SHUT_DOWN", "IDLE")


# ---- SPIN ---------------------------------------------------------------------------------

@pytest.mark.slow
@needs_spin
def test_spin_proves_every_property_of_the_committed_model(composed_dp: ExploreResult) -> None:
    results = run_spin([p.name for p in DP_PROPERTIES], pml=DP_PML, dp=True)
    failed = [r for r in results if r.errors]
    assert not failed, "\n\n".join(f"{r.prop}:\n{r.output[-3000:]}" for r in failed)
    # the same model: the explorer's worlds, plus init's two table-filling states
    assert {r.states for r in results if r.prop == "dp_spec_conformance"} == {
        composed_dp.states + 2}


@pytest.mark.slow
@needs_spin
@pytest.mark.parametrize("bug", BUGS)
def test_spin_rejects_each_negative_control(bug: str) -> None:
    for r in run_spin(list(dp_control_targets()[bug]), bug, pml=DP_PML, jobs=1, dp=True):
        assert r.errors > 0, f"SPIN accepts {bug} for {r.prop}: the property is vacuous"
        assert f"SPIN trail for {r.prop}:" in r.output, r.output[-2000:]
