"""Bombs: messages whose decode would allocate far more than their size. Each is sent to a
real engine process; its peak RSS growth (VmHWM from /proc, a bound, not a time) stays under
a stated multiple of the configured frame limit, the sender gets a typed refusal where the
protocol has a way to say so, and a legitimate front end is served afterwards.

Before the bounds moved ahead of the decode (main at 236fa5a): a 64 MiB ABORT of 2-character
ids cost the engine 1.6 GB, a 100 MB prompt 0.86 GB, 64 MiB of stop ids 0.92 GB, and a
deeply nested ADD escaped the codec as RecursionError with no ERROR output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from enginewire import make_client
from enginewire.protocol.codec import Limits
from enginewire.protocol.messages import FinishReason, RequestType, UtilityRequest
from enginewire.runtime.config import EngineConfig
from enginewire.testing.conformance import collect, open_client, request

FRAME_LIMIT = 80 << 20  # the engine's max_frame_bytes in these tests
BOMB = 64 << 20  # each bomb's size: allowed by the frame limit, refused by a count
# Peak growth allowed: libzmq's copy of the frame plus Python's, and slack for the rest.
RSS_BOUND = 3 * FRAME_LIMIT
CONFIG = EngineConfig(model="null")
LIMITS = Limits(max_frame_bytes=FRAME_LIMIT)


def _hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _reset_hwm(pid: int) -> None:
    # Writing 5 to clear_refs resets the peak to the current RSS (Linux >= 4.0).
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _array32(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def _prompt_bomb(rid: str) -> list[bytes]:
    n = BOMB // 2
    body = _array32(n) + b"\x01" * n  # n one-byte tokens
    return [RequestType.ADD.value + b"\x93" + msgspec.msgpack.encode(rid) + body + b"\x90"]


def _stop_bomb(rid: str) -> list[bytes]:
    n = BOMB // 2
    sp = b"\x96" + b"\x04\x00\x00\x00\xc0" + _array32(n) + b"\x01" * n  # 5 fields, then stops
    return [RequestType.ADD.value + b"\x93" + msgspec.msgpack.encode(rid) + b"\x91\x01" + sp]


def _nested_bomb(rid: str) -> list[bytes]:
    depth = 2 << 20
    return [RequestType.ADD.value + b"\x93" + msgspec.msgpack.encode(rid)
            + b"\x91" * depth + b"\x01" + b"\x90"]


def _abort_bomb(_rid: str) -> list[bytes]:
    n = BOMB // 3
    return [RequestType.ABORT.value + _array32(n) + b"\xa2ab" * n]


def _call_bomb(_rid: str) -> list[bytes]:
    # A utility call whose untyped argument is 64 MiB of empty maps (each ~70x its size).
    n = BOMB
    call = msgspec.msgpack.encode(UtilityRequest(0, 77, "echo", []))
    return [RequestType.UTILITY.value + call[:-1] + b"\x91" + _array32(n) + b"\x80" * n]


def _multipart_bomb(_rid: str) -> list[bytes]:
    # More parts than max_frames, each within the frame limit.
    return [RequestType.ABORT.value + b"\x90", *[b"\x00" * (1 << 20)] * 80]


BOMBS = {
    "long_prompt": (_prompt_bomb, True),
    "long_stop_list": (_stop_bomb, True),
    "deep_nesting": (_nested_bomb, True),
    "long_abort_list": (_abort_bomb, False),
    "huge_utility_argument": (_call_bomb, False),
    "multi_part": (_multipart_bomb, False),
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    cut = open_client("sync", CONFIG, engine_limits=LIMITS)
    try:
        yield cut
    finally:
        cut.shutdown()


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_bomb_costs_a_bounded_peak_and_the_engine_serves_on(engine: Any, name: str) -> None:
    make, answered = BOMBS[name]
    client = engine.client
    pid = client.engine_pid
    rid = f"bomb-{name}"
    if answered:
        client._track_add(request(rid))  # as if sent: the ERROR it earns is expected
    frames = make(rid)
    assert client.echo("warm", timeout=60) == "warm"
    _reset_hwm(pid)
    before = _hwm_kib(pid)
    client.send_raw_frames(frames)
    del frames
    if answered:  # the ADD's id can be read: its request ends with a typed ERROR
        done = collect(engine, [rid])[rid]
        assert done.reason is FinishReason.ERROR and done.error, done
        assert "malformed request" in done.error
    assert client.echo("after", timeout=60) == "after"
    grown = (_hwm_kib(pid) - before) * 1024
    assert grown < RSS_BOUND, f"{name}: engine peak grew {grown >> 20} MiB"
    print(f"{name}: engine peak +{grown >> 20} MiB")


def test_a_legitimate_front_end_is_served_after_the_bombs(engine: Any) -> None:
    with make_client(CONFIG, multiprocess=True, asyncio=False) as fresh:
        assert fresh.echo("fresh", timeout=60) == "fresh"
    assert engine.client.echo("same engine", timeout=60) == "same engine"


def test_every_list_field_of_an_add_has_a_bound() -> None:
    """stop_token_ids had none at all."""
    assert 0 < Limits().max_stop_tokens < Limits().max_prompt_tokens
