"""Enginewire's wire profile (runtime/_engine_wire.py), in memory. The idle call's short path
is differential-tested against the general path, as the decode batch is against the full
pass (tests/runtime/test_scheduler.py): the same call frames and results through both give the
same calls and the same replies, and whatever the short path declines the general path takes."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from enginewire.protocol.codec import (
    DEFAULT_LIMITS,
    Encoder,
    Limits,
    decode_input,
    decode_outputs,
    encode_input,
    utility_output,
)
from enginewire.protocol.messages import EngineCoreOutputs, RequestType, UtilityRequest
from enginewire.runtime._engine_shared import Control
from enginewire.runtime._engine_wire import WireProfile
from enginewire.runtime.engine_proc import plain_reply
from enginewire.spec.errors import ProtocolError

CALLS = [
    UtilityRequest(0, 1, "echo", []),
    UtilityRequest(3, 2**40, "echo", [None, True, -5, 1.5, "text", b"\x00\x01"]),
    UtilityRequest(0, 7, "pause_scheduler", ["keep"]),
    UtilityRequest(0, 8, "echo", [[1, [2]], {"k": 1}]),
]
RESULTS: list[Any] = [None, True, 2**64 - 1, -(2**63), 1.5, "text", b"\x00\x01",
                      [1, [2]], {"k": 1}, np.arange(3), 2**70, "\ud800"]


def _frames(call: UtilityRequest) -> list[Any]:
    return [bytes(f) for f in encode_input(Encoder(), RequestType.UTILITY, call)]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c.method}-{c.call_id}")
def test_a_call_decodes_the_same_on_the_short_path_and_the_general_one(
        call: UtilityRequest) -> None:
    frames = _frames(call)
    assert len(frames) == 1
    short = WireProfile().short_call(DEFAULT_LIMITS)
    assert short is not None
    kind, general = decode_input(frames, DEFAULT_LIMITS)
    assert kind is RequestType.UTILITY
    assert short(frames[0]) == general == call


def test_what_the_short_path_declines_the_general_one_decides() -> None:
    short = WireProfile().short_call(Limits(max_call_bytes=64))
    assert short is not None
    add = bytes(encode_input(Encoder(), RequestType.ADD, UtilityRequest(0, 1, "x", []))[0])
    big = _frames(UtilityRequest(0, 1, "echo", ["x" * 100]))[0]
    with_aux = encode_input(Encoder(), RequestType.UTILITY,
                            UtilityRequest(0, 1, "echo", [np.arange(100)]))
    assert len(with_aux) == 2  # the array rides in an aux frame
    for first in (add, big, bytes(with_aux[0]), b"\x03\xc1", b"\x03", b""):
        assert short(first) is None
    # The general path refuses the oversized call by name and decodes the one with aux frames.
    with pytest.raises(ProtocolError):
        decode_input([big], Limits(max_call_bytes=64))
    assert decode_input(with_aux, DEFAULT_LIMITS)[0] is RequestType.UTILITY


@pytest.mark.parametrize("result", RESULTS, ids=lambda r: type(r).__name__)
def test_a_reply_is_the_same_from_the_short_path_and_the_general_builder(result: Any) -> None:
    """``plain_reply`` (short) against ``utility_output`` + the output encoder (general):
    where the short path encodes a reply, the client decodes the general one's twin; where
    it declines (a result that is no plain msgpack value, or none at all), None."""
    payload = plain_reply(msgspec.msgpack.Encoder(), 3, 9, result)
    general = utility_output(9, "echo", result=result)
    if payload is None:
        return  # the general builder's alone (an array, or a value it makes a failure)
    fast = decode_outputs([payload])
    slow = decode_outputs(Encoder().encode(EngineCoreOutputs(engine_index=3,
                                                             utility_output=general)))
    assert fast.engine_index == slow.engine_index == 3
    assert fast.utility_output == slow.utility_output
    assert fast.utility_output is not None and fast.utility_output.result == result


def test_the_short_path_takes_exactly_the_plain_results() -> None:
    taken = [plain_reply(msgspec.msgpack.Encoder(), 0, 1, r) is not None for r in RESULTS]
    # Plain and encodable; an int past 64 bits and a lone surrogate are the builder's to fail.
    assert taken == [True] * 7 + [False, False, False, False, False]


def test_a_rejection_answers_what_it_can_name() -> None:
    wire, error = WireProfile(), ProtocolError("bad")
    add = [RequestType.ADD.value + msgspec.msgpack.encode(["rid", "junk"])]
    call = [RequestType.UTILITY.value + msgspec.msgpack.encode([0, 5, 1])]
    assert wire.rejection(add, error) == (Control.REJECT_ADD, ("rid", "malformed request: bad"))
    kind, out = wire.rejection(call, error)  # type: ignore[misc]
    assert kind is Control.OUTPUTS and out.utility_output.call_id == 5
    assert wire.rejection([b""], error) is None
    assert wire.rejection([b"\x09junk"], error) is None
