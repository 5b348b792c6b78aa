"""The multi-process client's fast paths (runtime/mp_client.py), in memory.

Each shortcut has one named predicate beside its general path, and is differential-tested
against it here, as the decode batch is against the full pass (test_scheduler.py) and the
engine's idle call against its general path (test_engine_wire.py):

* receive (``MPClient._on_message``): ``_one_frame``, ``_short_decodes`` and
  ``_plain_reply``. The same engine messages go to a client with every shortcut, one with
  none (the predicates made False: every message read whole and decoded by ``_on_frames``)
  and one with a drawn few; each must end in the same state: what each message did, the
  batches ``get_output`` then hands over, the request lifecycles, every utility call's
  outcome, alive or dead and why.
* send (``MPClient._send_call`` / ``_send``): ``_plain_call`` and ``_copied_send``. The
  same calls, ADDs and ABORTs must put the same bytes on the wire, or raise the same error.

No engine: a client whose start is skipped (``_Unwired``) is handed messages over an inproc
socket pair, as its reader would be, and sends to a socket that records the wire. The
messages are the engine's encodings (sealed with frame integrity), garbage frames, the
sentinel, and with integrity a lost, a corrupted and an unsealed message. Not a part that a
one-frame message should not have: the one-frame shortcut leaves it for the next read, by
design (test_engine_proc.py's stray-part test), where the general path reads it with its
message.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginewire.protocol.codec import Decoder, Encoder, Limits, encode_input
from enginewire.protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    SESSION_BYTES,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.integrity import LinkIntegrity
from enginewire.runtime.mp_client import _PLAIN_REPLY_BYTES
from enginewire.runtime.sync_mp_client import SyncMPClient, _SyncCall
from enginewire.spec import SpecViolation
from enginewire.spec.attach import AttachEvent
from enginewire.spec.client import ClientEvent
from enginewire.spec.errors import EngineWireError

NULL = EngineConfig(model="null", device="cpu")
RECEIVE_SHORTCUTS = ("_one_frame", "_short_decodes", "_plain_reply")
SEND_SHORTCUTS = ("_plain_call", "_copied_send")
RIDS = ("r0", "r1", "r2")
CALL_IDS = (1, 2, 3)
BOUND_MS = 5000


def _never(*_: Any) -> bool:
    """A shortcut's predicate made to decline: everything takes the general path."""
    return False


class _Unwired(SyncMPClient):
    """A sync client without an engine, sockets or threads, ready and attached as a client
    whose handshake and attach marker came in: a test hands messages to ``_on_message``."""

    def _start(self, **_: Any) -> None:
        with self._state_lock:
            self.lifecycle.fire(ClientEvent.HANDSHAKE_OK)
        self._attach_step(AttachEvent.SEND_ATTACH, b"s" * SESSION_BYTES)
        self._attach_step(AttachEvent.MARKER)


def _unwired(off: tuple[str, ...], **options: Any) -> _Unwired:
    client = _Unwired(NULL, **options)
    for name in off:
        # ``_plain_call`` declines with None: it gives the frame when it holds.
        setattr(client, name, _never if name != "_plain_call" else lambda *_: None)
    return client


def _err(e: BaseException | None) -> tuple[str, str] | None:
    return None if e is None else (type(e).__name__, str(e))


# -- receive ---------------------------------------------------------------------------------

_RID = st.sampled_from([*RIDS, "ghost"])  # ghost: never added, a forbidden output
_REASON = st.sampled_from([None, None, None, FinishReason.STOP, FinishReason.LENGTH,
                           FinishReason.ABORT])
_OUTPUT = st.builds(EngineCoreOutput, _RID, st.lists(st.integers(0, 1000), max_size=3), _REASON)
_RESULT = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8),
    st.lists(st.integers(0, 9), max_size=3), st.dictionaries(st.text(max_size=2), st.none()),
    st.just(np.arange(3)),  # inline
    st.just(np.arange(100)),  # 800 bytes: an aux frame
    st.just("b" * (_PLAIN_REPLY_BYTES + 10)),  # over the short decode's size
)
_REPLY = st.builds(UtilityOutput, st.sampled_from([*CALL_IDS, 99]),  # 99: unknown, dropped
                   st.sampled_from([None, None, "it failed"]), _RESULT)


@st.composite
def _batch(draw: st.DrawFn) -> EngineCoreOutputs:
    sids = draw(st.lists(_RID, max_size=4))
    tokens = draw(st.sampled_from([len(sids)] * 3 + [0, 1, 5]))  # some not one an id
    return EngineCoreOutputs(
        outputs=draw(st.lists(_OUTPUT, max_size=4)),
        stream_ids=sids, stream_tokens=[7] * tokens,
        finished_requests=draw(st.none() | st.lists(_RID, max_size=6)),
        scheduler_stats=draw(st.none() | st.builds(SchedulerStats, st.integers(0, 4))),
        utility_output=draw(st.none() | _REPLY))


_MESSAGE = st.one_of(
    st.tuples(st.just("outputs"), _REPLY.map(lambda r: EngineCoreOutputs(utility_output=r))),
    st.tuples(st.just("outputs"), _batch()),
    st.tuples(st.just("outputs"), _batch()),
    st.tuples(st.just("outputs"), st.sampled_from([
        EngineCoreOutputs(),  # a heartbeat
        EngineCoreOutputs(refusal="its input failed the engine's integrity check"),
        # One frame over the short decode's size (3 bytes a token).
        EngineCoreOutputs(outputs=[EngineCoreOutput("r0", [1000] * (_PLAIN_REPLY_BYTES // 2))]),
    ])),
    # The sentinel; garbage: not msgpack, empty, cut short, of the wrong type.
    st.sampled_from([("sentinel",), ("garbage", b"\xc1"), ("garbage", b""),
                     ("garbage", b"\x92\x01"), ("garbage", b"\x91\xa1x")]),
    # With frame integrity only: a message lost on the way, one corrupted, one unsealed.
    st.tuples(st.sampled_from(["lost", "corrupt", "unsealed"]), _batch()),
)


def _wire_frames(messages: list[tuple[Any, ...]], integrity: bool) -> list[list[bytes]]:
    """What the engine puts on the wire for ``messages``, sealed as its side seals them."""
    encoder, seal = Encoder(), LinkIntegrity() if integrity else None
    wire: list[list[bytes]] = []
    for kind, *rest in messages:
        if kind == "sentinel":
            wire.append([ENGINE_DEAD_SENTINEL])  # never sealed
            continue
        if kind == "garbage":
            frames = [rest[0]]
        else:
            frames = [bytes(f) for f in encoder.encode(rest[0])]
        if seal is None:
            if kind in ("outputs", "garbage"):
                wire.append(frames)
            continue
        if kind == "unsealed":
            wire.append(frames)
            continue
        trailer = seal.seal(frames)
        if kind == "lost":
            continue
        if kind == "corrupt":
            frames[0] = bytes([frames[0][0] ^ 1]) + frames[0][1:]
        wire.append([*frames, trailer])
    return wire


_PAIRS = itertools.count()


@contextlib.contextmanager
def _pair(ctx: zmq.Context[Any]) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """An engine's end and a client's end, joined in memory (a fresh name each time: a
    closed socket's name is let go of asynchronously)."""
    push, pull = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = f"inproc://mp-client-{next(_PAIRS)}"
    try:
        pull.bind(address)
        push.connect(address)
        pull.setsockopt(zmq.RCVTIMEO, BOUND_MS)
        yield push, pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


def _outcome(call: _SyncCall) -> Any:
    if not call.done():
        return "pending"
    try:
        result = call.result()
    except Exception as e:
        return _err(e)
    if isinstance(result, np.ndarray):
        return ("array", str(result.dtype), result.shape, result.tobytes())
    return ("result", result)


def _received(client: _Unwired, wire: list[list[bytes]],
              pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> tuple[Any, ...]:
    """Route ``wire`` through ``client`` as its reader does (a raise is the engine's death
    and ends the reading), then take every batch as ``get_output`` does; what it leaves."""
    push, pull = pair
    calls = {}
    for call_id in CALL_IDS:
        calls[call_id] = _SyncCall()
        client._utilities.register(call_id, calls[call_id], "echo")
    for rid in RIDS:
        client._track_add(EngineCoreRequest(rid, [5]))
    routed: list[Any] = []
    for frames in wire:
        push.send_multipart(frames)
        first = pull.recv()
        try:
            batch = client._on_message(first, pull)
        except Exception as e:
            routed.append(_err(e))
            client._on_engine_dead(e)
            break
        routed.append(batch)
        if batch is not None:
            client._outputs.put(batch)
    unread = bool(pull.poll(0))
    delivered: list[Any] = []
    while not client._outputs.empty() or client._redeliver:
        try:
            out = client._output_first()
            delivered.append(client._take_output() if out is None else out)
        except SpecViolation as e:  # the rest of its batch comes next
            delivered.append(_err(e))
        except EngineWireError as e:  # the death marker: it stays for the next caller
            delivered.append(_err(e))
            break
    return (routed, unread, delivered,
            {rid: lc.state for rid, lc in client._requests.items()},
            {cid: _outcome(call) for cid, call in calls.items()},
            client.pending_utility_calls(), client.is_dead, _err(client.dead_cause),
            client.attach_phase.state)


@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "integrity"])
@settings(max_examples=120, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(messages=st.lists(_MESSAGE, max_size=8),
       off=st.sets(st.sampled_from(RECEIVE_SHORTCUTS), min_size=1),
       small_batch=st.booleans())
def test_the_receive_shortcuts_leave_what_the_general_path_leaves(
        ctx: zmq.Context[Any], integrity: bool, messages: list[tuple[Any, ...]],
        off: set[str], small_batch: bool) -> None:
    """Every shortcut on, all off, and a drawn few off: the same messages leave the same
    state (the shortcuts are off anyway with frame integrity: then only the general path's
    handling of a one-frame message differs)."""
    wire = _wire_frames(messages, integrity)
    seen = []
    for forced in [(), RECEIVE_SHORTCUTS, tuple(sorted(off))]:
        client = _unwired(forced, frame_integrity=integrity)
        if small_batch:  # so a batch over the bound is small enough to draw
            client._out_decoder = Decoder(EngineCoreOutputs, Limits(max_batch=4))
            client._decode_reply = client._out_decoder.decode_unchecked
        try:
            with _pair(ctx) as pair:
                seen.append(_received(client, wire, pair))
        finally:
            client.shutdown()
    assert seen[1] == seen[0], messages
    assert seen[2] == seen[0], (messages, off)


def test_each_shortcut_is_taken() -> None:
    """Each predicate holds where its shortcut is meant for, and declines the rest; with
    frame integrity none holds."""
    client = _unwired(())
    sealed = _unwired((), frame_integrity=True)
    try:
        assert client._one_frame() and not sealed._one_frame()
        assert client._short_decodes(b"x" * _PLAIN_REPLY_BYTES)
        assert not client._short_decodes(b"x" * (_PLAIN_REPLY_BYTES + 1))
        reply = UtilityOutput(1, result="v")
        assert client._plain_reply(EngineCoreOutputs(utility_output=reply,
                                                     scheduler_stats=SchedulerStats(1)))
        assert not client._plain_reply(EngineCoreOutputs())
        for beside in [{"outputs": [EngineCoreOutput("r0", [1])]}, {"stream_ids": ["r0"]},
                       {"stream_tokens": [1]}, {"finished_requests": ["r0"]}]:
            assert not client._plain_reply(EngineCoreOutputs(utility_output=reply, **beside))
    finally:
        client.shutdown()
        sealed.shutdown()


# -- send ------------------------------------------------------------------------------------


class _Tracker:
    done = True


class _Wire:
    """An input socket that records each part sent and whether more follow."""

    def __init__(self) -> None:
        self.parts: list[tuple[bytes, bool]] = []

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        self.parts.append((bytes(data), bool(flags & zmq.SNDMORE)))
        return _Tracker() if track else None


_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids,
                                                             max_size=3),
    max_leaves=6)
_ARG = _VALUE | st.sampled_from([np.arange(3), np.arange(100), np.float32(1.5), "x" * 400])
_SEND = st.one_of(
    st.tuples(st.just("call"), st.sampled_from(["echo", "sleep"]), st.lists(_ARG, max_size=3)),
    st.tuples(st.just("add"), _RID),
    st.tuples(st.just("abort"), st.lists(_RID, max_size=3)),
    st.tuples(st.just("unplug")),  # the socket closed under it: ClientClosedError
)


def _sent(client: _Unwired, op: tuple[Any, ...], call_id: int) -> tuple[Any, ...]:
    wire = client.resources.input_socket
    assert isinstance(wire, _Wire)
    before = len(wire.parts)
    try:
        if op[0] == "call":
            client._send_call(UtilityRequest(client.client_index, call_id, op[1], list(op[2])))
        elif op[0] == "add":
            client.send_add(EngineCoreRequest(op[1], [5, 6]))
        elif op[0] == "abort":
            client.send_abort(op[1])
        else:
            client.resources.input_socket = None
            with pytest.raises(EngineWireError):
                client._send_call(UtilityRequest(client.client_index, call_id, "echo", []))
            client.resources.input_socket = wire
        error = None
    except (ValueError, TypeError, SpecViolation, EngineWireError) as e:
        error = _err(e)
    return error, wire.parts[before:]


@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "integrity"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_SEND, max_size=10), off=st.sets(st.sampled_from(SEND_SHORTCUTS), min_size=1),
       small_calls=st.booleans())
def test_the_send_shortcuts_put_what_the_general_path_puts_on_the_wire(
        integrity: bool, ops: list[tuple[Any, ...]], off: set[str], small_calls: bool) -> None:
    """Every shortcut on, all off, and a drawn few off: each call, ADD and ABORT puts the same
    parts on the wire (the identity, the message, aux frames, the trailer) or raises the same
    error (a value the wire cannot carry, a call over the engine's bound)."""
    limits = {"engine_limits": Limits(max_call_bytes=300)} if small_calls else {}
    clients = [_unwired(forced, frame_integrity=integrity, **limits)
               for forced in [(), SEND_SHORTCUTS, tuple(sorted(off))]]
    try:
        for client in clients:
            client.resources.input_socket = _Wire()  # type: ignore[assignment]
            client._sock_send = lambda sock, data, flags=0: sock.send(data, flags)
        for i, op in enumerate(ops):
            sent = [_sent(client, op, i) for client in clients]
            assert sent[1] == sent[0], op
            assert sent[2] == sent[0], (op, off)
    finally:
        for client in clients:
            client.resources.input_socket = None
            client.shutdown()


def test_the_short_send_takes_exactly_the_plain_calls() -> None:
    """``_plain_call`` gives the general path's one frame, and declines what needs more:
    an array sent as an aux frame, a call over the bound, frame integrity."""
    client = _unwired((), engine_limits=Limits(max_call_bytes=300))
    sealed = _unwired((), frame_integrity=True)
    try:
        plain = UtilityRequest(0, 1, "echo", [None, 1, "x", [2.5], {"k": b"\x00"}])
        frame = client._plain_call(plain)
        assert [frame] == encode_input(Encoder(), RequestType.UTILITY, plain)
        assert client._plain_call(UtilityRequest(0, 1, "echo", [np.arange(100)])) is None
        assert client._plain_call(UtilityRequest(0, 1, "echo", ["x" * 400])) is None
        assert sealed._plain_call(plain) is None
        assert client._copied_send([b"m"]) and not client._copied_send([b"m", b"aux"])
        assert sealed._copied_send([b"m", b"trailer"])
        assert not sealed._copied_send([b"m", b"aux", b"trailer"])
    finally:
        client.shutdown()
        sealed.shutdown()
