"""One declaration per utility (protocol/utilities.py) and everything derived from it."""

from __future__ import annotations

import inspect

from enginewire.protocol.utilities import BY_NAME, POWER_METHODS, REMOTE_METHODS, UTILITIES
from enginewire.runtime.async_mp_client import AsyncMPClient
from enginewire.runtime.client import InprocClient
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.sync_mp_client import SyncMPClient
from enginewire.spec.client import CLIENT


def test_names_are_unique_and_the_engine_serves_every_remote_one() -> None:
    assert len(BY_NAME) == len(UTILITIES)
    assert EngineCore.UTILITY_METHODS == REMOTE_METHODS
    for name in REMOTE_METHODS:
        assert callable(getattr(EngineCore, name, None)), f"EngineCore has no {name}()"


def test_every_client_has_each_wrapper_with_the_declared_parameters() -> None:
    for u in UTILITIES:
        declared = [p.name for p in u.params] + ["timeout"]
        for cls in (InprocClient, SyncMPClient):
            got = list(inspect.signature(getattr(cls, u.name)).parameters)[1:]
            assert got == declared, (cls.__name__, u.name, got)
        fn = getattr(AsyncMPClient, f"{u.name}_async")
        assert inspect.iscoroutinefunction(fn)
        assert list(inspect.signature(fn).parameters)[1:] == declared, u.name


def test_power_utilities_fire_events_the_client_machine_has() -> None:
    assert {"sleep", "pause_scheduler", "wake_up", "resume_scheduler"} == POWER_METHODS
    events = {t.event for t in CLIENT.transitions}
    for name in POWER_METHODS:
        power = BY_NAME[name].power
        assert power is not None and power.event in events
    # a wake-up's reply names the guard; a resume is always full
    assert BY_NAME["wake_up"].power.resolve(False)[1] == "partially_awake"  # type: ignore[union-attr]
    assert BY_NAME["resume_scheduler"].power.resolve(None)[1] == "fully_awake"  # type: ignore[union-attr]
