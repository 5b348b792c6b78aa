"""A front end's attach phase (spec/attach.py): the ATTACH under a fresh session, and the
reader's path until the engine's marker names it. A mixin of ``MPClient``.

Everything that arrives before the marker is a previous front end's (an engine started on its
own outlives its front ends): it is dropped unread, counted, and the phase loops. The marker
ends the phase, a refusal or an overdue deadline ends the client. The reader and the monitor
(the deadline) both move the phase, under one lock, so only the first of the two fires.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any

import zmq

from ..protocol.codec import DEFAULT_LIMITS, Encoder, decode_outputs, encode_input, is_dead_sentinel
from ..protocol.messages import SESSION_BYTES, AttachRequest, RequestType
from ..spec.attach import ATTACH_DROPS_MESSAGES, AttachEvent, AttachState
from ..spec.errors import ProtocolError
from ..spec.machine import Lifecycle
from ._background import BackgroundResources, EngineProcessDied
from .integrity import LinkIntegrity
from .zmq_io import ZMQ_RCVMORE, recv_rest

logger = logging.getLogger("enginewire.runtime.mp_client")  # one logger name for the client

# Parts of one engine message the client holds (payload, aux frames, integrity trailer):
# the rest of a longer one is read and released part by part, and the message refused.
MAX_PARTS = DEFAULT_LIMITS.max_frames + 1


class AttachSide:
    """The attach phase's state and steps; ``MPClient`` sets the attributes below."""

    attach_phase: Lifecycle[AttachState, AttachEvent]
    _attach_lock: threading.Lock
    _attaching: bytes | None  # the awaited session while the phase drops messages
    _stale: int  # messages dropped before the marker
    resources: BackgroundResources
    identity: bytes
    _encoder: Encoder
    _integrity: LinkIntegrity | None
    _ready_timeout: float
    _stamp_seen: bool
    client_index: int
    _session: bytes | None

    def _attach(self) -> None:
        """Take the engine over under a fresh session (protocol/messages.py, "Attaching"):
        ATTACH goes out first, and the reader drops whatever arrives before the engine's
        marker (a previous front end's outputs) unread."""
        res = self.resources
        assert res.input_socket is not None
        session = os.urandom(SESSION_BYTES)
        res.attach_deadline[0] = time.monotonic() + self._ready_timeout
        self._attach_step(AttachEvent.SEND_ATTACH, session)
        # Unsealed even with frame integrity: it starts the engine's counts afresh.
        attach = AttachRequest(session, integrity=self._integrity is not None,
                               client_index=self.client_index)
        self._session = session  # a goodbye names it (an engine serving several front ends)
        res.input_socket.send_multipart(
            [self.identity, *encode_input(self._encoder, RequestType.ATTACH, attach)])

    def _before_marker(self, first: bytes, sock: zmq.Socket[Any]) -> bool:
        """``_on_message`` until the attach marker: only the marker and the sentinel count.
        False when the phase had already ended (the message is then read as any other)."""
        if self.attach_phase.state not in ATTACH_DROPS_MESSAGES:
            # A Ctrl-C raised into this thread between the phase's step and the stores after
            # it left ``_attaching`` set: finish them, or every reply would be dropped.
            self._after_attach_step()
            return False
        frames = recv_rest(sock, [first], MAX_PARTS) if sock.get(ZMQ_RCVMORE) else [first]
        if self._stamp_seen:
            self.resources.last_seen[0] = time.monotonic()  # a message: the engine is alive
        if is_dead_sentinel(frames):
            raise EngineProcessDied(
                "the engine said it is gone (engine-dead sentinel: a fatal error, or an engine"
                " started on its own stopped by a signal); see the engine's log")
        session = self._attaching
        if session is not None and self._is_marker(frames, session):
            if not self._attach_step(AttachEvent.MARKER):
                return True  # the monitor found it overdue first: this client is dead already
            if self._stale:
                logger.info("dropped %d message(s) sent before this front end attached",
                            self._stale)
            return True
        self._stale += 1
        self._attach_step(AttachEvent.FOREIGN_MESSAGE)
        if time.monotonic() > self.resources.attach_deadline[0]:
            # Seen here at once when the engine speaks; the monitor sees it when it does not.
            raise self._marker_overdue()
        return True

    def _attach_step(self, event: AttachEvent, session: bytes | None = None) -> bool:
        """Fire ``event`` on the attach phase if the phase allows it now (False: the other
        thread moved it first, e.g. the monitor's deadline against the reader's marker)."""
        with self._attach_lock:
            phase = self.attach_phase
            if not phase.can(event):
                return False
            phase.fire(event)
            if phase.state in ATTACH_DROPS_MESSAGES and session is not None:
                self._attaching = session
            self._after_attach_step()
            return True

    def _after_attach_step(self) -> None:
        """The caches the phase implies, stored after its step: no awaited session and no
        marker deadline once it stops dropping messages. Idempotent, so whoever finds them
        stale (an exception raised between the step and these stores) stores them again."""
        if self.attach_phase.state not in ATTACH_DROPS_MESSAGES:
            self._attaching = None
            self.resources.attach_deadline[0] = math.inf  # the monitor stops watching it

    def _deadline_still_due(self) -> bool:
        """The monitor saw the marker deadline pass: whether the phase still awaits the
        marker (else the reader took it and its store of the deadline was cut short)."""
        with self._attach_lock:
            if self.attach_phase.state in ATTACH_DROPS_MESSAGES:
                return True
            self._after_attach_step()
            return False

    def _marker_overdue(self) -> ProtocolError:
        """The cause of death when the marker has not come within ``ready_timeout_s``: the
        ATTACH was lost (a link that dropped just then) or the engine ignores it or hangs.
        Everything would be dropped (or awaited) for good."""
        self._attach_step(AttachEvent.DEADLINE)
        said = (f"though the engine sent {self._stale} other message(s)" if self._stale
                else "and the engine sent nothing else")
        return ProtocolError(
            f"no attach marker within {self._ready_timeout:g} s (ready_timeout_s) of this"
            f" front end's ATTACH, {said}")

    def _is_marker(self, frames: list[bytes], session: bytes) -> bool:
        """Whether ``frames`` is the attach marker for ``session``; anything else before it
        is not this front end's, so it is neither checked nor read further."""
        integrity = self._integrity
        body = frames[:-1] if integrity is not None and len(frames) > 1 else frames
        try:
            marker = decode_outputs(body)
        except ProtocolError:
            return False
        if marker.session != session:
            return False
        if marker.refusal is not None:  # never sealed: read whatever this side's setting
            self._attach_step(AttachEvent.REFUSAL)
            raise ProtocolError(f"the engine refused this front end: {marker.refusal}")
        if integrity is not None:
            integrity.open(frames)  # the session's first sealed message: seq 1
        return True
