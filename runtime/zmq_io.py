"""ZMQ socket I/O for encoded messages: sending frames, reading the rest of a message, and
payload buffers that are reused only once libzmq is done with them.

Theory of operation
-------------------
``protocol`` turns values into frames and frames into values and touches no socket; this
module moves those frames. The engine process and the clients send and receive through it
(and through pyzmq directly where a path needs a poll or a socket option).

Rule 1: a payload buffer from ``Encoder.encode_into`` is reused only after ZMQ released it:
send the payload as its own tracked frame (``send_frames``) and hand the tracker to
``BufferPool``. pyzmq's ``send_multipart`` tracks only its *last* frame; vLLM reused buffers
on that basis and corrupted outputs under load.
Rule 2: a message is read whole or refused whole (``recv_rest``): parts past the bound are
read and dropped, so the socket stays in step with the peer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..spec.errors import ProtocolError

if TYPE_CHECKING:
    import zmq

__all__ = [
    "ZMQ_NOBLOCK",
    "ZMQ_POLLIN",
    "ZMQ_RCVMORE",
    "ZMQ_SNDMORE",
    "BufferPool",
    "backend_send",
    "recv_rest",
    "send_frames",
]


class BufferPool:
    """Payload buffers for ``Encoder.encode_into``, handed out again only once ZMQ is done.

    ``release(buf, tracker)`` parks a buffer until ``tracker.done``; pyzmq copies frames below
    its copy threshold (64 KiB) and returns an already-done tracker, so small payloads come
    back at once and large zero-copy ones only when libzmq freed the message.
    """

    def __init__(self, max_free: int = 8) -> None:
        self.max_free = max_free
        self._free: list[bytearray] = []
        self._pending: deque[tuple[bytearray, zmq.MessageTracker]] = deque()

    def acquire(self) -> bytearray:
        self._reclaim()
        if self._free:
            return self._free.pop()
        return bytearray()

    def release(self, buf: bytearray, tracker: zmq.MessageTracker | None) -> None:
        if tracker is None or tracker.done:
            self._keep(buf)
        else:
            self._pending.append((buf, tracker))

    @property
    def pending(self) -> int:
        """Buffers ZMQ may still be reading."""
        return len(self._pending)

    @property
    def free(self) -> int:
        return len(self._free)

    def _keep(self, buf: bytearray) -> None:
        if len(self._free) < self.max_free:
            self._free.append(buf)

    def _reclaim(self) -> None:
        pending = self._pending
        for _ in range(len(pending)):
            buf, tracker = pending.popleft()
            if tracker.done:
                self._keep(buf)
            else:
                pending.append((buf, tracker))


# libzmq's flag and option numbers (part of its ABI; a test holds them equal to pyzmq's), for
# every per-message path (here, the clients, the engine). Plain ints: this module does not
# import zmq at load (an import statement per send cost about a microsecond), and pyzmq's
# constants are enums whose every use in a flag test builds a new member (about 1 µs).
ZMQ_NOBLOCK = 1
ZMQ_SNDMORE = 2
ZMQ_POLLIN = 1
ZMQ_RCVMORE = 13

_BACKEND_SEND: dict[type, Callable[..., Any]] = {}


def backend_send(cls: type) -> Callable[..., Any]:
    """``cls.send`` minus pyzmq's Python-level wrapper, called as ``send(sock, data, flags)``.

    ``zmq.Socket.send`` is a Python method that handles the draft ``routing_id``/``group``
    arguments (unused here) and then calls the compiled backend's ``send``: taking the
    backend's directly saves a Python frame per message part (0.7 µs warm, several cold on a
    round trip). The most basic class defining ``send`` is that backend."""
    fn = _BACKEND_SEND.get(cls)
    if fn is None:
        fn = next(vars(k)["send"] for k in reversed(cls.__mro__) if "send" in vars(k))
        _BACKEND_SEND[cls] = fn
    return fn


def send_frames(
    sock: zmq.Socket[Any],
    frames: Sequence[Any],
    *,
    prefix: Sequence[bytes] = (),
    track: bool = False,
    flags: int = 0,
) -> zmq.MessageTracker | None:
    """Send ``[*prefix, payload, aux...]``; with ``track``, return the *payload's* tracker.
    ``flags`` (e.g. ``ZMQ_NOBLOCK``) apply to the first frame sent, which decides for the
    whole message.

    Frames below the socket's ``copy_threshold`` are copied (a plain ``send`` costs a fraction
    of a tracked zero-copy one, and the buffer is free again at once: the tracker is then
    None). Larger frames go zero-copy (pyzmq keeps an aux array alive until libzmq is done).
    """
    more = ZMQ_SNDMORE
    send = backend_send(type(sock))
    first = flags
    for p in prefix:
        send(sock, p, more | first)
        first = 0
    threshold = sock.copy_threshold
    last = len(frames) - 1
    tracker: zmq.MessageTracker | None = None
    for i, frame in enumerate(frames):
        f = (more if i < last else 0) | first
        first = 0
        # A memoryview's len counts items, not bytes.
        size = frame.nbytes if type(frame) is memoryview else len(frame)
        if size < threshold:
            send(sock, frame, f)
        elif i == 0 and track:
            tracker = send(sock, frame, f, copy=False, track=True)
        else:
            send(sock, frame, f, copy=False)
    return tracker


def recv_rest(sock: zmq.Socket[Any], frames: list[Any],
              max_frames: int | None = None) -> list[Any]:
    """Append the rest of a message whose first part was received and said more follows
    (zero-copy; the parts of a message arrive together, so this never waits).

    With ``max_frames``, parts past that count are read one by one and released as they are
    read, never held together, and the message is refused (``ProtocolError``) once it is
    all read, so the socket stays in step. (libzmq delivers a multi-part message only once
    every part has arrived: what it holds until then is bounded by ``ZMQ_MAXMSGSIZE`` per
    part only; docs/security.md.)"""
    recv = sock.recv
    while True:
        frame = recv(0, copy=False)
        if max_frames is None or len(frames) < max_frames:
            frames.append(frame)
        else:
            extra = 1
            while frame.more:
                frame = recv(0, copy=False)  # the previous part is released here
                extra += 1
            raise ProtocolError(f"expected at most {max_frames} frames in a message, got"
                                f" {len(frames) + extra} (the rest were read and dropped)")
        if not frame.more:
            return frames
