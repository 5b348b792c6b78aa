"""The membership machine (spec/membership.py): its names are what the runtime reads, its
named sets are what both model checkers read, and it is one of ``MACHINES``."""

from __future__ import annotations

import re

from enginewire.spec import (
    MACHINES,
    MEMBERSHIP,
    MembershipEvent,
    MembershipState,
    compose,
    compose_dp,
)
from enginewire.spec.membership import MEMBER_LEFT, MEMBER_ROUTABLE
from enginewire.spec.promela_dp import render_promela_dp

S, E = MembershipState, MembershipEvent


def test_membership_is_a_machine_of_the_spec_with_the_names_the_runtime_uses() -> None:
    assert MEMBERSHIP in MACHINES
    assert [s.name for s in S] == ["STARTING", "SERVING", "DEAD", "RESTARTING", "SHUT_DOWN"]
    assert [e.name for e in E] == ["HANDSHAKE_OK", "DIED", "RESTART", "SHUTDOWN"]
    assert MEMBER_ROUTABLE == {S.SERVING}
    assert MEMBER_LEFT == {S.STARTING, S.SERVING, S.RESTARTING}
    assert MEMBER_ROUTABLE <= MEMBER_LEFT and MEMBERSHIP.terminal == {S.SHUT_DOWN}


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


def test_the_promela_sets_are_generated_from_the_named_sets() -> None:
    pml = render_promela_dp()
    for name, states in (("member_left", MEMBER_LEFT), ("member_routable", MEMBER_ROUTABLE)):
        line = next(x for x in pml.splitlines() if x.startswith(f"#define {name}(x)"))
        ixs = {int(i) for i in re.findall(r"mem\[x\] == (\d+)", line)}
        assert ixs == {list(S).index(s) for s in states}, line
