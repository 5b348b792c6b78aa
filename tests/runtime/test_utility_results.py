"""Utility results and arguments that msgspec would silently change: a dataclass.

msgspec encodes any dataclass as a map, so without a rule a front end got a dict where the
engine returned an object (what vLLM's ported utility tests tripped on). A registered
dataclass comes back as itself, nested too; an unregistered one is refused by name; an
argument that is a dataclass is a TypeError before anything is sent. Same on every client.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from enginewire import make_client
from enginewire.protocol.codec import (
    Encoder,
    check_no_dataclass,
    decode_outputs,
    decode_utility_result,
    register_result_type,
    utility_output,
)
from enginewire.protocol.messages import EngineCoreOutputs
from enginewire.runtime.config import EngineConfig
from enginewire.spec import UtilityError

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")

CONFIG = EngineConfig(model="null")
BOUND_S = 30.0


@dataclasses.dataclass
class Shard:
    rank: int
    names: list[str]


@dataclasses.dataclass
class Report:
    total: int
    shard: Shard  # typed field: rebuilt by its annotation
    extra: Any = None  # untyped field: rebuilt only because it is tagged


@dataclasses.dataclass
class Unregistered:
    x: int


register_result_type(Shard)
register_result_type(Report)

REPORT = Report(3, Shard(0, ["a"]), extra=[Shard(1, []), {"k": Shard(2, ["b"])}])


def _through_wire(result: object) -> Any:
    out = utility_output(1, "m", result=result)
    if out.failure_message is not None:
        return out.failure_message
    got = decode_outputs(Encoder().encode(EngineCoreOutputs(utility_output=out))).utility_output
    assert got is not None
    return decode_utility_result(got.result)


def test_registered_dataclasses_come_back_as_their_type_nested_too() -> None:
    assert _through_wire(REPORT) == REPORT
    back = _through_wire([REPORT, {"r": Shard(5, [])}, (1, 2)])
    assert type(back[0]) is Report and type(back[0].shard) is Shard
    assert type(back[0].extra[0]) is Shard and type(back[0].extra[1]["k"]) is Shard
    assert back[1] == {"r": Shard(5, [])}


@pytest.mark.parametrize("result", [
    Unregistered(1), [1, Unregistered(2)], {"k": {"n": [Unregistered(3)]}},
    Report(1, Shard(0, []), extra=Unregistered(4)),
])
def test_an_unregistered_dataclass_is_refused_naming_its_type(result: object) -> None:
    message = _through_wire(result)
    assert isinstance(message, str) and "cannot be sent" in message, message
    assert f"{__name__}.Unregistered" in message and "register_result_type" in message


def test_register_result_type_takes_dataclass_types_not_instances() -> None:
    with pytest.raises(TypeError, match="dataclass"):
        register_result_type(Shard(0, []))  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [(Unregistered(1),), (1, [Shard(0, [])]), ({"a": REPORT},)])
def test_a_dataclass_argument_is_a_type_error(args: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError, match="dataclass"):
        check_no_dataclass(args)
    check_no_dataclass((1, "x", [1.0], {"k": None}))  # plain arguments pass


# -- every client, against a real engine -------------------------------------------------------

def _install(engine: Any) -> None:
    engine.UTILITY_METHODS = engine.UTILITY_METHODS | {"typed", "untyped"}
    engine.typed = lambda: REPORT
    engine.untyped = lambda: [Unregistered(7)]


@pytest.fixture
def attached(attach_client: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A sync or async client attached to an engine with the utilities above."""
    with attach_client(CONFIG, _install, asyncio=request.param == "async") as client:
        yield client


def _call(client: Any, method: str, *args: Any) -> Any:
    if hasattr(client, "call_utility_async"):
        import asyncio

        return asyncio.run(client.call_utility_async(method, *args, timeout=BOUND_S))
    return client.call_utility(method, *args, timeout=BOUND_S)


def _check_client(client: Any) -> None:
    got = _call(client, "typed")
    assert got == REPORT and type(got) is Report and type(got.extra[1]["k"]) is Shard
    with pytest.raises(UtilityError, match="Unregistered"):
        _call(client, "untyped")
    with pytest.raises(TypeError, match="dataclass"):
        _call(client, "echo", Unregistered(1))
    assert _call(client, "echo", "still serving") == "still serving"


@pytest.mark.parametrize("attached", ["sync", "async"], indirect=True)
def test_subprocess_clients(attached: Any) -> None:
    _check_client(attached)


def test_inproc_client_reads_like_the_others() -> None:
    with make_client(CONFIG, multiprocess=False, asyncio=False) as client:
        _install(client.engine)
        _check_client(client)
