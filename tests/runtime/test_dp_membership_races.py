"""The data-parallel client where a death races the client's own paths (issue 44).

- A utility call whose engine dies and is being replaced between the pick and the send raises
  ``EngineDeadError`` naming the engine (not ``AttributeError`` on a member that holds no
  client), and its UTILITY lifecycle ends ENGINE_DIED; the same for a broadcast.
- A dead incarnation is forgotten once its batches are read: restarts do not accumulate
  clients; a replacement that dies at once is restarted after a growing backoff, and after
  ``restart_limit`` of them in a row its index stays DEAD, the others serving.
- A hung engine (SIGSTOP) declared dead by its heartbeat is killed before its replacement
  starts.
- The client's power state follows what its serving engines did: a sleep that timed out on a
  stopped engine which then slept anyway, or whose engine died during the call, leaves the
  client SLEEPING, and the next partial wake-up is legal.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from typing import Any

import pytest

from enginewire.runtime.faults import Fault
from enginewire.spec import (
    UTILITY,
    ClientState,
    EngineDeadError,
    MembershipState,
    UtilityTimeoutError,
)
from enginewire.testing._harness import wait_until
from enginewire.testing.conformance import stop_process

from .test_dp_client import BOUND_S, KINDS, Driver, _resource_tracker, open_dp, req

__all__ = ["_resource_tracker"]  # the module fixture, re-used


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers signal 0: read its state.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def _kill_and_await_restart_window(dp: Driver, index: int) -> None:
    """SIGKILL engine ``index`` and return once the client took it off (RESTARTING, no client
    held for it): the window in which a caller that picked it earlier still runs."""
    pid = dp.client.engine_client(index).engine_pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: dp.client.engine_client(index) is None, BOUND_S,
               f"engine {index} taken off after its death")


def _utility_records(trace: list[Any]) -> list[tuple[Any, ...]]:
    return [t for t in trace if t[0] == UTILITY.name]


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_whose_engine_dies_after_the_pick_names_it(kind: str) -> None:
    with open_dp(kind, restart_dead_engines=True) as dp:
        client = dp.client
        pick = client._utility_member

        def picked_then_killed() -> Any:
            got = pick()
            member = got[0] if isinstance(got, tuple) else got
            _kill_and_await_restart_window(dp, member.index)
            return got

        client._utility_member = picked_then_killed
        with pytest.raises(EngineDeadError, match=r"engine \d of 2"):
            dp("call_utility", "echo", 1)
        del client._utility_member
        # The client's own UTILITY lifecycle for that call ended with the death.
        events = [t[2] for t in _utility_records(dp.trace)]
        assert "ENGINE_DIED" in events, events[-6:]
        wait_until(lambda: all(s is MembershipState.SERVING for s in client.engines.values()),
                   BOUND_S, "the engine restarted")
        assert dp("call_utility", "echo", 2) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_broadcast_whose_engine_dies_after_the_pick_names_it(kind: str) -> None:
    with open_dp(kind, restart_dead_engines=True) as dp:
        client = dp.client
        targets = client._targets

        def picked_then_killed(method: str, args: Any) -> Any:
            got = targets(method, args)
            first = got[0]
            member = first[0] if isinstance(first, tuple) else first
            _kill_and_await_restart_window(dp, member.index)
            return got

        client._targets = picked_then_killed
        with pytest.raises(EngineDeadError, match="engine 0 of 2"):
            dp("call_utility_all", "echo", 1)
        del client._targets
        assert client.pending_utility_calls() == 0
        wait_until(lambda: all(s is MembershipState.SERVING for s in client.engines.values()),
                   BOUND_S, "the engine restarted")
        assert dp("call_utility_all", "echo", 3) == [3, 3]


@pytest.mark.parametrize("kind", KINDS)
def test_dead_incarnations_are_not_kept(kind: str) -> None:
    """Each kill/restart cycle leaves nothing of the dead incarnation once it is read."""
    with open_dp(kind, restart_dead_engines=True) as dp:
        client = dp.client
        dead: list[weakref.ref[Any]] = []
        for cycle in range(4):
            k = cycle % 2
            old = client.engine_client(k)
            dp("add_request", req(f"doomed-{cycle}", n=100_000, rank=k))
            dead.append(weakref.ref(old))
            pid = old.engine_pid
            del old
            os.kill(pid, signal.SIGKILL)
            dp.collect({f"doomed-{cycle}"})
            wait_until(lambda k=k, pid=pid: client.engines[k] is MembershipState.SERVING
                       and client.engine_client(k) is not None
                       and client.engine_client(k).engine_pid != pid, BOUND_S,
                       f"engine {k} restarted")
        # Reapers run in threads of their own: bounded wait for them to finish and let go.
        def forgotten() -> bool:
            gc.collect()
            return all(r() is None for r in dead)

        wait_until(forgotten, BOUND_S, "every dead incarnation forgotten")
        assert not any(m.retired for m in client._slots)


@pytest.mark.parametrize("kind", KINDS)
def test_a_crash_loop_backs_off_then_stays_dead(kind: str) -> None:
    # Every incarnation of engine 0 dies at its first step: a crash loop.
    fault = Fault(point="step", action="exit", at=1)
    with open_dp(kind, restart_dead_engines=True, restart_limit=2,
                 engine_fault={0: fault}) as dp:
        client = dp.client
        starts: list[float] = []
        deadline = time.monotonic() + BOUND_S * 2
        n = 0
        while "not restarted again" not in str(client._slots[0].cause):
            assert time.monotonic() < deadline, client.engines
            if client.engines[0] is MembershipState.SERVING and client.engine_client(0):
                c = client.engine_client(0)
                if not starts or starts[-1] != c.engine_pid:
                    starts.append(c.engine_pid)
                    n += 1
                    try:
                        dp("add_request", req(f"loop-{n}", n=8, rank=0))
                    except EngineDeadError:
                        pass
            dp("get_output", timeout=0.05)
        # The first incarnation and two replacements died at once; no third replacement.
        assert len(starts) == 3, starts
        assert client.engines == {0: MembershipState.DEAD, 1: MembershipState.SERVING}
        # Given up at the death itself: no restart is pending for index 0 (no backoff to sit
        # out), and the member stays DEAD.
        assert not [t for t in threading.enumerate()
                    if t.name == "EngineCoreRestart_0" and t.is_alive()]
        assert client.engines[0] is MembershipState.DEAD
        assert client.state is not ClientState.DEAD
        with pytest.raises(EngineDeadError, match="engine 0"):
            dp("add_request", req("pinned", rank=0))
        dp("add_request", req("elsewhere"))
        assert dp.collect({"elsewhere"})["elsewhere"][1] == 1
        assert "not restarted again" in str(client._slots[0].cause)


def test_restart_limit_is_checked() -> None:
    from enginewire.runtime import make_client
    from enginewire.runtime.config import EngineConfig

    cfg = EngineConfig(model="null", data_parallel_size=2)
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="restart_limit"):
            make_client(cfg, multiprocess=True, asyncio=False, restart_limit=bad)


@pytest.mark.parametrize("kind", KINDS)
def test_a_hung_engine_is_killed_before_its_replacement(kind: str) -> None:
    with open_dp(kind, restart_dead_engines=True, engine_heartbeat_timeout_s=1.0) as dp:
        client = dp.client
        pid = client.engine_client(1).engine_pid
        stop_process(pid)  # every thread stopped: nothing is answered after this
        try:
            wait_until(lambda: client.engine_client(1) is not None
                       and client.engine_client(1).engine_pid != pid
                       and client.engines[1] is MembershipState.SERVING, BOUND_S,
                       "engine 1 replaced")
            # Gone before the replacement served (killed by the restart, not the teardown).
            assert _pid_gone(pid)
        finally:
            if not _pid_gone(pid):
                os.kill(pid, signal.SIGKILL)


def _asleep_then_partial_then_full_wake(dp: Driver) -> None:
    """The client sleeps as its serving engines do; a partial wake-up (weights only) is legal
    and False, and leaves it asleep; a full one wakes it."""
    client = dp.client
    assert client.state is ClientState.SLEEPING
    assert dp("is_sleeping") is True
    assert dp("wake_up", ["weights"]) is False
    assert client.state is ClientState.SLEEPING
    assert dp("wake_up") is True
    assert client.state is not ClientState.SLEEPING
    assert dp("is_sleeping") is False


@pytest.mark.parametrize("kind", KINDS)
def test_a_sleep_that_timed_out_and_slept_late_leaves_the_client_asleep(kind: str) -> None:
    with open_dp(kind) as dp:
        client = dp.client
        pid = client.engine_client(1).engine_pid
        stop_process(pid)  # every thread stopped: nothing is answered after this
        try:
            with pytest.raises(UtilityTimeoutError):
                dp("sleep", 1, timeout=0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Engine 0 slept in time, engine 1 late: the client follows both.
        wait_until(lambda: client.engine_client(1).state is ClientState.SLEEPING, BOUND_S,
                   "engine 1's late sleep reply followed")
        _asleep_then_partial_then_full_wake(dp)


@pytest.mark.parametrize("kind", KINDS)
def test_a_sleep_that_lost_an_engine_leaves_the_client_asleep(kind: str) -> None:
    with open_dp(kind) as dp:
        client = dp.client
        pid = client.engine_client(1).engine_pid
        stop_process(pid)  # every thread stopped: nothing is answered after this
        killer = threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL))
        killer.start()
        try:
            with pytest.raises(EngineDeadError, match="engine 1 of 2"):
                dp("sleep", 1, timeout=BOUND_S)
        finally:
            killer.join()
        wait_until(lambda: client.engines[1] is MembershipState.DEAD, BOUND_S, "engine 1 dead")
        _asleep_then_partial_then_full_wake(dp)  # engine 0, the one serving, sleeps


@pytest.mark.parametrize("kind", KINDS)
def test_losing_the_only_sleeping_engine_wakes_the_client(kind: str) -> None:
    """The client claims no state its serving engines are not in: once the only engine
    asleep is gone and its replacement (awake) serves, the client is awake."""
    with open_dp(kind, restart_dead_engines=True) as dp:
        client = dp.client
        dp("sleep", 0)
        assert client.state is ClientState.SLEEPING
        for k in (0, 1):
            pid = client.engine_client(k).engine_pid
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda k=k, pid=pid: client.engines[k] is MembershipState.SERVING
                       and client.engine_client(k) is not None
                       and client.engine_client(k).engine_pid != pid, BOUND_S,
                       f"engine {k} restarted")
        assert client.state is not ClientState.SLEEPING
        assert dp("is_sleeping") is False
        dp("add_request", req("after"))
        assert dp.collect({"after"})
