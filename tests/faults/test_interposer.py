"""model_tests/interposer.py: the proxy alone, between hand-driven client and engine sockets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from enginewire.faults import Direction, FrameAction, FrameKind, FrameRule, Interposer
from enginewire.protocol.messages import RequestType

IDENT = (0).to_bytes(2, "little")
BOUND_MS = 5000


class Ends:
    """A client's bound ROUTER/PULL and an engine's DEALER/PUSH connected via the proxy."""

    def __init__(self, tmp: Path, proxy: Interposer) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.pull = self.ctx.socket(zmq.PULL)
        inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        self.router.bind(inp)
        self.pull.bind(out)
        proxy.attach(inp, out)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, IDENT)
        self.push = self.ctx.socket(zmq.PUSH)
        self.dealer.connect(proxy.engine_addresses[0])
        self.push.connect(proxy.engine_addresses[1])
        for s in (self.router, self.pull, self.dealer, self.push):
            s.setsockopt(zmq.RCVTIMEO, BOUND_MS)
            s.setsockopt(zmq.LINGER, 0)
        self.dealer.send_multipart([b"ready"])  # the engine speaks first
        assert self.router.recv_multipart() == [IDENT, b"ready"]

    def to_engine(self, *payloads: bytes) -> list[list[bytes]]:
        """Send ADDs with these payloads; the messages the engine end receives."""
        for p in payloads:
            self.router.send_multipart([IDENT, RequestType.ADD.value + p])
        return [self.dealer.recv_multipart() for _ in payloads]

    def close(self) -> None:
        for s in (self.router, self.pull, self.dealer, self.push):
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[object]:
    made: list[tuple[Ends, Interposer]] = []

    def build(*rules: FrameRule, seed: int = 0) -> tuple[Ends, Interposer]:
        proxy = Interposer(list(rules), seed=seed).start()
        ends = Ends(tmp_path, proxy)
        made.append((ends, proxy))
        return ends, proxy

    yield build
    for ends, proxy in made:
        ends.close()
        proxy.close()


def test_clean_proxy_forwards_both_ways(make: object) -> None:
    ends, proxy = make()  # type: ignore[operator]
    assert ends.to_engine(b"a", b"b") == [[b"\x00a"], [b"\x00b"]]
    ends.push.send_multipart([b"\x91\x00"])
    assert ends.pull.recv_multipart() == [b"\x91\x00"]
    assert proxy.events == []


def test_drop_and_duplicate_by_kind(make: object) -> None:
    rules = (FrameRule(action=FrameAction.DROP, direction=Direction.TO_ENGINE,
                       kind=FrameKind.ADD),
             FrameRule(action=FrameAction.DUPLICATE, direction=Direction.TO_ENGINE))
    ends, proxy = make(*rules)  # type: ignore[operator]
    ends.router.send_multipart([IDENT, RequestType.ADD.value + b"lost"])
    ends.router.send_multipart([IDENT, RequestType.ABORT.value + b"twice"])
    assert ends.dealer.recv_multipart() == [b"\x01twice"]
    assert ends.dealer.recv_multipart() == [b"\x01twice"]
    assert proxy.events == [("to_engine", "add", "drop"), ("to_engine", "abort", "duplicate")]


def test_reorder_swaps_with_the_next_message(make: object) -> None:
    rule = FrameRule(action=FrameAction.REORDER, direction=Direction.TO_ENGINE)
    ends, _ = make(rule)  # type: ignore[operator]
    assert [f[0][1:] for f in ends.to_engine(b"first", b"second")] == [b"second", b"first"]


def test_truncate_and_bitflip_are_seeded(make: object) -> None:
    payload = bytes(range(16))
    rule = FrameRule(action=FrameAction.BITFLIP, direction=Direction.TO_ENGINE, count=None)
    flips = []
    for _ in range(2):
        ends, _ = make(rule, seed=7)  # type: ignore[operator]
        ((first,),) = ends.to_engine(payload)
        assert first[:1] == RequestType.ADD.value  # the type byte is kept: it still routes
        got = first[1:]
        diff = [i for i in range(16) if got[i] != payload[i]]
        assert len(diff) == 1 and bin(got[diff[0]] ^ payload[diff[0]]).count("1") == 1
        flips.append(got)
        ends.close()
        _.close()
    assert flips[0] == flips[1]  # same seed, same bit
    ends, _ = make(FrameRule(action=FrameAction.TRUNCATE, kind=FrameKind.ADD))  # type: ignore[operator]
    assert ends.to_engine(payload) == [[b"\x00" + payload[:8]]]


def test_skip_and_probability_zero(make: object) -> None:
    rules = (FrameRule(action=FrameAction.DROP, kind=FrameKind.ADD, skip=1),
             FrameRule(action=FrameAction.DROP, kind=FrameKind.ADD, probability=0.0,
                       count=None))
    ends, proxy = make(*rules)  # type: ignore[operator]
    assert ends.to_engine(b"kept") == [[b"\x00kept"]]
    ends.router.send_multipart([IDENT, RequestType.ADD.value + b"dropped"])
    assert ends.to_engine(b"third") == [[b"\x00third"]]
    assert proxy.events == [("to_engine", "add", "drop")]


def test_output_kinds_are_read_from_the_encoded_batch() -> None:
    # Tokens travel as output structs or as the columnar stream lists; both are TOKENS.
    from enginewire.protocol.codec import Encoder
    from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs, UtilityOutput
    from enginewire.testing.interposer import _kind_to_client

    def kind(batch: EngineCoreOutputs) -> FrameKind:
        return _kind_to_client([bytes(f) for f in Encoder().encode_into(batch, bytearray())],
                               False)

    assert kind(EngineCoreOutputs(engine_index=0)) is FrameKind.HEARTBEAT
    assert kind(EngineCoreOutputs(engine_index=0, outputs=[EngineCoreOutput("a", [1])])) is (
        FrameKind.TOKENS)
    assert kind(EngineCoreOutputs(engine_index=0, stream_ids=["a"], stream_tokens=[1])) is (
        FrameKind.TOKENS)
    assert kind(EngineCoreOutputs(engine_index=0, utility_output=UtilityOutput(call_id=1))) is (
        FrameKind.UTILITY)


def test_bad_addresses_and_reuse_are_refused_not_a_dead_thread(tmp_path: Path) -> None:
    """A malformed address, a second attach and a start after close raise in the caller; the
    proxy thread never dies unseen (it used to, leaving the client to its ready deadline)."""
    died: list[threading.ExceptHookArgs] = []
    old_hook = threading.excepthook
    threading.excepthook = died.append
    try:
        proxy = Interposer([], seed=0).start()
        with pytest.raises(TypeError, match="client_input"):
            proxy.attach(5, f"ipc://{tmp_path}/out")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="cannot connect"):
            proxy.attach("ipc:/no-slashes", f"ipc://{tmp_path}/out")
        assert proxy._thread is not None and not proxy._thread.is_alive()  # closed by it
        with pytest.raises(RuntimeError, match="after close"):
            proxy.attach(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
        closed = Interposer([], seed=0)
        closed.close()
        with pytest.raises(RuntimeError, match="after close"):
            closed.start()
        with Interposer([], seed=0) as twice:
            twice.attach(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
            with pytest.raises(RuntimeError, match="twice"):
                twice.attach(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    finally:
        threading.excepthook = old_hook
    assert not died, f"a proxy thread died: {died[0].exc_value!r}"
    assert not [t for t in threading.enumerate() if t.name == "Interposer"]
