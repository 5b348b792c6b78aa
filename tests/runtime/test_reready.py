"""Nothing sent after a re-ready is lost. An oversize frame makes libzmq drop the engine's
input connection (before allocating the frame); the engine connects again and announces
itself with a new ready. A front end that answers that ready at once (here an ATTACH) must
be heard: before, a ready queued while the link was down could arrive on the next connection
ahead of that connection's own ready, and the front end's answer to the extra one went into
a link about to drop (#27: 1 ATTACH in 8 lost). The sequence runs 100 times."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from enginewire.protocol.codec import Encoder, Limits, decode_outputs, decode_ready, encode_input
from enginewire.protocol.messages import AttachRequest, RequestType
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import Control, EngineCoreProc

ROUNDS = 100
BOUND_S = 5.0
LIMITS = Limits(max_frame_bytes=1 << 16)


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as the clients: the reconnected engine
    router.bind(f"ipc://{tmp_path}/in")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/out")
    holder: dict[str, Any] = {}

    def serve() -> None:
        proc = EngineCoreProc(EngineConfig(model="null"), input_address=f"ipc://{tmp_path}/in",
                              output_address=f"ipc://{tmp_path}/out", limits=LIMITS)
        holder["proc"] = proc
        try:
            proc.run_busy_loop()
        finally:
            proc.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield router, pull
    finally:
        if "proc" in holder:
            holder["proc"].input_queue.put((Control.SHUTDOWN, None))
        server.join(30)
        router.close(0)
        pull.close(0)
        ctx.term()


def _marker(pull: Any, session: bytes) -> bool:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if pull.poll(50) and decode_outputs(pull.recv_multipart()).session == session:
            return True
    return False


def test_an_attach_sent_right_after_each_re_ready_is_answered(peer: tuple[Any, Any]) -> None:
    router, pull = peer
    identity, *frames = router.recv_multipart()
    decode_ready(frames)
    encoder = Encoder()
    lost: list[int] = []
    for i in range(ROUNDS):
        router.send_multipart([identity, RequestType.ADD.value + b"\x00" * (1 << 17)])
        assert router.poll(int(BOUND_S * 1000)), f"round {i}: no re-ready"
        again, *frames = router.recv_multipart()
        assert again == identity
        decode_ready(frames)
        session = os.urandom(16)
        router.send_multipart([identity, *encode_input(encoder, RequestType.ATTACH,
                                                       AttachRequest(session))])
        if not _marker(pull, session):
            lost.append(i)
    assert not lost, f"ATTACH lost after the re-ready in rounds {lost}"
