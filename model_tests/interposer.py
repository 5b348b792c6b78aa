"""The frame interposer: a ZMQ proxy between a client and its engine that misbehaves on purpose.

Theory of operation
-------------------
The client binds its ROUTER (input) and PULL (output) as always. The interposer connects to
both, as the engine would (a DEALER with the engine's identity, and a PUSH), and binds its
own pair for the engine: a ROUTER at ``engine_input`` and a PULL at ``engine_output``. The
client launches its engine with ``engine_connect=interposer.engine_addresses``, so every
frame, the ready handshake included, crosses the proxy:

    client ROUTER <-> [DEALER | interposer | ROUTER] <-> engine DEALER   (to_engine, handshake)
    client PULL   <-  [PUSH   | interposer | PULL  ] <-  engine PUSH     (to_client)

One thread owns the four sockets. Each message is matched against the ``FrameRule`` list by
direction, kind and probability (one ``random.Random(seed)``, so a seed replays a run) and is
then forwarded, dropped, delayed, duplicated, held back behind the next message (reorder),
truncated or bit-flipped. ``events`` records every rule applied, for the report. Kinds are
read from enginewire's frames, or with ``wire="vllm"`` from vLLM 0.33's (``WIRES``: the
frame cells do so for a factory declaring ``Declared.VLLM_WIRE``, docs/vllm.md).

ZMQ over ipc neither loses nor reorders, so the spec requires every one of these to end as a
*detected* outcome (``ProtocolError``/dead engine, ERROR finish, failed utility), never a hang
and never a wrong token delivered silently. Loss, reorder and bit-flips are only detectable
with the seq/ack/CRC trailers (``frame_integrity=True``, runtime/integrity.py), so the fault
matrix's interposer cells run with them on.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import os
import random
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from msgspec.structs import force_setattr
from zmq.utils.monitor import recv_monitor_message

from ..protocol.messages import ENGINE_DEAD_SENTINEL, RequestType
from ..runtime.faults import as_member, check_count, check_real
from ..runtime.integrity import DEFAULT_LOSS_DEADLINE_S
from . import _cells as cells
from ._cells import Outcome
from ._conformance_driver import (
    Declared,
    declared_contract,
    declared_reason,
    left_behind_as_declared,
)
from ._harness import ResourceSnapshot
from .bounds import DEATH_BOUND_S
from .capture import CaptureWriter, Link, wire_of

__all__ = ["Direction", "FrameAction", "FrameKind", "FrameRule", "Interposer", "Link",
           "interposer_cells"]

_POLL_MS = 5
# Bounds start()/attach() waiting for the proxy thread's binds and connects, which take
# microseconds; only a wedged thread could reach it.
_SETUP_S = 5.0
# The attach marker's deadline is ready_timeout_s after the ATTACH (runtime/mp_client.py
# `_attach`), and the same option bounds the engine's start. So these cells run the null
# model, whose engine starts in ~0.4 s (tiny: 2-2.5 s at load 3 on 2 cores, and over 5 s at
# load 4, which failed a quick matrix as a startup error); what they check is the model-free
# hand-shake. Short enough that a lost-attach cell costs the quick matrix under 10 s.
ATTACH_READY_S = 5.0


class Direction(enum.StrEnum):
    TO_ENGINE = "to_engine"
    TO_CLIENT = "to_client"


class FrameKind(enum.StrEnum):
    """What a message is, read from its type byte (to the engine) or a shallow decode."""

    ADD = "add"
    ABORT = "abort"
    UTILITY = "utility"  # a call (to the engine) or its reply (to the client)
    READY = "ready"  # the engine's handshake (to the client, on the input pair)
    ATTACH = "attach"  # a front end's ATTACH (to the engine) or the engine's marker (back)
    TOKENS = "tokens"  # outputs carrying request outputs
    HEARTBEAT = "heartbeat"  # outputs with nothing in them
    SENTINEL = "sentinel"
    OTHER = "other"


class FrameAction(enum.StrEnum):
    DROP = "drop"
    DELAY = "delay"
    DUPLICATE = "duplicate"
    REORDER = "reorder"  # hold back until the next message in the same direction has gone
    TRUNCATE = "truncate"  # the payload cut in half (a request keeps its type byte)
    BITFLIP = "bitflip"  # one random bit of the payload flipped


class FrameRule(msgspec.Struct, frozen=True, kw_only=True):
    action: FrameAction
    direction: Direction | None = None  # None: both
    kind: FrameKind | None = None  # None: any
    probability: float = 1.0
    skip: int = 0  # let this many matching messages through first
    count: int | None = 1  # apply at most this often (None: no limit)
    delay_s: float = 0.2

    def __post_init__(self) -> None:
        # Enum fields take the member or its string value and are stored as the member, so
        # a rule written with strings matches like one written with members; a bad field
        # fails here, not in the proxy thread (where it would silence the link).
        force_setattr(self, "action", as_member(FrameAction, self.action, "FrameRule.action"))
        if self.direction is not None:
            force_setattr(self, "direction",
                          as_member(Direction, self.direction, "FrameRule.direction"))
        if self.kind is not None:
            force_setattr(self, "kind", as_member(FrameKind, self.kind, "FrameRule.kind"))
        force_setattr(self, "probability",
                      check_real(self.probability, "FrameRule.probability", high=1.0))
        check_count(self.skip, "FrameRule.skip")
        if self.count is not None:
            check_count(self.count, "FrameRule.count")
        force_setattr(self, "delay_s", check_real(self.delay_s, "FrameRule.delay_s"))


_TYPE_KINDS = {RequestType.ADD.value: FrameKind.ADD, RequestType.ABORT.value: FrameKind.ABORT,
               RequestType.UTILITY.value: FrameKind.UTILITY,
               RequestType.ATTACH.value: FrameKind.ATTACH}
_shallow = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class _OutputsLayout:
    """Where a wire's batch of outputs (a positional msgpack array, trailing defaults
    omitted) keeps what its kind is read from, and that wire's dead sentinel."""

    sentinel: bytes
    utility: int
    outputs: int = 1
    stream: int | None = None
    session: int | None = None


# The request type bytes are the same on both (vLLM's ADD 0x00, ABORT 0x01, UTILITY 0x03,
# reference §2.2); vLLM's clients send no 0x04.
WIRES = {
    # EngineCoreOutputs: [engine_index, outputs, timestamp, finished, stats, utility_output,
    # stream_ids, stream_tokens, session]. Tokens come as output structs, as the columnar
    # stream lists, or both.
    "enginewire": _OutputsLayout(ENGINE_DEAD_SENTINEL, utility=5, stream=6, session=8),
    # vLLM 0.33's (reference §2.5): [engine_index, outputs, scheduler_stats, timestamp,
    # utility_output, finished_requests, wave_complete, start_wave, weight_version]; its
    # sentinel is runtime/vllm_wire.py's VLLM_DEAD_SENTINEL (tests/vllm pins both).
    "vllm": _OutputsLayout(b"ENGINE_CORE_DEAD", utility=4),
}


def _kind_to_client(frames: list[bytes], handshake: bool,
                    layout: _OutputsLayout = WIRES["enginewire"]) -> FrameKind:
    if handshake:
        return FrameKind.READY
    if len(frames) == 1 and frames[0] == layout.sentinel:
        return FrameKind.SENTINEL
    try:
        value = _shallow.decode(frames[0])
    except Exception:
        return FrameKind.OTHER
    if not isinstance(value, list):
        return FrameKind.OTHER

    def at(i: int | None) -> Any:
        return value[i] if i is not None and len(value) > i else None

    if at(layout.utility) is not None:
        return FrameKind.UTILITY
    if at(layout.session) is not None:
        return FrameKind.ATTACH
    if at(layout.outputs) or at(layout.stream):
        return FrameKind.TOKENS
    return FrameKind.HEARTBEAT


_BURST = 256


def _no_write(link: Link, frames: list[bytes], at: float) -> None:
    """The capture's writer once it failed."""


def _burst(sock: zmq.Socket[Any]) -> list[list[bytes]]:
    """The messages ``sock`` holds now, at most ``_BURST``, without waiting."""
    out: list[list[bytes]] = []
    while len(out) < _BURST:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


@dataclass
class _RuleState:
    rule: FrameRule
    seen: int = 0
    applied: int = 0


def _remove_ipc_dir(path: str) -> None:
    for name in ("in", "out"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


@dataclass
class Interposer:
    """Start with ``start()`` (or ``with``), pass ``engine_addresses`` to the client as its
    ``engine_connect`` option after ``attach(client_input, client_output)``.

    Constructing one touches nothing outside the process: the ipc directory is made on first
    need (``start()`` or ``engine_addresses``), and removed by ``close()`` or, for a proxy
    never closed, when it is collected or the interpreter exits.
    """

    rules: list[FrameRule] = field(default_factory=list)
    seed: int = 0
    # The engine it stands in for: its identity on the client's ROUTER (a data-parallel
    # client's engine i answers as i).
    engine_index: int = 0
    # Whose frames it reads kinds from (``WIRES``): enginewire's, or vLLM 0.33's.
    wire: str = "enginewire"
    events: list[tuple[str, str, str]] = field(default_factory=list)
    # time.monotonic() of each entry in ``events``: detection latency starts there.
    applied_at: list[float] = field(default_factory=list)
    # Where the engine connects: None, an ipc directory of the proxy's own; else the
    # (input, output) pair to bind, ipc or tcp (the monitor's ``--engine``).
    engine_bind: tuple[str, str] | None = None
    # Told (link, frames) of every message as it is sent on, on the proxy thread, so it must
    # only hand it on (the monitor queues it for its judge: never a wait on the forwarding
    # path). The frames are those sent, after any rule.
    tap: Callable[[Link, list[bytes]], None] | None = None
    # A file to write every message sent on to, as the monitor's ``--capture`` does
    # (model_tests/capture.py): ``enginewire monitor --replay`` judges what a faulty link
    # delivered.
    capture: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rules, list | tuple):
            raise TypeError(f"Interposer.rules must be a list of FrameRule,"
                            f" got {type(self.rules).__name__} {self.rules!r}")
        for i, r in enumerate(self.rules):
            if not isinstance(r, FrameRule):
                raise TypeError(f"Interposer.rules[{i}] must be a FrameRule,"
                                f" got {type(r).__name__} {r!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"Interposer.seed must be an int, got {self.seed!r}")
        if isinstance(self.engine_index, bool) or not isinstance(self.engine_index, int) or not (
                0 <= self.engine_index < 1 << 16):
            raise ValueError(f"Interposer.engine_index={self.engine_index!r}: must be an"
                             " integer in [0, 65535]")
        if self.wire not in WIRES:
            raise ValueError(f"Interposer.wire={self.wire!r}: must be one of {sorted(WIRES)}")
        self._layout = WIRES[self.wire]
        self._identity = self.engine_index.to_bytes(2, "little")
        self._rng = random.Random(self.seed)
        self._states = [_RuleState(r) for r in self.rules]
        self._dir: str | None = None
        self._cleanup: weakref.finalize[[str], Interposer] | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._stop = threading.Event()
        self._client: tuple[str, str] | None = None
        self._attached = threading.Event()
        # Set by the proxy thread once its binds (then its connects) are done or failed, so a
        # bad address is raised by start()/attach() instead of killing the thread unseen.
        self._bound = threading.Event()
        self._connected = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._writer: Any = None
        self.capture_error: str | None = None

    @property
    def engine_addresses(self) -> tuple[str, str]:
        """The (input, output) pair the engine connects to (``engine_connect``)."""
        if self.engine_bind is not None:
            return self.engine_bind
        with self._lock:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="enginewire-ip-")
                # Holds the path, not self: a proxy never closed still leaves no directory.
                self._cleanup = weakref.finalize(self, _remove_ipc_dir, self._dir)
            return (f"ipc://{self._dir}/in", f"ipc://{self._dir}/out")

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Interposer:
        if self._thread is not None:
            raise RuntimeError("Interposer.start() called twice")
        if self._stop.is_set():
            raise RuntimeError("Interposer.start() after close(): build a new one")
        self.engine_addresses  # noqa: B018 -- made now, before the thread binds there
        if self.capture is not None:
            self._writer = CaptureWriter(self.capture, wire_of(self.wire))
        self._ctx = zmq.Context(io_threads=1)
        self._thread = threading.Thread(target=self._run, name="Interposer", daemon=True)
        self._thread.start()
        try:
            self._raise_failure(self._bound, "bind")
            if self._client is not None:
                self._raise_failure(self._connected, "connect to the client")
        except BaseException:
            self.close()
            raise
        return self

    def attach(self, client_input: str, client_output: str) -> None:
        """The client's bound addresses; the proxy connects there (the client binds first).

        Once started, returns after the connects: a malformed address is a ``ValueError``
        here (the proxy is then closed), not a proxy thread that died unseen."""
        for name, addr in (("client_input", client_input), ("client_output", client_output)):
            if not isinstance(addr, str):
                raise TypeError(f"Interposer.attach: {name} must be a str address,"
                                f" got {type(addr).__name__} {addr!r}")
        if self._stop.is_set():
            raise RuntimeError("Interposer.attach() after close()")
        if self._client is not None:
            raise RuntimeError("Interposer.attach() called twice")
        self._client = (client_input, client_output)
        self._attached.set()
        if self._thread is not None:
            try:
                self._raise_failure(self._connected, "connect to the client")
            except BaseException:
                self.close()
                raise

    def _raise_failure(self, done: threading.Event, what: str) -> None:
        # Bounded: the proxy thread only binds or connects before it sets these.
        if not done.wait(_SETUP_S) and self._failure is None:
            raise RuntimeError(f"Interposer: the proxy thread did not {what} within {_SETUP_S} s")
        if self._failure is not None:
            raise ValueError(f"Interposer: cannot {what}: {self._failure}") from self._failure

    def close(self) -> None:
        self._stop.set()
        self._attached.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._ctx is not None:
            t = threading.Thread(target=self._ctx.term, daemon=True)
            t.start()
            t.join(5.0)
        if self._writer is not None:
            self._writer.close(time.time())
        if self._cleanup is not None:
            self._cleanup()  # runs once: a second close() is a no-op

    def __enter__(self) -> Interposer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the proxy --------------------------------------------------------------------------

    def _match(self, direction: Direction, kind: FrameKind) -> FrameRule | None:
        with self._lock:
            for st in self._states:
                r = st.rule
                if r.direction is not None and r.direction != direction:
                    continue
                if r.kind is not None and r.kind != kind:
                    continue
                st.seen += 1
                if st.seen <= r.skip or (r.count is not None and st.applied >= r.count):
                    continue
                if self._rng.random() >= r.probability:
                    continue
                st.applied += 1
                self.events.append((direction.value, kind.value, r.action.value))
                self.applied_at.append(time.monotonic())
                return r
        return None

    def _mangle(self, frames: list[bytes], index: int, start: int,
                action: FrameAction) -> list[bytes]:
        """``frames[index]`` with its bytes from ``start`` on (the payload: a request's type
        byte before it is kept, so the message still goes where its kind says) cut in half
        or one bit flipped."""
        if index >= len(frames):
            return frames
        data = bytearray(frames[index])
        if action is FrameAction.TRUNCATE:
            data = data[: start + max(0, len(data) - start) // 2]
        elif len(data) > start:
            bit = self._rng.randrange((len(data) - start) * 8)
            data[start + bit // 8] ^= 1 << (bit % 8)
        return [*frames[:index], bytes(data), *frames[index + 1:]]

    def _run(self) -> None:
        ctx = self._ctx
        assert ctx is not None
        eng_in = ctx.socket(zmq.ROUTER)
        eng_out = ctx.socket(zmq.PULL)
        cli_in = ctx.socket(zmq.DEALER)
        cli_out = ctx.socket(zmq.PUSH)
        socks = (eng_in, eng_out, cli_in, cli_out)
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
        cli_in.setsockopt(zmq.IDENTITY, self._identity)
        watch: zmq.Socket[Any] | None = None
        try:
            try:
                eng_in.bind(self.engine_addresses[0])
                eng_out.bind(self.engine_addresses[1])
            except zmq.ZMQError as e:
                self._failure = e
                return
            finally:
                self._bound.set()
            self._attached.wait()
            if self._stop.is_set() or self._client is None:
                return
            try:
                cli_in.connect(self._client[0])
                cli_out.connect(self._client[1])
            except zmq.ZMQError as e:
                self._failure = e
                return
            finally:
                self._connected.set()
            poller = zmq.Poller()
            poller.register(eng_in, zmq.POLLIN)
            poller.register(eng_out, zmq.POLLIN)
            poller.register(cli_in, zmq.POLLIN)
            timed: list[tuple[float, int, Direction, list[bytes]]] = []
            held: dict[Direction, list[bytes] | None] = {d: None for d in Direction}
            order = itertools.count()

            tap, writer = self.tap, self._writer
            if writer is not None:
                user, write, clock = tap, writer.write, time.time

                def tap(link: Link, frames: list[bytes]) -> None:
                    nonlocal write
                    try:
                        write(link, frames, clock())
                    except OSError as e:  # a full disk ends the capture, never the relay
                        self.capture_error = str(e)
                        write = _no_write
                    if user is not None:
                        user(link, frames)
            if tap is not None:
                # The engine's input connection closing: a tap is told (a death without its
                # sentinel, or a reconnection, which a new ready then follows).
                watch = eng_in.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                poller.register(watch, zmq.POLLIN)

            def send(direction: Direction, frames: list[bytes]) -> None:
                link = Link.OUTPUT
                if direction is Direction.TO_ENGINE:
                    eng_in.send_multipart([self._identity, *frames])
                    link = Link.TO_ENGINE
                elif frames and frames[0] == b"\x00READY":
                    frames = frames[1:]
                    cli_in.send_multipart(frames)
                    link = Link.READY
                else:
                    cli_out.send_multipart(frames)
                if tap is not None:
                    tap(link, frames)

            def forward(direction: Direction, frames: list[bytes], kind: FrameKind) -> None:
                rule = self._match(direction, kind)
                action = rule.action if rule else None
                # The handshake travels on the input pair; tag it so send() routes it back.
                tag = [b"\x00READY"] if kind is FrameKind.READY else []
                # A request's payload follows its type byte: in the first frame
                # (enginewire's), or as the next frame (vLLM's, reference §2.3).
                index, payload_start = 0, 1 if direction is Direction.TO_ENGINE else 0
                if payload_start and len(frames) > 1 and len(frames[0]) == 1:
                    index, payload_start = 1, 0
                if action is FrameAction.DROP:
                    return
                if action in (FrameAction.TRUNCATE, FrameAction.BITFLIP):
                    frames = self._mangle(frames, index, payload_start, action)
                out = [*tag, *frames]
                if action is FrameAction.DELAY:
                    assert rule is not None
                    heapq.heappush(timed, (time.monotonic() + rule.delay_s, next(order),
                                           direction, out))
                    return
                if action is FrameAction.REORDER and held[direction] is None:
                    held[direction] = out
                    return
                send(direction, out)
                if action is FrameAction.DUPLICATE:
                    send(direction, out)
                prior = held[direction]
                if prior is not None and action is not FrameAction.REORDER:
                    held[direction] = None
                    send(direction, prior)

            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                now = time.monotonic()
                while timed and timed[0][0] <= now:
                    _, _, d, frames = heapq.heappop(timed)
                    send(d, frames)
                if watch is not None and watch in events:
                    recv_monitor_message(watch)
                    assert tap is not None
                    tap(Link.DISCONNECT, [])
                if eng_in in events:
                    # Only the ready travels this way (again after each reconnection).
                    _ident, *frames = eng_in.recv_multipart()
                    forward(Direction.TO_CLIENT, frames, FrameKind.READY)
                # Up to _BURST messages a side per poll: a busy stream is not paced by the
                # poll's round trip. Kinds are read only where a rule can match on them.
                for frames in _burst(eng_out):
                    forward(Direction.TO_CLIENT, frames,
                            _kind_to_client(frames, False, self._layout) if self._states
                            else FrameKind.OTHER)
                for frames in _burst(cli_in):
                    kind = _TYPE_KINDS.get(frames[0][:1] if frames else b"", FrameKind.OTHER)
                    forward(Direction.TO_ENGINE, frames, kind)
        finally:
            if watch is not None:
                with contextlib.suppress(zmq.ZMQError):
                    eng_in.disable_monitor()
                watch.close(linger=0)
            for s in socks:
                s.close(linger=0)


# --- matrix cells -----------------------------------------------------------------------------


def interposer_cells(clients: list[str], quick: bool, config: Any, *, factory: Any = None,
                     reference: list[int] | None = None) -> list[Any]:
    """Cells for ``run_fault_matrix``: one frame fault per (direction, kind, action).

    ``factory`` (a conformance ``ClientFactory``) builds each cell's client, given the proxy's
    addresses as options (it may refuse them: not applicable); ``reference`` is then its
    clean run's tokens."""
    kinds = [c for c in clients if c in ("sync", "async")]
    if not kinds:
        return []
    detected = {Outcome.DEAD, Outcome.ERROR_OUTPUT, Outcome.UTILITY_ERROR}
    # (rule, outcomes allowed, whether only the integrity trailers detect it)
    specs: list[tuple[FrameRule, set[Outcome], bool]] = [
        (FrameRule(action=FrameAction.DELAY, direction=Direction.TO_CLIENT,
                   kind=FrameKind.TOKENS, count=None, delay_s=0.05), {Outcome.OK}, False),
        (FrameRule(action=FrameAction.DELAY, direction=Direction.TO_CLIENT,
                   kind=FrameKind.READY, delay_s=0.3), {Outcome.OK}, False),
        (FrameRule(action=FrameAction.TRUNCATE, direction=Direction.TO_CLIENT,
                   kind=FrameKind.TOKENS, skip=1), detected, False),
        (FrameRule(action=FrameAction.DUPLICATE, direction=Direction.TO_ENGINE,
                   kind=FrameKind.ADD), detected, False),
        (FrameRule(action=FrameAction.TRUNCATE, direction=Direction.TO_ENGINE,
                   kind=FrameKind.UTILITY), detected | {Outcome.TIMEOUT}, False),
    ]
    # Loss, reorder and corruption are detected by the integrity trailers (seq/ack/CRC,
    # runtime/integrity.py), which every interposer cell turns on.
    specs += [
        (FrameRule(action=FrameAction.BITFLIP, direction=Direction.TO_CLIENT,
                   kind=FrameKind.TOKENS, skip=1), detected, True),
        (FrameRule(action=FrameAction.DROP, direction=Direction.TO_ENGINE,
                   kind=FrameKind.ADD), detected, True),
    ]
    if not quick:
        specs += [
            (FrameRule(action=FrameAction.TRUNCATE, direction=Direction.TO_ENGINE,
                       kind=FrameKind.ADD), detected, True),
            (FrameRule(action=FrameAction.BITFLIP, direction=Direction.TO_ENGINE,
                       kind=FrameKind.UTILITY), detected | {Outcome.TIMEOUT}, True),
            (FrameRule(action=FrameAction.DROP, direction=Direction.TO_CLIENT,
                       kind=FrameKind.UTILITY), detected | {Outcome.TIMEOUT}, False),
        ]
        specs += [
            (FrameRule(action=a, direction=d, kind=k, skip=1 if k is FrameKind.TOKENS else 0),
             detected, True)
            for d, k in ((Direction.TO_CLIENT, FrameKind.TOKENS),
                         (Direction.TO_ENGINE, FrameKind.ADD))
            for a in (FrameAction.DROP, FrameAction.REORDER, FrameAction.BITFLIP,
                      FrameAction.DUPLICATE)
            if not (d is Direction.TO_ENGINE and a is FrameAction.DUPLICATE)
        ]
    cells = []
    for kind in kinds if not quick else kinds[:1]:
        for rule, ok, trailers in specs:
            cells.append(_InterposerCell(kind, rule, frozenset(ok), config, factory=factory,
                                         reference=reference, needs_integrity=trailers))
    # A lost ATTACH (to the engine) or attach marker (back): every message is then dropped
    # as "before the marker", so only the marker's deadline can end it. Dead, and by that
    # deadline: not by the heartbeat (a live engine keeps beating) nor the loss deadline (no
    # ack is read before the marker). The lost ATTACH runs without a heartbeat, as a client
    # does by default: the engine's tokens are dropped and then it says nothing, so only the
    # monitor's timer ends it. The lost marker keeps the matrix's heartbeat: the reader drops
    # the beats and sees the deadline pass at one of them, if the timer has not fired first.
    # One costs a whole deadline, so --quick runs only the silent one.
    attach = [Direction.TO_ENGINE] if quick else list(Direction)
    for kind in kinds if not quick else kinds[:1]:
        for direction in attach:
            rule = FrameRule(action=FrameAction.DROP, direction=direction,
                             kind=FrameKind.ATTACH)
            cells.append(_InterposerCell(kind, rule, frozenset({Outcome.DEAD}),
                                         msgspec.structs.replace(config, model="null"),
                                         ready_timeout_s=ATTACH_READY_S,
                                         heartbeat=direction is Direction.TO_CLIENT,
                                         cause="no attach marker", factory=factory,
                                         reference=reference))
    return cells


@dataclass
class _InterposerCell:
    client: str
    rule: FrameRule
    allowed: frozenset[Any]
    config: Any
    seed: int = 0
    ready_timeout_s: float = 60.0
    heartbeat: bool = True  # the matrix's heartbeat, or none (a client's default)
    # What a DEAD outcome's cause must say: a cell written for one detection path fails when
    # another one (a heartbeat, the loss deadline) ends it instead.
    cause: str | None = None
    # A user's ClientFactory builds the client (with its own config), and the tokens a clean
    # run of it gives; None: the built-in client of ``client`` on ``config``.
    factory: Any = None
    reference: list[int] | None = None
    # Only the integrity trailers detect this fault (a factory declaring NO_FRAME_INTEGRITY
    # cannot run it).
    needs_integrity: bool = True

    def declared_away(self, contract: Mapping[str, str]) -> str | None:
        """Why this cell cannot judge a client whose factory declares ``contract``."""
        if self.rule.kind is FrameKind.ATTACH and Declared.NO_ATTACH_HANDSHAKE in contract:
            return declared_reason(contract, Declared.NO_ATTACH_HANDSHAKE)
        if self.needs_integrity and Declared.NO_FRAME_INTEGRITY in contract:
            return declared_reason(contract, Declared.NO_FRAME_INTEGRITY)
        return None

    @property
    def latency_bound_s(self) -> float:
        if self.rule.kind is FrameKind.ATTACH and self.rule.action is FrameAction.DROP:
            # Seen at the marker's deadline: ready_timeout_s after the ATTACH, which went
            # out before the rule fired (its own drop, or the marker's).
            return self.ready_timeout_s + DEATH_BOUND_S
        if self.rule.direction is Direction.TO_ENGINE and self.rule.action in (
                FrameAction.DROP, FrameAction.REORDER):
            # A lost input (or one held back behind a next input that never comes) shows only
            # as a missing ack: the integrity link's loss deadline.
            return float(DEFAULT_LOSS_DEADLINE_S + DEATH_BOUND_S)
        return float(DEATH_BOUND_S)

    @property
    def name(self) -> str:
        return (f"{self.client}/frames/{self.rule.direction}:{self.rule.kind}:"
                f"{self.rule.action}")

    def __call__(self, workdir: str) -> Any:
        from .conformance import open_client

        expected = "|".join(sorted(o.value for o in self.allowed))
        contract = declared_contract(self.factory) if self.factory is not None else {}
        away = self.declared_away(contract)
        if away is not None:
            return cells.CellResult(cell=self.name, client=self.client, scenario="frames",
                                    point=f"{self.rule.direction}:{self.rule.kind}",
                                    action=str(self.rule.action), expected=expected,
                                    outcome=Outcome.NOT_APPLICABLE.value, passed=False,
                                    detail=away[:300])
        before = ResourceSnapshot.take()
        start = time.monotonic()
        outcome, detail, seen_at = Outcome.HANG, "", None
        wire = "vllm" if Declared.VLLM_WIRE in contract else "enginewire"
        proxy = Interposer([self.rule], seed=self.seed, wire=wire).start()
        cut = None
        try:
            client_dir = tempfile.mkdtemp(prefix="enginewire-ipc-", dir=workdir)
            inp, out = f"ipc://{client_dir}/in", f"ipc://{client_dir}/out"
            proxy.attach(inp, out)
            beat: dict[str, Any] = {}
            if self.heartbeat:
                beat = dict(engine_heartbeat_timeout_s=cells.HEARTBEAT_TIMEOUT_S,
                            engine_heartbeat_interval_s=cells.HEARTBEAT_INTERVAL_S)
            if Declared.NO_HEARTBEAT_DEADLINE in contract:
                beat.pop("engine_heartbeat_timeout_s", None)
            options: dict[str, Any] = dict(
                input_address=inp, output_address=out, engine_connect=proxy.engine_addresses,
                frame_integrity=True, **beat, shutdown_timeout_s=cells.SHUTDOWN_TIMEOUT_S,
                ready_timeout_s=self.ready_timeout_s)
            if Declared.NO_FRAME_INTEGRITY in contract:
                del options["frame_integrity"]  # the cells that need it are n/a
            try:
                # A factory that cannot take the proxy's addresses refuses them: not applicable.
                cut = (cells.build_with(self.factory, **options) if self.factory is not None
                       else open_client(self.client, self.config, **options))
                deadline = start + cells.CELL_BOUND_S - 15.0
                # Long enough to see a detection within its bound, then a hang is a hang.
                window = max(5.0, self.latency_bound_s + 2.0)
                if self.rule.kind is FrameKind.UTILITY:
                    outcome = cells.utility(cut, deadline)
                else:
                    outcome = cells.generate(cut, min(deadline, time.monotonic() + window),
                                           self.reference if self.reference is not None
                                           else cells.reference_tokens(self.config))
            except BaseException as e:
                seen_at = time.monotonic()
                obs = cells.classify(e)
                outcome, detail = obs.outcome, obs.detail
        finally:
            if cut is not None:
                with contextlib.suppress(Exception):
                    cut.shutdown()
            proxy.close()
        leaks = left_behind_as_declared(before, contract)
        outcome, detail = cells.clean_refusal(outcome, detail, leaks)
        wall = time.monotonic() - start
        passed = outcome in self.allowed and not leaks
        if outcome is Outcome.DEAD and self.cause is not None and self.cause not in detail:
            passed = False
            detail = f"dead, but not by {self.cause!r}: {detail}"
        latency = None
        if seen_at is not None and proxy.applied_at and outcome is Outcome.DEAD:
            latency = max(0.0, seen_at - proxy.applied_at[0]) * 1000.0
            if latency > self.latency_bound_s * 1000.0:
                passed = False
                detail = (f"detected after {latency:.0f} ms"
                          f" (bound {self.latency_bound_s * 1000:.0f}); {detail}")
        detail = f"{detail} events={proxy.events[:3]}"
        return cells.CellResult(cell=self.name, client=self.client, scenario="frames",
                             point=f"{self.rule.direction}:{self.rule.kind}",
                             action=str(self.rule.action), expected=expected,
                             outcome=outcome.value, passed=passed, wall_s=round(wall, 2),
                             latency_ms=None if latency is None else round(latency, 1),
                             leaks=leaks, detail=detail[:300])
