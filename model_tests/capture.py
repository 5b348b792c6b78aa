"""Capture files: what a relay (the monitor, model_tests/monitor.py, or the interposer,
model_tests/interposer.py) sent on, message by message, for ``enginewire monitor --replay``.

Format (all little-endian): ``b"EWMONCAP"``, a u16 version, the wire's name (u8 length,
ascii: a key of ``WIRES``); then one record per message, ``link u8 | time f64 | frame count
u32 | (length u32 | bytes) per frame | crc32 u32`` (the CRC over the record before it), and
an end record (link 255, no frame) when the relay stops cleanly. ``Link`` says which way a
message went. A cut or corrupt file is a ``ProtocolError`` naming the byte.

Both relays import this module, and neither the other: the format is theirs in common.
"""

from __future__ import annotations

import contextlib
import enum
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ..spec.errors import ProtocolError

__all__ = ["CAPTURE_VERSION", "WIRES", "CaptureWriter", "Link", "read_capture", "wire_of"]


class Link(enum.IntEnum):
    """Which way a forwarded message went, as a relay's tap is told and a capture records it:
    the ready handshake travels on the input pair."""

    TO_ENGINE = 0
    OUTPUT = 1  # engine -> client, on the output pair (outputs, replies, the sentinel)
    READY = 2  # engine -> client, on the input pair
    DISCONNECT = 3  # no message: the engine's input connection went away (no frames)


# The monitor's wire names (the CLI's --wire) -> the interposer's name for the same frames.
WIRES = {"enginewire": "enginewire", "vllm-0.33": "vllm"}


def wire_of(interposer_wire: str) -> str:
    """The monitor's name for the wire the interposer calls ``interposer_wire``."""
    return next(k for k, v in WIRES.items() if v == interposer_wire)


_MAGIC = b"EWMONCAP"
CAPTURE_VERSION = 1
_HEAD = struct.Struct("<H B")
_RECORD = struct.Struct("<B d I")
_U32 = struct.Struct("<I")
_END = 255
# A frame longer than this in a capture is corruption, not traffic (the engine's own bound on
# a frame is far below it).
_MAX_FRAME = 1 << 31
_LINKS = frozenset(int(link) for link in Link)


class CaptureWriter:
    """Writes messages as they were relayed, in the format of the module docstring."""

    def __init__(self, path: str | Path, wire: str) -> None:
        name = wire.encode("ascii")
        self._f: IO[bytes] = open(path, "wb")  # closed by close()
        self._f.write(_MAGIC + _HEAD.pack(CAPTURE_VERSION, len(name)) + name)

    def write(self, link: int, frames: list[bytes], at: float) -> None:
        parts = [_RECORD.pack(link, at, len(frames))]
        for f in frames:
            parts += (_U32.pack(len(f)), f)
        record = b"".join(parts)
        self._f.write(record + _U32.pack(zlib.crc32(record)))

    def close(self, at: float) -> None:
        """Writes the end record; idempotent (closed even when that write fails)."""
        if not self._f.closed:
            try:
                self.write(_END, [], at)
            finally:
                with contextlib.suppress(OSError):
                    self._f.close()


def read_capture(path: str | Path) -> tuple[str, Iterator[tuple[Link, list[bytes], float]], list[
        float]]:
    """The capture's wire, its records (link, frames, time) as an iterator, and a list that
    holds the end record's time once the iterator is exhausted (empty: the monitor did not
    stop cleanly). A cut or corrupt file raises ``ProtocolError`` naming the byte, as the
    header is read or as the iterator reaches it."""
    data = Path(path).read_bytes()
    if data[:len(_MAGIC)] != _MAGIC:
        raise ProtocolError(f"{path}: not a monitor capture (no {_MAGIC!r} header)")
    pos = len(_MAGIC)
    if len(data) < pos + _HEAD.size:
        raise ProtocolError(f"{path}: cut inside its header")
    version, n = _HEAD.unpack_from(data, pos)
    if version != CAPTURE_VERSION:
        raise ProtocolError(f"{path}: capture version {version}; this monitor reads"
                            f" {CAPTURE_VERSION}")
    pos += _HEAD.size
    wire = data[pos:pos + n].decode("ascii", "replace")
    if wire not in WIRES:
        raise ProtocolError(f"{path}: capture of an unknown wire {wire!r}")
    pos += n
    ended: list[float] = []

    def records() -> Iterator[tuple[Link, list[bytes], float]]:
        at = pos
        while at < len(data):
            start = at
            if len(data) - at < _RECORD.size:
                raise ProtocolError(f"{path}: cut at byte {at} (inside a record's head)")
            link, ts, count = _RECORD.unpack_from(data, at)
            at += _RECORD.size
            frames = []
            for _ in range(count):
                if len(data) - at < _U32.size:
                    raise ProtocolError(f"{path}: cut at byte {at} (inside the record at"
                                        f" byte {start})")
                (size,) = _U32.unpack_from(data, at)
                at += _U32.size
                if size > len(data) - at or size > _MAX_FRAME:
                    raise ProtocolError(f"{path}: the record at byte {start} holds a frame of"
                                        f" {size} bytes, past the file's end (cut or corrupt)")
                frames.append(data[at:at + size])
                at += size
            if len(data) - at < _U32.size:
                raise ProtocolError(f"{path}: cut at byte {at} (the record at byte {start}"
                                    " has no checksum)")
            (crc,) = _U32.unpack_from(data, at)
            if zlib.crc32(data[start:at]) != crc:
                raise ProtocolError(f"{path}: the record at byte {start} is corrupt (checksum)")
            at += _U32.size
            if link == _END:
                ended.append(ts)
                return
            if link not in _LINKS:
                raise ProtocolError(f"{path}: the record at byte {start} has link {link}")
            yield Link(link), frames, ts

    return wire, records(), ended
