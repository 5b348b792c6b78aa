"""Rule 1 of every machine: runtime code never assigns a state; ``fire`` alone moves it."""

from __future__ import annotations

from typing import Any

import pytest

from enginewire.spec import (
    CLIENT,
    CLIENT_REQUEST,
    MACHINES,
    ClientEvent,
    ClientRequestEvent,
    ClientRequestState,
    ClientState,
    Lifecycle,
    Machine,
)


@pytest.mark.parametrize("mach", MACHINES, ids=lambda m: m.name)
def test_assigning_a_state_raises_and_changes_nothing(mach: Machine[Any, Any]) -> None:
    lc = mach.lifecycle()
    before = lc.state
    for target in type(before):
        with pytest.raises(AttributeError):
            lc.state = target  # type: ignore[misc]
        with pytest.raises(AttributeError):
            setattr(lc, "state", target)  # noqa: B010 - the spelling a helper would use
        assert lc.state is before
    with pytest.raises(AttributeError):
        del lc.state  # type: ignore[misc]
    assert lc.state is before


def test_a_fired_lifecycle_still_refuses_assignment() -> None:
    lc = CLIENT_REQUEST.lifecycle()
    lc.fire(ClientRequestEvent.SEND)
    with pytest.raises(AttributeError):
        lc.state = ClientRequestState.FINISHED_STOPPED  # type: ignore[misc]
    assert lc.state is ClientRequestState.SENT
    assert lc.fire(ClientRequestEvent.OUTPUT) is lc.state is ClientRequestState.STREAMING


def test_no_new_attribute_can_shadow_the_state() -> None:
    lc = CLIENT.lifecycle()
    with pytest.raises(AttributeError):
        lc.State = ClientState.DEAD  # type: ignore[attr-defined]
    assert lc.state is ClientState.CONSTRUCTING
    assert lc.fire(ClientEvent.HANDSHAKE_OK) is lc.state


def test_a_lifecycle_is_constructed_in_a_given_state() -> None:
    # What a test that needs an instance in some state does instead of assigning one.
    lc = Lifecycle(CLIENT.name, ClientState.SLEEPING, CLIENT.compiled())
    assert lc.state is ClientState.SLEEPING
    assert "SLEEPING" in repr(lc)
