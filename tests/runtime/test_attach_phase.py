"""The attach and session machines (spec/attach.py, spec/session.py) as the runtime runs them.

Client side: a front end attached to a scripted engine (a DEALER and a PUSH playing the
engine's sockets) walks its attach phase through each row the engine can make it take, and
records it in its trace. Engine side: an engine core in this process (its busy loop on a
thread) walks its session through ATTACHs accepted, refused and replaced. Every recorded
trace is replayed against the declaration."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from enginewire import EngineDeadError, ProtocolError, make_client
from enginewire.protocol.codec import Encoder, decode_input, decode_ready, encode_input
from enginewire.protocol.messages import (
    PROTOCOL_VERSION,
    AttachRequest,
    EngineCoreOutputs,
    ReadyResponse,
    RequestType,
)
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import Control, EngineCoreProc
from enginewire.spec import (
    ATTACH,
    SESSION,
    AttachEvent,
    AttachState,
    SessionState,
    TraceEntry,
    validate_trace,
)
from enginewire.testing._harness import wait_until

CONFIG = EngineConfig(model="null", device="cpu")
BOUND_S = 10.0


def _steps(trace: list[TraceEntry], machine: str) -> list[tuple[str, str, str]]:
    return [(before, event, after) for name, before, event, after, _ in trace if name == machine]


# -- the client's attach phase, against a scripted engine ------------------------------------

@contextmanager
def scripted_engine(tmp_path: Path, **options: Any) -> Iterator[tuple[Any, Any, Any, bytes]]:
    """A client attached to sockets this test drives: (client, dealer, push, its session)."""
    inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    ctx = zmq.Context()
    dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    try:
        dealer.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        dealer.connect(inp)
        push.connect(out)
        dealer.send(msgspec_ready())
        client = make_client(CONFIG, multiprocess=True, asyncio=False, launch_engine=False,
                             input_address=inp, output_address=out, trace=[], **options)
        with client:
            assert dealer.poll(int(BOUND_S * 1000))
            kind, attach = decode_input(dealer.recv_multipart())
            assert kind is RequestType.ATTACH and isinstance(attach, AttachRequest)
            yield client, dealer, push, attach.session
    finally:
        dealer.close(0)
        push.close(0)
        ctx.term()


def msgspec_ready() -> bytes:
    import msgspec

    return msgspec.msgpack.encode(ReadyResponse(PROTOCOL_VERSION, 0, 64, 16, 128, "fake", "cpu"))


def _send(push: Any, outputs: EngineCoreOutputs) -> None:
    push.send_multipart(Encoder().encode(outputs))


def _wait_phase(client: Any, state: AttachState) -> None:
    wait_until(lambda: client.attach_phase.state is state, BOUND_S,
               f"the attach phase reaching {state.name} (it is {client.attach_phase.state.name})")


def test_messages_before_the_marker_loop_then_the_marker_attaches(tmp_path: Path) -> None:
    with scripted_engine(tmp_path) as (client, _dealer, push, session):
        assert client.attach_phase.state is AttachState.AWAITING_MARKER
        _send(push, EngineCoreOutputs(timestamp=1.0))  # a previous front end's, say
        _send(push, EngineCoreOutputs(session=b"x" * len(session), timestamp=1.0))
        _send(push, EngineCoreOutputs(session=session, timestamp=1.0))
        _wait_phase(client, AttachState.ATTACHED)
        steps = _steps(client.trace, ATTACH.name)
        assert steps == [
            ("DETACHED", "SEND_ATTACH", "AWAITING_MARKER"),
            ("AWAITING_MARKER", "FOREIGN_MESSAGE", "AWAITING_MARKER"),
            ("AWAITING_MARKER", "FOREIGN_MESSAGE", "AWAITING_MARKER"),
            ("AWAITING_MARKER", "MARKER", "ATTACHED"),
        ]
        validate_trace(ATTACH, client.trace)
        assert not client.is_dead


def test_a_refusing_marker_leaves_the_phase_refused_and_the_client_dead(
        tmp_path: Path) -> None:
    with scripted_engine(tmp_path) as (client, _dealer, push, session):
        _send(push, EngineCoreOutputs(session=session, refusal="integrity differs",
                                      timestamp=1.0))
        with pytest.raises(EngineDeadError) as info:
            client.get_output(timeout=BOUND_S)
        assert isinstance(info.value.__cause__, ProtocolError)
        assert "refused this front end" in str(info.value.__cause__)
        assert client.attach_phase.state is AttachState.REFUSED
        validate_trace(ATTACH, client.trace)


def test_a_session_ended_after_the_marker_leaves_the_phase_ended(tmp_path: Path) -> None:
    with scripted_engine(tmp_path) as (client, _dealer, push, session):
        _send(push, EngineCoreOutputs(session=session, timestamp=1.0))
        _wait_phase(client, AttachState.ATTACHED)
        _send(push, EngineCoreOutputs(session=session, refusal="input failed its check",
                                      timestamp=1.0))
        with pytest.raises(EngineDeadError) as info:
            client.get_output(timeout=BOUND_S)
        assert "ended this session" in str(info.value.__cause__)
        assert client.attach_phase.state is AttachState.ENDED
        validate_trace(ATTACH, client.trace)


def test_a_silent_engine_makes_the_marker_overdue(tmp_path: Path) -> None:
    # Nothing arrives: the monitor (not the reader) finds the deadline passed.
    with scripted_engine(tmp_path, ready_timeout_s=0.3) as (client, _dealer, _push, _s):
        with pytest.raises(EngineDeadError) as info:
            client.get_output(timeout=BOUND_S)
        assert "no attach marker" in str(info.value.__cause__)
        assert client.attach_phase.state is AttachState.OVERDUE
        assert _steps(client.trace, ATTACH.name)[-1] == (
            "AWAITING_MARKER", "DEADLINE", "OVERDUE")
        validate_trace(ATTACH, client.trace)


def test_a_marker_after_the_deadline_changes_nothing(tmp_path: Path) -> None:
    """The monitor and the reader race for the phase: whichever moves it first wins, and the
    other's event is not fired (no SpecViolation on a reader thread)."""
    with scripted_engine(tmp_path, ready_timeout_s=0.3) as (client, _dealer, _push, _s):
        with pytest.raises(EngineDeadError):
            client.get_output(timeout=BOUND_S)
        steps = len(client.trace)
        # The reader's step for a marker that lands now: refused, nothing recorded.
        assert client._attach_step(AttachEvent.MARKER) is False
        assert client._attach_step(AttachEvent.DEADLINE) is False
        assert client.attach_phase.state is AttachState.OVERDUE
        assert client._attaching is None and len(client.trace) == steps


# -- the engine's session, on an engine core in this process -----------------------------------

@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Any, Any, EngineCoreProc, list[TraceEntry]]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.bind(f"ipc://{tmp_path}/in")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/out")
    trace: list[TraceEntry] = []
    proc = EngineCoreProc(CONFIG, input_address=f"ipc://{tmp_path}/in",
                          output_address=f"ipc://{tmp_path}/out", trace=trace)

    def serve() -> None:
        try:
            proc.run_busy_loop()
        finally:
            proc.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield router, pull, proc, trace
    finally:
        proc.input_queue.put((Control.SHUTDOWN, None))
        server.join(30)
        router.close(0)
        pull.close(0)
        ctx.term()


def _attach(router: Any, identity: bytes, pull: Any, session: bytes, *,
            integrity: bool = False) -> EngineCoreOutputs:
    from enginewire.protocol.codec import decode_outputs

    router.send_multipart([identity, *encode_input(
        Encoder(), RequestType.ATTACH, AttachRequest(session, integrity=integrity))])
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if pull.poll(50):
            out = decode_outputs(pull.recv_multipart())
            if out.session == session:
                return out
    raise AssertionError("no marker")


def test_the_engine_session_follows_accepted_and_refused_attaches(
        engine: tuple[Any, Any, EngineCoreProc, list[TraceEntry]]) -> None:
    router, pull, proc, trace = engine
    identity, *frames = router.recv_multipart()
    decode_ready(frames)
    assert proc.input.session_phase.state is SessionState.NO_FRONT_END
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    assert _attach(router, identity, pull, a).refusal is None
    assert proc.input.session_phase.state is SessionState.ATTACHED
    assert _attach(router, identity, pull, b).refusal is None  # a new front end replaces it
    refused = _attach(router, identity, pull, c, integrity=True)  # this engine does not seal
    assert refused.refusal is not None and "frame integrity" in refused.refusal
    assert proc.input.session_phase.state is SessionState.REFUSED
    assert _attach(router, identity, pull, c).refusal is None
    assert proc.input.session_phase.state is SessionState.ATTACHED
    assert _steps(trace, SESSION.name) == [
        ("NO_FRONT_END", "ATTACH_ACCEPTED", "ATTACHED"),
        ("ATTACHED", "ATTACH_ACCEPTED", "ATTACHED"),
        ("ATTACHED", "ATTACH_REFUSED", "REFUSED"),
        ("REFUSED", "ATTACH_ACCEPTED", "ATTACHED"),
    ]
    validate_trace(SESSION, trace)
