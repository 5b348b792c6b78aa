"""The error -> UTILITY event map (spec/utility.py ``outcome_of``), declared once for every
client: the closed family by kind (a timeout before the UtilityError it is), a cancellation
or interrupt is the caller's CANCEL, anything else ends nothing; every event it names has a
row from PENDING."""

from __future__ import annotations

import asyncio

from enginewire.spec import UTILITY, UtilityEvent, UtilityState
from enginewire.spec.errors import (
    ClientClosedError,
    EngineDeadError,
    UtilityError,
    UtilityTimeoutError,
)
from enginewire.spec.utility import outcome_of


def test_each_error_names_its_event() -> None:
    assert outcome_of(UtilityTimeoutError("echo", 0.5)) is UtilityEvent.TIMEOUT
    assert outcome_of(UtilityError("echo", "boom")) is UtilityEvent.REPLY_ERROR
    assert outcome_of(EngineDeadError("gone")) is UtilityEvent.ENGINE_DIED
    assert outcome_of(ClientClosedError("closed")) is UtilityEvent.CLIENT_SHUTDOWN
    assert outcome_of(asyncio.CancelledError()) is UtilityEvent.CANCEL
    assert outcome_of(KeyboardInterrupt()) is UtilityEvent.CANCEL
    assert outcome_of(ValueError("bad argument")) is None
    assert outcome_of(TypeError("bad argument")) is None


def test_every_named_event_ends_a_pending_call() -> None:
    errors = (UtilityTimeoutError("m", 0.5), UtilityError("m", "x"), EngineDeadError(),
              ClientClosedError(), asyncio.CancelledError())
    for err in errors:
        event = outcome_of(err)
        assert event is not None
        lc = UTILITY.lifecycle()
        assert lc.state is UtilityState.PENDING and lc.can(event), (err, event)
