"""Keeping the engine's two connecting sockets usable: mending a link libzmq gave up on.

``Link`` tells the socket's owner when a dropped link needs connecting again by hand
(``reconnect``), ``send_reconnecting`` is a blocking send that mends as it retries, and
``Wakeup`` lets the monitor thread wake the owner's poll when a link drops or comes up.
Separate from runtime/engine_proc.py because it is libzmq plumbing with no engine state;
both IO halves (runtime/_engine_input.py, runtime/_engine_output.py) use it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

T = TypeVar("T")

# A dropped link is mended by hand only when libzmq has not said within this long that it
# reconnects by itself (it says so at once: a retry event right after the drop).
DROP_GRACE_S = 0.25
# libzmq's reconnect interval for the engine's two connecting sockets, first and longest (ms):
# its default, 100 ms plus up to 100 ms of jitter, was most of a handover once the ready went
# out at the handshake. Retries back off to the longest, as often as the default's.
RECONNECT_IVL_MS = 10
RECONNECT_IVL_MAX_MS = 100


class Wakeup:
    """A self-pipe another thread can wake a ``zmq.Poller`` with; any thread may ``set()``,
    even after ``close()`` (then it does nothing: the fd number may belong to a new file)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending
                    os.write(self._w, b"\0")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._r, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._r)
                os.close(self._w)


class Link:
    """Whether a connecting socket's link needs mending by hand (the monitor thread reports,
    the socket's owner asks).

    After a peer left libzmq reconnects by itself (a retry event, later a handshake); after
    a protocol error (a refused handshake, a frame over MAXMSGSIZE) it gives up, and the
    owner must connect again. Not while libzmq retries: its ``disconnect`` leaves the
    pending retry alive (libzmq 4.3.5), so the next peer gets two connections, over which
    messages are split and reordered (a front end with frame integrity saw them as lost).
    """

    __slots__ = ("_dropped_at",)

    def __init__(self) -> None:
        self._dropped_at: float | None = None

    def drop(self) -> None:
        if self._dropped_at is None:
            self._dropped_at = time.monotonic()

    def mend(self) -> None:
        self._dropped_at = None

    def due_in(self) -> float | None:
        """Seconds until ``take_due`` turns true; None while the link is not down."""
        at = self._dropped_at
        return None if at is None else max(0.0, at + DROP_GRACE_S - time.monotonic())

    def take_due(self) -> bool:
        """True (once) when the link dropped DROP_GRACE_S ago and libzmq is not on it."""
        at = self._dropped_at
        if at is None or time.monotonic() - at < DROP_GRACE_S:
            return False
        self._dropped_at = None
        return True


def reconnect(sock: zmq.Socket[Any], address: str) -> None:
    with contextlib.suppress(zmq.ZMQError):  # already gone: nothing to undo
        sock.disconnect(address)
    sock.connect(address)


class SendAbandoned(Exception):
    """A send still blocked past the engine's stop deadline: its peer is gone or stalled."""


def send_reconnecting(
    sock: zmq.Socket[Any], address: str, link: Link, send: Callable[[], T],
    give_up: Callable[[], bool] | None = None,
) -> T:
    """``send()`` under the socket's SNDTIMEO, connecting again whenever the link dropped
    for good (a peer with no pipe would otherwise block the send for good). ``give_up``
    (asked at each SNDTIMEO) ends the retries with ``SendAbandoned``: a stopping engine
    must not wait on a peer that no longer reads."""
    while True:
        if link.take_due():
            reconnect(sock, address)
        try:
            return send()
        except zmq.Again:
            if give_up is not None and give_up():
                raise SendAbandoned from None
            continue
