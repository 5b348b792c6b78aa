"""runtime/options.py: the clients' options as typed objects, checked once, and the page
generated from them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import psutil
import pytest

from enginewire.runtime import ClientOptions, DataParallelOptions, make_client
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.dp_client import SyncDPClient
from enginewire.runtime.faults import FaultPlan
from enginewire.runtime.options import render_options_page

NULL = EngineConfig(model="null")
DP = EngineConfig(model="null", data_parallel_size=2)
ROOT = Path(__file__).resolve().parents[2]


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

    assert client.options.engine_options == opts


@pytest.mark.parametrize("bad,error,message", [
    ({"restart_limit": 0}, ValueError, "restart_limit=0"),
    ({"restart_dead_engines": 1}, ValueError, "restart_dead_engines=1"),
    ({"input_address": ["ipc:///x"]}, ValueError, r"input_address=.*a list of 2"),
    ({"output_address": "ipc:///x"}, ValueError, "output_address='ipc:///x'"),
    ({"engine_connect": [("a", "b"), "c"]}, ValueError, "engine_connect="),
    ({"engine_fault": {-1: "forward:1"}}, ValueError, r"keys \[-1\] are not engine"),
    ({"engine_fault": {0: "nosuch:1"}}, ValueError, "nosuch"),
    ({"engine_fault": {0: 5}}, TypeError, "engine_fault must be"),
    ({"ray_address": "auto"}, ValueError, "ray_address: only the data_parallel_backend 'ray'"),
    ({"ray_placement_strategy": "ANYWHERE"}, ValueError, "ray_placement_strategy='ANYWHERE'"),
    # Options of every engine's client: the same errors a one-engine client raises.
    ({"transport": "udp"}, ValueError, "transport='udp'"),
    ({"shutdown_timeout": 1}, TypeError, "unexpected client option"),
    ({"engine_index": 1}, ValueError, "assigns each engine its own"),
])
def test_a_bad_data_parallel_option_is_refused_by_name_before_any_engine_starts(
        bad: dict[str, Any], error: type[Exception], message: str) -> None:
    """Options of every engine used to be checked by each engine's client as it started, so a
    typo was an EngineStartupError after the engines spawned."""
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(error, match=message):
        make_client(DP, multiprocess=True, asyncio=False, **bad)
    assert {p.pid for p in psutil.Process().children()} <= before


def test_data_parallel_options_as_an_object_and_as_keywords_are_one_surface() -> None:
    keywords = DataParallelOptions.of(None, {
        "restart_dead_engines": True, "restart_limit": 2, "input_address": ["a", "b"],
        "engine_fault": {1: "forward:3"}, "shutdown_timeout_s": 3})
    assert keywords.input_address == ("a", "b")  # normalised once: tuples, plans parsed
    assert keywords.engine_fault is not None
    assert isinstance(keywords.engine_fault[1], FaultPlan)
    assert keywords.engine_options is not None
    assert keywords.engine_options.shutdown_timeout_s == 3.0
    assert set(keywords.given()) == {"restart_dead_engines", "restart_limit", "input_address",
                                     "engine_fault", "engine_options"}
    assert keywords.for_engine(1)["input_address"] == "b"
    assert keywords.for_engine(0)["engine_fault"] is None  # the others get no fault
    with pytest.raises(dataclasses.FrozenInstanceError):
        keywords.restart_limit = 3  # type: ignore[misc]
    # A keyword overrides the object, the common fault and the per-engine one each other.
    common = DataParallelOptions.of(keywords, {"engine_fault": "forward:1"})
    assert common.engine_fault is None and common.engine_options is not None
    assert isinstance(common.engine_options.engine_fault, FaultPlan)
    assert common.restart_limit == 2
    per_engine = DataParallelOptions.of(ClientOptions(engine_fault="forward:1"),
                                        {"engine_fault": {0: "forward:2"}})
    assert per_engine.engine_options is not None
    assert per_engine.engine_options.engine_fault is None
    with pytest.raises(ValueError, match="give one of them"):
        DataParallelOptions(engine_fault={0: "forward:1"},
                            engine_options=ClientOptions(engine_fault="forward:2"))
    with pytest.raises(ValueError, match="a list of 3"):
        keywords.check_engines(3)
    # A proxy in front of one engine only (model_tests/fault_matrix_dp.py): None for the rest.
    proxied = DataParallelOptions(engine_connect=[None, ["a", "b"]])
    assert proxied.engine_connect == (None, ("a", "b"))
    assert proxied.for_engine(0) == {"engine_connect": None}


def test_a_data_parallel_client_takes_its_own_object_whole() -> None:
    opts = DataParallelOptions(restart_limit=2,
                               engine_options=ClientOptions(shutdown_timeout_s=3))
    # One engine is enough: the object itself asks for the data-parallel client.
    with make_client(NULL, multiprocess=True, asyncio=False, options=opts,
                     restart_dead_engines=True) as client:
        assert isinstance(client, SyncDPClient)
        assert client.options.restart_dead_engines and client.options.restart_limit == 2
        assert client.call_utility_all("echo", 5) == [5]


def _page_rows() -> dict[str, dict[str, list[str]]]:
    """docs/options.md's rows: record name -> option -> [type, default, meaning] cells."""
    tables: dict[str, dict[str, list[str]]] = {}
    rows: dict[str, list[str]] = {}
    for line in (ROOT / "docs" / "options.md").read_text(encoding="utf-8").splitlines():
        if heading := re.fullmatch(r"## `(\w+)`", line):
            rows = tables.setdefault(heading.group(1), {})
        elif line.startswith("| `"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0].strip("`")] = cells[1:]
    return tables


def test_the_options_page_lists_every_field_of_both_records_as_declared() -> None:
    """The table was hand-written once, and nothing checked it against the fields."""
    assert (ROOT / "docs" / "options.md").read_text(encoding="utf-8") == render_options_page()
    tables = _page_rows()
    assert set(tables) == {"ClientOptions", "DataParallelOptions"}
    for cls in (ClientOptions, DataParallelOptions):
        fields = dataclasses.fields(cls)
        assert list(tables[cls.__name__]) == [f.name for f in fields]
        for f in fields:
            kind, default, doc = tables[cls.__name__][f.name]
            assert f.metadata["doc"], f"{cls.__name__}.{f.name} has no doc"
            assert (kind, doc) == (f"`{f.type}`", f.metadata["doc"])
            assert default.strip("`\"") == str(f.default), f.name
