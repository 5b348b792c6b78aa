"""The membership machine (spec/membership.py): its names are what the runtime reads, its
named sets are what both model checkers read, and it is one of ``MACHINES``."""

from __future__ import annotations

import re

import pytest

from enginewire.spec import (
    MACHINES,
    MEMBERSHIP,
    MembershipEvent,
    MembershipState,
    compose,
    compose_dp,
)
from enginewire.spec.client import CLIENT_ASLEEP
from enginewire.spec.errors import SpecViolation
from enginewire.spec.membership import (
    LAST_POWER_CALL,
    MEMBER_DOWN,
    MEMBER_IN_SET,
    MEMBER_LEFT,
    MEMBER_ROUTABLE,
    OTHER_POWER_CALLS,
    SCALE,
    SCALE_REFUSED,
    ScaleEvent,
    ScaleState,
)
from enginewire.spec.promela_dp import render_promela_dp

S, E = MembershipState, MembershipEvent


def test_membership_is_a_machine_of_the_spec_with_the_names_the_runtime_uses() -> None:
    assert MEMBERSHIP in MACHINES
    assert [s.name for s in S] == [
        "STARTING", "SERVING", "DRAINING", "DEAD", "RESTARTING", "REMOVED", "SHUT_DOWN"]
    assert [e.name for e in E] == [
        "HANDSHAKE_OK", "DIED", "RESTART", "LEAVE", "DRAINED", "REMOVE", "SHUTDOWN"]
    assert MEMBER_ROUTABLE == {S.SERVING}
    assert MEMBER_LEFT == {S.STARTING, S.SERVING, S.DRAINING, S.RESTARTING}
    assert MEMBER_DOWN == {S.DEAD, S.RESTARTING}
    assert MEMBER_IN_SET == {S.STARTING, S.SERVING, S.DEAD, S.RESTARTING}
    assert MEMBER_ROUTABLE <= MEMBER_IN_SET and MEMBER_DOWN <= MEMBER_IN_SET
    assert MEMBER_ROUTABLE <= MEMBER_LEFT and S.DRAINING not in MEMBER_IN_SET
    assert MEMBERSHIP.terminal == {S.SHUT_DOWN, S.REMOVED}
    assert [s.name for s in ScaleState] == ["IDLE", "SCALING", "POWERING"]
    assert [e.name for e in ScaleEvent] == ["BEGIN", "END", "POWER_BEGIN", "POWER_END"]
    assert SCALE in MACHINES and SCALE_REFUSED == CLIENT_ASLEEP


def test_every_machine_is_covered_by_exactly_one_composed_model() -> None:
    covers = [m.name for m in (*compose.COVERS, *compose_dp.COVERS)]
    assert sorted(covers) == sorted(m.name for m in MACHINES)


def test_a_death_is_sticky_until_a_restart_and_shutdown_ends_every_state() -> None:
    lc = MEMBERSHIP.lifecycle()
    lc.fire(E.HANDSHAKE_OK)
    lc.fire(E.DIED)
    assert lc.state is S.DEAD and not lc.can(E.HANDSHAKE_OK)
    lc.fire(E.DIED)  # a second notice loops
    lc.fire(E.RESTART)
    assert lc.state is S.RESTARTING and not lc.can(E.RESTART)
    lc.fire(E.HANDSHAKE_OK)
    assert lc.state is S.SERVING
    for state in S:
        assert (state, E.SHUTDOWN, None) in MEMBERSHIP.table()


def test_a_leaver_drains_to_removed_and_removed_is_final() -> None:
    lc = MEMBERSHIP.lifecycle()
    lc.fire(E.HANDSHAKE_OK)
    lc.fire(E.LEAVE)
    assert lc.state is S.DRAINING and lc.state not in MEMBER_ROUTABLE
    assert not lc.can(E.RESTART) and not lc.can(E.HANDSHAKE_OK)
    lc.fire(E.DRAINED)
    assert lc.state is S.REMOVED and lc.state not in MEMBER_LEFT
    for event in E:  # only the expected exit and a shutdown reach a removed slot: both loop
        assert lc.can(event) == (event in (E.DIED, E.SHUTDOWN))
    # a dead leaver is gone, never restarted; a dead or restarting index goes at once
    for path in ((E.HANDSHAKE_OK, E.LEAVE, E.DIED), (E.HANDSHAKE_OK, E.DIED, E.REMOVE),
                 (E.HANDSHAKE_OK, E.DIED, E.RESTART, E.REMOVE), (E.REMOVE,)):
        lc = MEMBERSHIP.lifecycle()
        for event in path:
            lc.fire(event)
        assert lc.state is S.REMOVED, path


def test_one_scale_at_a_time() -> None:
    lc = SCALE.lifecycle()
    lc.fire(ScaleEvent.BEGIN)
    assert not lc.can(ScaleEvent.BEGIN)
    lc.fire(ScaleEvent.END)
    assert lc.state is ScaleState.IDLE and not lc.can(ScaleEvent.END)


def test_a_power_call_and_a_scale_refuse_each_other_and_power_calls_overlap() -> None:
    lc = SCALE.lifecycle()
    lc.fire(ScaleEvent.BEGIN)
    assert not lc.can(ScaleEvent.POWER_BEGIN)
    with pytest.raises(SpecViolation):
        lc.fire(ScaleEvent.POWER_BEGIN)
    assert lc.state is ScaleState.SCALING  # the refused event changed nothing
    lc.fire(ScaleEvent.END)
    lc.fire(ScaleEvent.POWER_BEGIN)
    lc.fire(ScaleEvent.POWER_BEGIN)  # another thread's
    assert not lc.can(ScaleEvent.BEGIN)
    lc.fire(ScaleEvent.POWER_END, OTHER_POWER_CALLS)
    assert lc.state is ScaleState.POWERING and not lc.can(ScaleEvent.BEGIN)
    lc.fire(ScaleEvent.POWER_END, LAST_POWER_CALL)
    assert lc.state is ScaleState.IDLE and lc.can(ScaleEvent.BEGIN)


def test_the_promela_sets_are_generated_from_the_named_sets() -> None:
    pml = render_promela_dp()
    for name, states in (("member_left", MEMBER_LEFT), ("member_routable", MEMBER_ROUTABLE),
                         ("member_in_set", MEMBER_IN_SET)):
        line = next(x for x in pml.splitlines() if x.startswith(f"#define {name}(x)"))
        ixs = {int(i) for i in re.findall(r"mem\[x\] == (\d+)", line)}
        assert ixs == {list(S).index(s) for s in states}, line
