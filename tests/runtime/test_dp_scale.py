"""Elastic data parallel (issue 46): ``scale(n)`` / ``scale_async(n)`` grow and shrink a
serving data-parallel client's set of engines while requests flow, on the sync and the async
client: joiners serve only once all are up, a failed joiner undoes the scale, leavers take
no new work, drain (or not) and end what is left ABORT with a stop reason naming the
removal, an index that rejoins is a new engine, one scale at a time, none while asleep."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from enginewire.protocol.messages import FinishReason
from enginewire.runtime.faults import Fault
from enginewire.spec import EngineDeadError, EngineStartupError, MembershipState, SpecViolation
from enginewire.spec.membership import SCALE
from enginewire.testing._harness import wait_until
from tests.runtime.test_dp_client import BOUND_S, KINDS, Driver, open_dp, req
from tests.runtime.test_ray_backend import gone

SERVING = MembershipState.SERVING


def _alive(pid: int | None) -> bool:
    # Gone (or a zombie) within a moment: scale() returned after the process went.
    return pid is not None and not gone(pid, 0.5)


def _ends(d: Driver, rids: set[str], bound: float = BOUND_S) -> dict[str, Any]:
    """Each id's finishing output (exactly one each: a second is a failure)."""
    ends: dict[str, Any] = {}
    deadline = time.monotonic() + bound
    while set(ends) < rids:
        assert time.monotonic() < deadline, f"unfinished: {rids - set(ends)}"
        out = d("get_output", timeout=0.5)
        for o in out.outputs:
            if o.finish_reason is not None:
                assert o.request_id not in ends, f"{o.request_id} finished twice"
                ends[o.request_id] = (o, out.engine_index)
    return ends


@pytest.mark.parametrize("kind", KINDS)
def test_scale_up_then_down_while_requests_flow(kind: str) -> None:
    with open_dp(kind) as d:
        c = d.client
        for i in range(4):
            d("add_request", req(f"a{i}", n=30))
        d("scale", 3)
        assert c.engines == {0: SERVING, 1: SERVING, 2: SERVING}
        assert c.data_parallel_size == 3 and c.dead_engines == []
        assert d("call_utility_all", "echo", 7) == [7, 7, 7]
        d("add_request", req("on2", n=3, rank=2))  # the joiner takes work
        ends = _ends(d, {f"a{i}" for i in range(4)} | {"on2"})
        assert ends["on2"][1] == 2 and ends["on2"][0].finish_reason is FinishReason.LENGTH
        assert all(o.finish_reason is FinishReason.LENGTH for o, _ in ends.values())
        reports = c.engine_reports()
        assert [(r.index, r.state, r.restarts, r.cause) for r in reports] == [
            (0, SERVING, 0, None), (1, SERVING, 0, None), (2, SERVING, 0, None)]
        assert [r.pid for r in reports] == c.engine_pids and all(
            r.in_flight == 0 for r in reports)
        pid = c.engine_pids[2]
        for i in range(6):
            d("add_request", req(f"b{i}", n=20))
        d("scale", 2)  # drains engine 2: its requests finish normally
        assert c.engines == {0: SERVING, 1: SERVING} and c.data_parallel_size == 2
        assert [r.index for r in c.engine_reports()] == [0, 1]
        assert not _alive(pid), "the leaver's process outlived scale()"
        ends = _ends(d, {f"b{i}" for i in range(6)})
        assert all(o.finish_reason is FinishReason.LENGTH for o, _ in ends.values()), ends
        assert d("call_utility_all", "echo", 1) == [1, 1]
        with pytest.raises(EngineDeadError, match="engine 2"):
            d("add_request", req("to2", rank=2))  # a removed index takes nothing
        assert c.live_requests() == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_drain_that_runs_out_ends_the_rest_aborted_naming_the_removal(kind: str) -> None:
    with open_dp(kind) as d:
        c = d.client
        for i in range(2):
            d("add_request", req(f"long{i}", n=100_000, rank=1))
        d("add_request", req("short", n=3, rank=0))
        t0 = time.monotonic()
        d("scale", 1, drain_timeout_s=0.3)
        took = time.monotonic() - t0
        assert 0.3 <= took < 0.3 + 10, took
        assert c.engines == {0: SERVING}
        ends = _ends(d, {"long0", "long1", "short"})
        for rid in ("long0", "long1"):
            out, engine = ends[rid]
            assert out.finish_reason is FinishReason.ABORT and engine == 1
            assert "removed" in str(out.stop_reason), out
        assert ends["short"][0].finish_reason is FinishReason.LENGTH
        assert c.live_requests() == []


@pytest.mark.parametrize("kind", KINDS)
def test_without_drain_everything_live_ends_at_once_and_the_index_rejoins_as_new(
        kind: str) -> None:
    with open_dp(kind) as d:
        c = d.client
        d("add_request", req("x", n=100_000, rank=1))
        old = c.engine_client(1)
        old_pid, old_channel = old.engine_pid, (old.input_address, old.output_address)
        t0 = time.monotonic()
        d("scale", 1, drain=False)
        assert time.monotonic() - t0 < 10
        ends = _ends(d, {"x"})
        assert ends["x"][0].finish_reason is FinishReason.ABORT
        assert not _alive(old_pid)
        d("scale", 2)  # index 1 again: a new engine on a channel of its own
        new = c.engine_client(1)
        assert new is not old and new.engine_pid != old_pid
        assert (new.input_address, new.output_address) != old_channel
        assert old.is_closed or old.is_dead
        d("add_request", req("y", n=3, rank=1))
        assert _ends(d, {"y"})["y"][0].finish_reason is FinishReason.LENGTH
        assert c.engines == {0: SERVING, 1: SERVING}


@pytest.mark.parametrize("kind", KINDS)
def test_remove_picks_the_leavers_and_bad_arguments_change_nothing(kind: str) -> None:
    with open_dp(kind) as d:
        c = d.client
        for bad, match in (({"n": 0}, "n=0"), ({"n": True}, "n=True"),
                           ({"n": 1, "remove": [5]}, "not engines"),
                           ({"n": 1, "remove": [0, 1]}, "leaves 0"),
                           ({"n": 1, "remove": [0, 0]}, "distinct"),
                           ({"n": 1, "drain_timeout_s": -1}, "drain_timeout_s"),
                           ({"n": 1, "drain": "yes"}, "drain")):
            n = bad.pop("n")
            with pytest.raises((ValueError, TypeError), match=match):
                d("scale", n, **bad)
            assert c.engines == {0: SERVING, 1: SERVING}
        d("scale", 1, remove=[0])
        assert c.engines == {1: SERVING} and c.data_parallel_size == 1
        d("add_request", req("r", n=3))
        assert _ends(d, {"r"})["r"][1] == 1
        d("scale", 2)  # the free index 0 joins again
        assert c.engines == {0: SERVING, 1: SERVING}


@pytest.mark.parametrize("kind", KINDS)
def test_a_joiner_that_fails_to_start_undoes_the_scale(kind: str) -> None:
    # A fault for index 2 only: the engine a scale adds there.
    with open_dp(kind, engine_fault={2: Fault(point="before_ready", action="exit")}) as d:
        c = d.client
        pids = c.engine_pids
        with pytest.raises(EngineStartupError, match="engine 2 failed to join"):
            d("scale", 3)
        assert c.engines == {0: SERVING, 1: SERVING} and c.data_parallel_size == 2
        assert c.engine_pids == pids
        assert d("call_utility_all", "echo", 2) == [2, 2]
        d("scale", 1)  # and later scales work
        d("scale", 2)
        assert c.data_parallel_size == 2


@pytest.mark.parametrize("kind", KINDS)
def test_one_scale_at_a_time_and_none_while_asleep(kind: str) -> None:
    with open_dp(kind, engine_fault={2: Fault(point="before_ready", action="delay",
                                              arg=1.5)}) as d:
        c = d.client
        errors: list[BaseException] = []

        def slow() -> None:
            try:
                d("scale", 3)
            except BaseException as e:  # reported below
                errors.append(e)

        t = threading.Thread(target=slow)
        t.start()
        deadline = time.monotonic() + BOUND_S
        while c.data_parallel_size < 3:  # the joiner's slot is in the set while it starts
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(SpecViolation, match="another scale"):
            d("scale", 2)
        for power in (("sleep", 1), ("wake_up",), ("pause_scheduler",)):
            with pytest.raises(SpecViolation, match="a scale of this client is running") as info:
                d(*power)  # the joiner would miss it: refused, nothing sent
            assert info.value.machine == SCALE.name
        t.join(BOUND_S)
        assert not errors and c.engines[2] is SERVING
        assert d("call_utility_all", "is_sleeping") == [False] * 3
        d("sleep", 1)
        with pytest.raises(SpecViolation, match="sleeping: wake it up first") as info:
            d("scale", 2)
        assert info.value.machine == SCALE.name
        d("wake_up")
        d("scale", 2)
        assert c.data_parallel_size == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_running_power_call_refuses_a_scale_and_the_last_of_overlapping_ones_releases_it(
        kind: str) -> None:
    """SCALE's POWERING: no scale begins until the last power call returned."""
    with open_dp(kind, engine_fault={0: Fault(point="utility", method="sleep",
                                              action="delay", arg=2.0)}) as d:
        c = d.client
        errors: list[BaseException] = []

        def power(*args: object) -> None:
            try:
                d(*args)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=power, args=("sleep", 1)),
                   threading.Thread(target=power, args=("sleep", 1))]
        threads[0].start()
        wait_until(lambda: c._power_calls == 1, BOUND_S, "the first sleep running")
        threads[1].start()  # overlaps the first (held 2 s at engine 0)
        wait_until(lambda: c._power_calls == 2, BOUND_S, "both sleeps running")
        with pytest.raises(SpecViolation, match=r"a power call .* is running") as info:
            d("scale", 3)
        assert info.value.machine == SCALE.name and c.data_parallel_size == 2
        for t in threads:
            t.join(BOUND_S)
        assert not errors
        d("wake_up")
        # Overlapping power calls: the scale waits for the last one (the runtime's count and
        # the table's POWER_END guards), held open here without an engine's timing.
        with c._power_window("sleep"):
            with c._power_window("wake_up"):
                with pytest.raises(SpecViolation, match=r"a power call .* is running"):
                    d("scale", 3)
            with pytest.raises(SpecViolation, match=r"a power call .* is running"):
                d("scale", 3)  # the other still runs
        d("scale", 3)  # both returned: scales again
        assert c.data_parallel_size == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_pending_on_a_leaver_fails_naming_it(kind: str) -> None:
    with open_dp(kind, engine_fault={1: Fault(point="utility", method="echo",
                                              action="delay", arg=5.0)}) as d:
        c = d.client
        got: list[BaseException] = []

        def call() -> None:
            try:
                d("call_utility_all", "echo", 1)
            except BaseException as e:  # reported below
                got.append(e)

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + BOUND_S
        while c.pending_utility_calls() < 1:  # engine 0 answers at once; 1 waits
            assert time.monotonic() < deadline
            time.sleep(0.01)
        d("scale", 1, drain=False)
        t.join(BOUND_S)
        assert got and isinstance(got[0], EngineDeadError), got
        assert "engine 1" in str(got[0])


@pytest.mark.parametrize("kind", KINDS)
def test_generate_scales_mid_stream(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    from enginewire.cli import main

    rc = main(["generate", "--model", "null", "--prompt-tokens", "1,2,3", "--client", kind,
               "--engines", "2", "--scale-to", "3", "--after-tokens", "4", "--max-tokens", "12"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "[scaled to 3 engines in" in err and "[0, 1, 2]" in err
    assert "12 tokens, finish=length" in err


@pytest.mark.parametrize(("argv", "says"), [
    (["--scale-to", "3"], "go together"),
    (["--after-tokens", "3"], "go together"),
    (["--scale-to", "3", "--after-tokens", "3"], "--engines 2 or more"),
])
def test_generate_scale_flags_are_checked(argv: list[str], says: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from enginewire.cli import main

    assert main(["generate", "--model", "null", *argv]) == 2
    assert says in capsys.readouterr().err
