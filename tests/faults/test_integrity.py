"""runtime/integrity.py: seq/ack/CRC trailers detect loss, duplication, reorder, corruption."""

from __future__ import annotations

import pytest

from enginewire.runtime.integrity import LinkIntegrity
from enginewire.spec import ProtocolError


class FakeClock:
    """A monotonic clock the test advances by hand: no real waiting for deadlines."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sealed(link: LinkIntegrity, *frames: bytes) -> list[bytes]:
    return [*frames, link.seal(frames)]


def test_round_trip_strips_the_trailer() -> None:
    a, b = LinkIntegrity(), LinkIntegrity()
    for i in range(3):
        assert b.open(sealed(a, b"\x00", f"payload {i}".encode(), b"aux")) == [
            b"\x00", f"payload {i}".encode(), b"aux"]


@pytest.mark.parametrize("mangle", ["bitflip", "truncate", "trailer"])
def test_corruption_is_a_protocol_error(mangle: str) -> None:
    a, b = LinkIntegrity(), LinkIntegrity()
    msg = sealed(a, b"\x00", bytes(range(40)))
    if mangle == "bitflip":
        msg[1] = msg[1][:7] + bytes([msg[1][7] ^ 0x04]) + msg[1][8:]
    elif mangle == "truncate":
        msg[1] = msg[1][:20]
    else:
        msg[2] = msg[2][:-1] + bytes([msg[2][-1] ^ 1])
    with pytest.raises(ProtocolError, match="checksum"):
        b.open(msg)


def test_loss_duplicate_and_reorder_are_protocol_errors() -> None:
    a = LinkIntegrity()
    m1, m2, m3 = (sealed(a, f"m{i}".encode()) for i in range(3))
    lossy = LinkIntegrity()
    lossy.open(m1)
    with pytest.raises(ProtocolError, match="lost"):
        lossy.open(m3)
    dup = LinkIntegrity()
    dup.open(m1)
    with pytest.raises(ProtocolError, match="duplicated or reordered"):
        dup.open(m1)
    swapped = LinkIntegrity()
    with pytest.raises(ProtocolError, match="lost"):
        swapped.open(m2)


def test_an_unsealed_peer_is_refused_loudly() -> None:
    with pytest.raises(ProtocolError, match="trailer"):
        LinkIntegrity().open([b"\x93\x00\x90\x00"])
    with pytest.raises(ProtocolError, match="trailer"):
        LinkIntegrity().open([b"payload", b"not a trailer"])


def test_an_input_the_engine_never_acknowledges_is_lost() -> None:
    clock = FakeClock()
    client = LinkIntegrity(loss_deadline_s=2.0, clock=clock)
    engine = LinkIntegrity()
    client.seal([b"add"])  # dropped on the way: the engine never opens it
    clock.now += 1.9
    client.open(sealed(engine, b"beat"))  # young: still in flight, no verdict yet
    clock.now += 0.2
    with pytest.raises(ProtocolError, match="never reached the engine"):
        client.open(sealed(engine, b"beat"))


def test_unacknowledged_inputs_cost_one_entry_per_run_not_per_message() -> None:
    """An idle engine without heartbeats acks nothing: 300k aborts used to keep 300k entries."""
    clock = FakeClock()
    client = LinkIntegrity(loss_deadline_s=2.0, clock=clock)
    engine = LinkIntegrity()
    for _ in range(1000):  # 0.5 s of sends, one per 0.5 ms: runs of 0.25 s
        engine.open(sealed(client, b"abort"))
        clock.now += 0.0005
    assert len(client._unacked) <= 3
    client.open(sealed(engine, b"beat"))  # acks all 1000
    assert not client._unacked


def test_a_loss_inside_a_run_is_reported_on_time_never_early() -> None:
    clock = FakeClock()
    client = LinkIntegrity(loss_deadline_s=2.0, clock=clock)
    engine = LinkIntegrity()
    engine.open(sealed(client, b"add"))  # arrives
    clock.now += 0.2
    client.seal([b"abort"])  # same run, lost on the way
    clock.now += 1.9  # the lost one is 1.9 s old: no verdict yet
    client.open(sealed(engine, b"beat"))  # acks only the first
    clock.now += 0.3  # 2.2 s old: lost
    with pytest.raises(ProtocolError, match="never reached the engine"):
        client.open(sealed(engine, b"beat"))


def test_acknowledged_inputs_are_forgotten() -> None:
    clock = FakeClock()
    client = LinkIntegrity(loss_deadline_s=2.0, clock=clock)
    engine = LinkIntegrity()
    engine.open(sealed(client, b"add"))
    clock.now += 5.0
    client.open(sealed(engine, b"tokens"))  # acks message 1: nothing outstanding
    clock.now += 5.0
    client.open(sealed(engine, b"beat"))  # and it is never reported as lost later


def test_an_ack_beyond_what_was_sent_is_refused() -> None:
    client = LinkIntegrity(loss_deadline_s=1.0)
    client.seal([b"add"])
    rogue = LinkIntegrity()
    rogue._received = 5  # claims to have seen five messages
    with pytest.raises(ProtocolError, match="only 1 sent"):
        client.open(sealed(rogue, b"x"))


@pytest.mark.parametrize("sent", [0, 1, 3])
def test_an_ack_one_past_the_last_sent_is_refused_an_ack_of_it_is_not(sent: int) -> None:
    """The boundary: acknowledging the last message sent is normal; acknowledging the next one,
    never sent, means the peer's counters belong to another session (or it lies)."""
    for ack, ok in ((sent, True), (sent + 1, False)):
        client = LinkIntegrity(loss_deadline_s=2.0)
        for _ in range(sent):
            client.seal([b"add"])
        peer = LinkIntegrity()
        peer._received = ack  # the peer's ack rides in every trailer it seals
        if ok:
            assert client.open(sealed(peer, b"x")) == [b"x"]
            assert not client._unacked  # everything sent is acknowledged
        else:
            with pytest.raises(ProtocolError, match=f"acknowledged message {ack}, only {sent}"):
                client.open(sealed(peer, b"x"))
