"""One declaration per utility (protocol/utilities.py) and everything derived from it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from enginewire.protocol.utilities import (
    BY_NAME,
    POWER_METHODS,
    REMOTE_METHODS,
    UTILITIES,
    Param,
    Utility,
    _declaration_errors,
    check_sleep_args,
    optional_str,
)
from enginewire.runtime._utilities import SyncUtilityMethods
from enginewire.runtime.async_mp_client import AsyncMPClient
from enginewire.runtime.client import InprocClient
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.sync_mp_client import SyncMPClient
from enginewire.spec.client import CLIENT, SLEPT


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


def test_a_declaration_holds_functions_and_types_never_source_text() -> None:
    """What a wrapper does beyond sending its parameters is a function or a type of the
    declaration; the only text is the ``def`` line's (annotations, literal defaults)."""
    for u in UTILITIES:
        for fn in (u.check, u.wire, u.convert):
            assert fn is None or callable(fn), (u.name, fn)
        for p in u.params:
            if p.default is not None:
                ast.literal_eval(p.default)  # a literal, nothing that computes


def test_a_declaration_mistake_is_a_sentence_that_names_the_fix() -> None:
    def sleep_args(level: int) -> None:
        pass

    bad = Utility("x", (Param("level", "int"), Param("mode", "str")), "None", "doc",
                  wire=lambda level, mode: (level, mode), check=sleep_args, convert=bool,
                  power=SLEPT)
    errors = _declaration_errors(bad)
    assert any("power utility must apply to every engine" in e for e in errors), errors
    assert any("returns None converts nothing" in e for e in errors), errors
    assert any(e.startswith("wire=") and "module-level function" in e for e in errors), errors
    assert any(e.startswith("check=") and "module-level function" in e for e in errors), errors
    nested = Utility("x", (Param("mode", "str"),), "None", "doc", check=check_sleep_args)
    assert _declaration_errors(nested) == [
        "check check_sleep_args('level', 'mode') must take the wrapper's parameters"
        " ('mode',), in order"]
    untyped = Utility("x", (Param("tags", "list[str] | None"),), "bool", "doc",
                      wire=_untyped_wire, every_engine="all")
    assert _declaration_errors(untyped) == [
        "wire _untyped_wire must be annotated to return a tuple of a fixed length, such as"
        " -> tuple[str, str | None]"]
    assert all(_declaration_errors(u) == [] for u in UTILITIES)


def _untyped_wire(tags: Any) -> tuple[Any, ...]:
    return (tags,)


class _Recorder(SyncUtilityMethods):
    """The generated sync wrappers over a ``call_utility`` that records what is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        self.sent.append((method, *args))
        return "r"


def test_each_generated_wrapper_sends_what_its_declaration_says() -> None:
    calls = {
        "echo": ((1,), ("echo", 1)),
        "collective_rpc": (("m", (1,), None), ("collective_rpc", "m", [1], {})),
        "profile": ((False, Path("/tmp/t")), ("profile", "stop", "/tmp/t")),
        "save_sharded_state": (("/d",), ("save_sharded_state", "/d")),
        "pause_scheduler": (("keep",), ("pause_scheduler", "keep")),
        "sleep": ((2, "wait"), ("sleep", 2, "wait")),
        "wake_up": ((("weights",),), ("wake_up", ["weights"])),
    }
    for u in UTILITIES:
        args, sent = calls.get(u.name, ((), (u.name,)))
        rec = _Recorder()
        got = getattr(rec, u.name)(*args)
        assert rec.sent == [sent], u.name
        # the reply "r", as each declaration converts it
        want = {bool: True, list: ["r"], optional_str: "r", None: "r"}[u.convert]
        assert got == (None if u.returns == "None" else want), u.name
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2, got True"):
        _Recorder().sleep(True)
    with pytest.raises(TypeError, match="wake_up tags must be a list"):
        _Recorder().wake_up("weights")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"profile\(is_start\) must be True or False"):
        _Recorder().profile("stop")  # type: ignore[arg-type]
