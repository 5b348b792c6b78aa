"""runtime/options.py: the subprocess clients' options as one typed object, checked once."""

from __future__ import annotations

import dataclasses

import psutil
import pytest

from enginewire.runtime import ClientOptions, make_client
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.faults import FaultPlan

NULL = EngineConfig(model="null")


def test_an_options_object_and_keywords_are_one_surface() -> None:
    opts = ClientOptions(shutdown_timeout_s=3, engine_heartbeat_timeout_s=5,
                         engine_fault="forward:1000")
    # Normalised once: seconds as floats, the fault spec parsed.
    assert opts.shutdown_timeout_s == 3.0 and isinstance(opts.engine_fault, FaultPlan)
    assert opts.ready_timeout > 0
    with make_client(NULL, multiprocess=True, asyncio=False, options=opts,
                     shutdown_timeout_s=2) as client:
        assert client.options.shutdown_timeout_s == 2.0  # a keyword overrides the object
        assert client.options.engine_heartbeat_timeout_s == 5.0
        assert client.echo(1) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.transport = "tcp"  # type: ignore[misc]
    assert set(opts.given()) == {"shutdown_timeout_s", "engine_heartbeat_timeout_s",
                                 "engine_fault", "ready_timeout_s"}


@pytest.mark.parametrize("bad,message", [
    ({"transport": "udp"}, "transport='udp'"),
    ({"frame_integrity": "yes"}, "frame_integrity='yes'"),
    ({"engine_index": 70000}, "engine_index=70000"),
    ({"shutdown_timeout_s": float("nan")}, "shutdown_timeout_s"),
    ({"engine_connect": ("a",)}, "engine_connect"),
    ({"engine_fault": "nosuch:1"}, "nosuch"),
    ({"engine_launcher": 3}, "engine_launcher=3"),
])
def test_a_bad_option_is_refused_by_name_before_any_engine_starts(
        bad: dict[str, object], message: str) -> None:
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match=message):
        ClientOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        make_client(NULL, multiprocess=True, asyncio=False, **bad)
    assert {p.pid for p in psutil.Process().children()} <= before


def test_an_unknown_option_or_a_wrong_object_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected client option"):
        make_client(NULL, multiprocess=True, asyncio=False, shutdown_timeout=1)
    with pytest.raises(TypeError, match="expected a ClientOptions"):
        make_client(NULL, multiprocess=True, asyncio=False, options={"transport": "tcp"})
    dp = EngineConfig(model="null", data_parallel_size=2)
    with pytest.raises(TypeError, match="expected a ClientOptions"):
        make_client(dp, multiprocess=True, asyncio=False, options=object())


def test_a_data_parallel_client_takes_the_object_for_every_engine() -> None:
    dp = EngineConfig(model="null", data_parallel_size=2)
    opts = ClientOptions(shutdown_timeout_s=3)
    with make_client(dp, multiprocess=True, asyncio=False, options=opts) as client:
        assert client.echo(2) == 2
