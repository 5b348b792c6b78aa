"""The engine gate's protocol (runtime/_engine_shared.py, ``EngineGate``), in memory: another
thread runs the engine only while the loop is parked, nothing is queued and the engine is in
the loop's states; a loop woken meanwhile waits for it; a refusal runs nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from enginewire.runtime._engine_shared import Control, EngineGate, InputQueue
from enginewire.spec.engine import IN_LOOP, EngineState
from enginewire.testing._harness import wait_until

BOUND_S = 30.0


class _Loop:
    """The engine's lifecycle as the gate reads it."""

    def __init__(self, state: EngineState = EngineState.IDLE) -> None:
        self.state = state


class _HeldQueue(InputQueue):
    """An input queue whose parked ``wait`` waits for ``release`` (then yields ``item``),
    and whose settledness a test sets: the loop stays parked whatever the queue holds."""

    def __init__(self) -> None:
        super().__init__()
        self.is_empty = True
        self.release = threading.Event()
        self.item: Any = (Control.WAKE, None)

    def settled(self) -> bool:
        return self.is_empty and super().settled()

    def wait(self, timeout: float) -> Any:
        if not self.release.wait(timeout):
            return None
        return self.item


class _Parked:
    """A busy loop parked on the gate, on a thread of its own."""

    def __init__(self, gate: EngineGate) -> None:
        self.got: list[Any] = []
        self.thread = threading.Thread(target=lambda: self.got.append(gate.park(BOUND_S)),
                                       daemon=True)
        self.thread.start()


def _parked_gate(state: EngineState = EngineState.IDLE
                 ) -> tuple[EngineGate, _HeldQueue, _Loop, _Parked]:
    q, loop = _HeldQueue(), _Loop(state)
    gate = EngineGate(q, loop)  # type: ignore[arg-type]
    return gate, q, loop, _Parked(gate)


def _runs(gate: EngineGate) -> bool:
    """Whether ``try_run_parked`` ran its function (and said so)."""
    ran: list[int] = []
    said = gate.try_run_parked(ran.append, 1)
    assert said is bool(ran), "the gate's answer and what it ran disagree"
    return said


def _until_runs(gate: EngineGate) -> None:
    # The parked thread opens the gate as it starts its wait.
    wait_until(lambda: _runs(gate), BOUND_S, "the parked loop opened the gate")


@pytest.fixture
def parked() -> Iterator[tuple[EngineGate, _HeldQueue, _Loop, _Parked]]:
    gate, q, loop, p = _parked_gate()
    _until_runs(gate)
    yield gate, q, loop, p
    q.release.set()
    p.thread.join(BOUND_S)
    assert not p.thread.is_alive()


def test_a_new_gate_is_the_loops_until_it_parks() -> None:
    gate = EngineGate(InputQueue(), _Loop())  # type: ignore[arg-type]
    assert not _runs(gate)


def test_a_parked_loop_lets_another_thread_drive(parked: Any) -> None:
    gate, _q, _loop, p = parked
    on: list[str] = []
    assert gate.try_run_parked(lambda name: on.append(threading.current_thread().name), "x")
    assert on == [threading.current_thread().name]  # on the caller's thread, not the loop's
    assert p.thread.is_alive()  # the loop is still parked


def test_not_while_anything_is_queued_for_the_loop(parked: Any) -> None:
    gate, q, _loop, _p = parked
    q.is_empty = False
    assert not gate.may_run_parked() and not _runs(gate)
    q.is_empty = True
    assert _runs(gate)


@pytest.mark.parametrize("state", sorted(set(EngineState) - IN_LOOP, key=lambda s: s.value))
def test_not_outside_the_loops_states(parked: Any, state: EngineState) -> None:
    gate, _q, loop, _p = parked
    loop.state = state
    assert not _runs(gate)
    loop.state = EngineState.PAUSED  # in the loop, though nothing is scheduled
    assert _runs(gate)


def test_a_loop_woken_meanwhile_waits_until_the_run_ends(parked: Any) -> None:
    gate, q, _loop, p = parked
    order: list[str] = []

    def fn(_: object) -> None:
        order.append("run")
        q.release.set()  # the loop's item arrives while the run holds the gate
        p.thread.join(0.05)
        assert p.thread.is_alive(), "the loop went on while another thread drove the engine"
        order.append("run done")

    assert gate.try_run_parked(fn, None)
    p.thread.join(BOUND_S)
    assert not p.thread.is_alive() and p.got == [q.item]
    assert order == ["run", "run done"]
    assert not _runs(gate)  # the loop holds the gate again


def test_a_run_that_raises_leaves_the_gate_as_it_found_it(parked: Any) -> None:
    gate, _q, _loop, _p = parked

    def fails(_: object) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        gate.try_run_parked(fails, None)
    assert _runs(gate)


def test_a_loop_that_parks_and_times_out_holds_the_gate_again() -> None:
    gate = EngineGate(InputQueue(), _Loop())  # type: ignore[arg-type]
    assert gate.park(0.01) is None
    assert not _runs(gate)


def test_an_item_the_parked_loop_took_but_holds_no_gate_for_yet_is_not_overtaken() -> None:
    """The window between the parked loop's wait returning an item and its taking the gate
    back: the queue is empty, yet a call run past the gate would overtake that item."""
    taken, go_on = threading.Event(), threading.Event()

    class _Slow(InputQueue):
        def wait(self, timeout: float) -> Any:
            item = super().wait(timeout)
            taken.set()
            go_on.wait(BOUND_S)  # the loop is descheduled before it takes the gate back
            return item

    q = _Slow()
    gate = EngineGate(q, _Loop())  # type: ignore[arg-type]
    p = _Parked(gate)
    _until_runs(gate)
    q.put((Control.WAKE, None))  # the front end's item, queued for the loop
    assert taken.wait(BOUND_S) and q.empty()
    assert not gate.may_run_parked() and not _runs(gate), "a call overtook the loop's item"
    go_on.set()
    p.thread.join(BOUND_S)
    assert p.got == [(Control.WAKE, None)]
    assert q.settled()
    assert not _runs(gate)  # the loop holds the gate again (it is not parked here)
