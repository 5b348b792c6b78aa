"""Optional per-message integrity: a sequence number, an acknowledgement and a CRC-32.

Why: ZMQ over ipc neither loses, reorders nor corrupts, so the base protocol carries no such
checks, and a frame mangled anyway (a proxy, a bug, the fault harness's interposer) could
stall a request or deliver a wrong token *silently*. With integrity on, every message except
the engine-dead sentinel, the ready handshake and ``ATTACH`` ends with one 24-byte trailer
frame::

    b"EWS1" | seq (u64 LE) | ack (u64 LE) | crc32 (u32 LE)

``seq`` counts this direction's messages from 1 (from 1 again in each session: ``ATTACH``
restarts the engine's receiving count, the attach marker its sending count); ``ack`` is the
last ``seq`` received the other way; the CRC covers every frame before the trailer and the
trailer's first 20 bytes. The receiver strips the trailer and raises ``ProtocolError`` on a
missing trailer, a bad CRC (corruption, truncation) or a ``seq`` other than the next one
(loss, duplication, reorder).
The client also watches the engine's ``ack``: a message the engine has not acknowledged
within ``loss_deadline_s`` while later outputs (heartbeats) arrive was lost on the way in.

Compatibility: off unless both ends are told (client option ``frame_integrity=True``, which a
launched engine inherits). A peer that does not seal is refused at its first message, loudly.
Off by default: docs/faults.md has the cost measured against what it detects.
"""

from __future__ import annotations

import collections
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from ..spec.errors import ProtocolError

__all__ = ["DEFAULT_LOSS_DEADLINE_S", "TRAILER_MAGIC", "LinkIntegrity"]

# An input the engine has not acknowledged this long, while its later outputs arrive, was
# lost. Generous: the engine's input thread acks within milliseconds even under load.
DEFAULT_LOSS_DEADLINE_S = 2.0
TRAILER_MAGIC = b"EWS1"
_HEAD = struct.Struct("<4sQQ")
_TRAILER = struct.Struct("<4sQQI")


def _view(frame: Any) -> Any:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else frame


def _crc(frames: Sequence[Any], head: bytes) -> int:
    crc = 0
    for f in frames:
        crc = zlib.crc32(_view(f), crc)
    return zlib.crc32(head, crc)


class LinkIntegrity:
    """One end of a link: ``seal`` what it sends, ``open`` what it receives.

    ``seal`` and ``open`` may run on different threads (sender and reader), each on one.
    ``clock`` (seconds, monotonic) times the loss deadline; tests pass a fake one.
    """

    def __init__(
        self,
        loss_deadline_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._sent = 0
        self._received = 0
        self._loss_deadline = loss_deadline_s
        self._lock = threading.Lock()
        # Sent and not yet acknowledged, kept only with a loss deadline, as runs of messages
        # [last seq, first send time, last send time]: a run spans at most 1/8 of the
        # deadline, so an engine that sends nothing for a long while (no heartbeat) costs one
        # entry per run, not one per message. A run counts as lost once its last message is
        # overdue: never early, at most 1/8 of the deadline late.
        self._unacked: collections.deque[list[Any]] = collections.deque()
        self._run_span = (loss_deadline_s or 0.0) / 8

    def seal(self, frames: Sequence[Any], *, restart: bool = False) -> bytes:
        """The trailer frame to append to ``frames``; ``restart``: the first message of a new
        session (its ``seq`` is 1 again, and nothing sent before it is awaited any more)."""
        with self._lock:
            if restart:
                self._sent = 0
                self._unacked.clear()
            self._sent += 1
            seq = self._sent
            if self._loss_deadline is not None:
                now = self._clock()
                runs = self._unacked
                if runs and now - runs[-1][1] <= self._run_span:
                    run = runs[-1]
                    run[0], run[2] = seq, now
                else:
                    runs.append([seq, now, now])
        head = _HEAD.pack(TRAILER_MAGIC, seq, self._received)
        return _TRAILER.pack(TRAILER_MAGIC, seq, self._received, _crc(frames, head))

    def restart_receiving(self) -> None:
        """A new session begins on the receiving side: the next message is ``seq`` 1."""
        self._received = 0

    def open(self, frames: Sequence[Any]) -> list[Any]:
        """``frames`` without the trailer, or ``ProtocolError``."""
        if len(frames) < 2:
            raise ProtocolError("message without an integrity trailer (is the peer sealing?)")
        raw = bytes(_view(frames[-1]))
        if len(raw) != _TRAILER.size or raw[:4] != TRAILER_MAGIC:
            raise ProtocolError("message without an integrity trailer (is the peer sealing?)")
        _, seq, ack, crc = _TRAILER.unpack(raw)
        body = list(frames[:-1])
        if _crc(body, raw[: _HEAD.size]) != crc:
            raise ProtocolError(f"message {seq}: checksum mismatch (corrupted or truncated)")
        expected = self._received + 1
        if seq != expected:
            what = "duplicated or reordered" if seq < expected else "messages were lost"
            raise ProtocolError(f"message {seq} arrived where {expected} was due ({what})")
        self._received = seq
        self._check_ack(ack)
        return body

    def _check_ack(self, ack: int) -> None:
        if self._loss_deadline is None:
            return
        now = self._clock()
        with self._lock:
            if ack > self._sent:
                raise ProtocolError(f"peer acknowledged message {ack}, only {self._sent} sent")
            while self._unacked and self._unacked[0][0] <= ack:
                self._unacked.popleft()
            if self._unacked and now - self._unacked[0][2] > self._loss_deadline:
                sent_at = self._unacked[0][2]
                raise ProtocolError(
                    f"message {ack + 1} (or one after it, the last sent {now - sent_at:.1f} s"
                    " ago) never reached the engine")
