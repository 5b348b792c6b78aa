"""The monitor: a transparent relay that judges a front end <-> engine conversation against the
spec from its traffic alone (``enginewire monitor``, docs/monitor.md).

Theory of operation
-------------------
Rule 1: the relay never waits for its judgement. It is the interposer's proxy
(model_tests/interposer.py) with no rule: the front end binds, the monitor connects to it as
the engine would and binds a pair the engine connects to, and every message is sent on
unchanged and in order. The proxy thread's ``tap`` only puts ``(link, frames, time)`` on a
queue; a judging thread writes the capture and judges, behind the stream.
Rule 2: the judgement advances the spec's own machines (``Lifecycle`` over spec/client.py's
CLIENT, spec/request.py's CLIENT_REQUEST, spec/utility.py's UTILITY, spec/attach.py's ATTACH
and spec/engine.py's ENGINE, as far as the wire shows it) and records their trace; a
``SpecViolation`` the tables raise is a ``Violation`` with the last frames that led there.
The few rules no single table holds (a token after the engine said it slept, an abort never
answered within the bound, a call id sent twice while pending, a reply to a call never sent,
a frame after the dead sentinel, a frame that does not decode) are reported in the same form.
Coverage is the trace, counted as the campaign counts it, in the campaign's JSON + HTML
report.
Rule 3: what only a client knows is not judged: its timeouts and cancels, and its own state
after the engine died (a message the client sent before it read the sentinel is not a
violation, so nothing sent after the sentinel is judged).

The capture (``--capture FILE``, model_tests/capture.py's format) is the judging thread's
input, written as it judges. ``replay`` judges a capture again; a cut or corrupt one is a
``ProtocolError`` naming the byte.
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import msgspec

from ..protocol.codec import decode_input, decode_outputs, decode_ready
from ..protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    AttachRequest,
    EngineCoreRequest,
    RequestType,
    UtilityRequest,
)
from ..protocol.utilities import BY_NAME
from ..protocol.vllm033 import (
    VLLM_DEAD_SENTINEL,
    VllmEngineCoreOutputs,
    VllmEngineCoreRequest,
)
from ..runtime.client import FINISH_EVENT_BY_VALUE
from ..runtime.integrity import TRAILER_MAGIC
from ..spec.attach import ATTACH, ATTACH_DROPS_MESSAGES, AttachEvent, AttachState
from ..spec.client import CLIENT, CLIENT_ASLEEP, ClientEvent, ClientState
from ..spec.engine import ENGINE, SUBPROCESS, EngineEvent
from ..spec.errors import ProtocolError, SpecViolation
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.request import CLIENT_REQUEST, ClientRequestEvent, ClientRequestState
from ..spec.utility import UTILITY, UtilityEvent, UtilityState
from .capture import WIRES, CaptureWriter, Link, read_capture
from .interposer import Interposer
from .oracle import Coverage

__all__ = ["ABORT_BOUND_S", "WIRES", "Judge", "Monitor", "MonitorSink", "Violation",
           "coverage_section", "monitored", "read_capture", "replay", "summary", "write_report"]

# An abort is applied at the engine's next step boundary and answered then (milliseconds);
# seconds leave room for a loaded 2-core CI machine, so only a lost answer trips it.
ABORT_BOUND_S = 5.0
# The last frames a violation carries (summaries), and the ended calls kept so that a second
# reply is judged by the table (RESOLVED has no REPLY_OK row) rather than as "never sent".
HISTORY = 8
_ENDED_CALLS = 4096
# The violations a report keeps (each with its frames); past it they are only counted.
MAX_VIOLATIONS = 10_000
# The judging thread wakes this often and judges what came meanwhile, in one go: woken per
# message instead, it took the GIL from the relay thread at every message (the echo round
# trip through the monitor cost half as much again as through the bare relay). A violation is
# therefore told at most this late.
_TICK_S = 0.01
# The most bytes of messages waiting to be judged. The relay never waits for the judge; past
# this the judging stops (the relay forwards on, unjudged) rather than hold memory unbounded:
# a judgement with a gap in it would be wrong, so the report says where it stopped instead.
MAX_BACKLOG_BYTES = 256 << 20
_JOIN_S = 10.0


def _yield_gil() -> None:
    time.sleep(0)

_NO_CALL = "(no such call)"  # the state a reply finds when no call of its id was ever sent


@dataclass(frozen=True)
class Violation:
    """The conversation left the spec: in ``machine`` (a spec machine's name, or ``wire`` for a
    frame that does not decode), in ``state``, at ``event``; ``frames`` are the summaries of
    the last frames up to and including the one that did it, oldest first."""

    machine: str
    state: str
    event: str
    detail: str
    at: float
    frames: tuple[str, ...] = ()
    guard: str | None = None

    def __str__(self) -> str:
        g = f" [{self.guard}]" if self.guard else ""
        return f"{self.machine}: {self.event}{g} in {self.state}: {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["frames"] = list(self.frames)
        return d


@dataclass
class _Batch:
    """One message to the client, read down to what the judge follows."""

    outputs: list[tuple[str, int | None]]
    reply: tuple[int, str | None, Any] | None = None
    session: bytes | None = None
    refusal: str | None = None
    power: tuple[str, Any] | None = None


def _undecodable(what: str, e: BaseException) -> ProtocolError:
    return ProtocolError(f"{what} does not decode: {e}")


class _EnginewireFrames:
    """Enginewire's frames (protocol/messages.py); an integrity trailer, once a front end has
    asked for them, is stripped unchecked (the receiver checks it)."""

    sentinel = ENGINE_DEAD_SENTINEL
    sessions = True

    def request(self, frames: list[bytes], sealed: bool) -> tuple[RequestType, Any]:
        kind, obj = decode_input(_unsealed(frames) if sealed and frames[:1] and
                                 frames[0][:1] != RequestType.ATTACH.value else frames)
        if isinstance(obj, EngineCoreRequest):
            return kind, obj.request_id
        if isinstance(obj, UtilityRequest):
            return kind, (obj.call_id, obj.method, list(obj.args))
        return kind, obj

    def outputs(self, frames: list[bytes], sealed: bool) -> _Batch:
        out = decode_outputs(_unsealed(frames) if sealed else frames).expanded()
        u = out.utility_output
        return _Batch(
            [(o.request_id, None if o.finish_reason is None else int(o.finish_reason))
             for o in out.outputs],
            None if u is None else (u.call_id, u.failure_message, u.result),
            out.session, out.refusal,
            None if out.power is None else (out.power.method, out.power.result))

    def ready(self, frames: list[bytes]) -> None:
        decode_ready(frames)


class _VllmFrames:
    """vLLM 0.33's frames (protocol/vllm033.py): a request's type byte is a frame of its own."""

    sentinel = VLLM_DEAD_SENTINEL
    sessions = False

    def __init__(self) -> None:
        self._add = msgspec.msgpack.Decoder(VllmEngineCoreRequest)
        self._outs = msgspec.msgpack.Decoder(VllmEngineCoreOutputs)
        self._any = msgspec.msgpack.Decoder()

    def request(self, frames: list[bytes], sealed: bool) -> tuple[RequestType, Any]:
        if len(frames) < 2 or len(frames[0]) != 1:
            raise ProtocolError(f"a vLLM request is [type byte, payload, ...], got"
                                f" {len(frames)} frame(s) starting {frames[0][:8]!r}"
                                if frames else "a vLLM request with no frame")
        try:
            if frames[0] == RequestType.ADD.value:
                return RequestType.ADD, self._add.decode(frames[1]).request_id
            body = self._any.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _undecodable("a vLLM request", e) from e
        if frames[0] == RequestType.ABORT.value and isinstance(body, list) and all(
                isinstance(i, str) for i in body):
            return RequestType.ABORT, body
        if frames[0] == RequestType.UTILITY.value and isinstance(body, list) and len(
                body) == 4 and isinstance(body[1], int) and isinstance(body[2], str):
            return RequestType.UTILITY, (body[1], body[2], body[3])
        raise ProtocolError(f"a vLLM request of type {frames[0]!r}: {body!r:.200}")

    def outputs(self, frames: list[bytes], sealed: bool) -> _Batch:
        try:
            out = self._outs.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _undecodable("vLLM EngineCoreOutputs", e) from e
        u = out.utility_output
        reply = None
        if u is not None:
            result = u.result[1] if isinstance(u.result, list) and len(u.result) > 1 else None
            reply = (u.call_id, u.failure_message, result)
        return _Batch([(o.request_id, o.finish_reason) for o in out.outputs], reply)

    def ready(self, frames: list[bytes]) -> None:
        try:
            ready = self._any.decode(frames[0]) if len(frames) == 1 else None
        except msgspec.DecodeError as e:
            raise _undecodable("vLLM's ready", e) from e
        if not isinstance(ready, dict):
            raise ProtocolError(f"vLLM's ready is one frame holding a map, got {ready!r:.200}")


_FRAMES: dict[str, type[_EnginewireFrames | _VllmFrames]] = {
    "enginewire": _EnginewireFrames, "vllm-0.33": _VllmFrames}


def _unsealed(frames: list[bytes]) -> list[bytes]:
    last = frames[-1] if len(frames) > 1 else b""
    return frames[:-1] if len(last) == 24 and last[:4] == TRAILER_MAGIC else frames


def _summary(link: Link, frames: list[bytes]) -> str:
    size = sum(len(f) for f in frames)
    head = frames[0][:24] if frames else b""
    return f"{link.name.lower()}: {len(frames)} frame(s), {size} bytes, {head!r}"


class _CountingTrace(list[TraceEntry]):
    """What ``Lifecycle`` appends its trace entries to, counted by (machine, state, event,
    state) as ``Coverage`` counts them, and not kept."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[str, str, str, str], int] = {}

    def append(self, entry: TraceEntry) -> None:
        key = entry[:4]
        self.seen[key] = self.seen.get(key, 0) + 1


class Judge:
    """The judgement over one front end <-> engine link, with no I/O: ``feed`` it each message
    as it was forwarded, ``tick`` it as time passes, ``end`` it; ``violations``, ``trace`` and
    ``report()`` say what it found. ``Monitor`` runs one live; ``replay`` runs one over a
    capture."""

    def __init__(self, wire: str = "enginewire", *, abort_bound_s: float = ABORT_BOUND_S) -> None:
        if wire not in _FRAMES:
            raise ValueError(f"wire={wire!r}: must be one of {sorted(_FRAMES)}")
        self.wire = wire
        self._frames: _EnginewireFrames | _VllmFrames = _FRAMES[wire]()
        self.abort_bound_s = abort_bound_s
        # Every machine fires into it; it keeps counts, not entries, so a monitor left on
        # for days holds one entry per transition taken, not one per token.
        self.trace = _CountingTrace()
        self.violations: list[Violation] = []
        self.violations_dropped = 0
        self.client: Lifecycle[ClientState, ClientEvent] = CLIENT.lifecycle(trace=self.trace)
        self.engine: Lifecycle[Any, EngineEvent] = ENGINE.lifecycle(trace=self.trace)
        self.requests: dict[str, Lifecycle[ClientRequestState, ClientRequestEvent]] = {}
        self.calls: dict[int, tuple[str, Lifecycle[UtilityState, UtilityEvent]]] = {}
        self._ended: collections.OrderedDict[int, Lifecycle[UtilityState, UtilityEvent]] = (
            collections.OrderedDict())
        self._aborted_at: dict[str, float] = {}
        self.pending_at_death: list[dict[str, Any]] = []
        self.counts = {link.name.lower(): 0 for link in Link if link is not Link.DISCONNECT}
        # Each time the engine's input connection went away (no sentinel needed): when, and
        # what was live then. Not a death: an engine reconnects after a dropped link, and a
        # launched engine's shutdown looks the same from the wire.
        self.disconnects: list[dict[str, Any]] = []
        self._last: collections.deque[str] = collections.deque(maxlen=HISTORY)
        self.attach: Lifecycle[AttachState, AttachEvent] = ATTACH.lifecycle(trace=self.trace)
        self._session: bytes | None = None  # the front end's, from its ATTACH
        self._sealed = False
        self._dead = False
        self._shut = False
        self.first_at: float | None = None
        self.last_at: float | None = None

    # -- input ------------------------------------------------------------------------------

    def feed(self, link: Link, frames: list[bytes], at: float) -> None:
        self._last.append(_summary(link, frames))
        if link is Link.DISCONNECT:
            self.disconnects.append({
                "at": at, "after_sentinel": self._dead,
                "live_requests": sorted(self.requests),
                "pending_calls": {str(c): m for c, (m, _lc) in sorted(self.calls.items())}})
            return
        self.counts[link.name.lower()] += 1
        if self.first_at is None:
            self.first_at = at
        self.last_at = at
        try:
            if link is Link.READY:
                self._ready(frames)
            elif link is Link.TO_ENGINE:
                self._request(frames, at)
            else:
                self._output(frames, at)
        except ProtocolError as e:
            self._violate("wire", link.name.lower(), "undecodable", str(e), at)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            # Decoded, but holding values no message of this wire holds (a finish reason
            # out of range, a field of the wrong shape): the frame is bad, not the judge.
            self._violate("wire", link.name.lower(), "malformed", f"{type(e).__name__}: {e}", at)
        self.tick(at)

    def tick(self, now: float) -> None:
        """Aborts still unanswered ``abort_bound_s`` after they were sent are violations (not
        while the client knows the engine is asleep or paused: it answers them on waking)."""
        if self.client.state in CLIENT_ASLEEP:
            return
        for rid, sent in list(self._aborted_at.items()):
            if now - sent > self.abort_bound_s:
                del self._aborted_at[rid]
                lc = self.requests.get(rid)
                self._violate(CLIENT_REQUEST.name,
                              lc.state.name if lc else ClientRequestState.ABORTING.name,
                              ClientRequestEvent.FINISH_ABORT.name,
                              f"the abort of {rid!r} was not answered within"
                              f" {self.abort_bound_s:g} s", now)

    def end(self, at: float) -> None:
        self.tick(at)

    # -- what each message does -----------------------------------------------------------

    def _violate(self, machine: str, state: str, event: str, detail: str, at: float,
                 guard: str | None = None) -> None:
        if len(self.violations) >= MAX_VIOLATIONS:  # a flood of garbage: counted, not kept
            self.violations_dropped += 1
            return
        self.violations.append(Violation(machine, state, event, detail, at, tuple(self._last),
                                         guard))

    def _fire(self, lc: Lifecycle[Any, Any], event: Any, at: float, detail: str,
              guard: str | None = None) -> bool:
        try:
            lc.fire(event, guard)
        except SpecViolation as e:
            self._violate(e.machine, e.state, e.event, detail, at, e.guard)
            return False
        return True

    def _ready(self, frames: list[bytes]) -> None:
        self._frames.ready(frames)
        # The same front end sees a ready again after each reconnection and ignores it.
        if self.client.state is ClientState.CONSTRUCTING:
            self.client.fire(ClientEvent.HANDSHAKE_OK)
            # A process engine's handshake: built, ready sent, loop started (spec/engine.py).
            self.engine.fire(EngineEvent.BUILT, SUBPROCESS)
            self.engine.fire(EngineEvent.HANDSHAKE_SENT)
            self.engine.fire(EngineEvent.LOOP_STARTED)

    def _request(self, frames: list[bytes], at: float) -> None:
        kind, obj = self._frames.request(frames, self._sealed)
        if self._dead or self._shut:
            return  # sent before the client read of the death, or after its goodbye: Rule 3
        if kind is RequestType.ADD:
            rid = obj
            lc = self.requests.get(rid) or CLIENT_REQUEST.lifecycle(trace=self.trace)
            if self._fire(lc, ClientRequestEvent.SEND, at, f"ADD {rid!r}"):
                self.requests[rid] = lc
            self._fire(self.client, ClientEvent.ADD_REQUEST, at, f"ADD {rid!r}")
        elif kind is RequestType.ABORT:
            for rid in obj:
                lc = self.requests.get(rid) or CLIENT_REQUEST.lifecycle(trace=self.trace)
                self._fire(lc, ClientRequestEvent.ABORT_SENT, at, f"ABORT {rid!r}")
                if rid in self.requests:
                    self._aborted_at.setdefault(rid, at)
        elif kind is RequestType.UTILITY:
            call_id, method, _args = obj
            if call_id in self.calls:
                self._violate(UTILITY.name, UtilityState.PENDING.name, "call",
                              f"call id {call_id} ({method}) sent again while pending", at)
                return
            self._ended.pop(call_id, None)
            self.calls[call_id] = (method, UTILITY.lifecycle(trace=self.trace))
        elif kind is RequestType.ATTACH:
            assert isinstance(obj, AttachRequest)
            if obj.goodbye:
                self._goodbye(at)
            else:
                self._session, self._sealed = obj.session, obj.integrity
                self._fire(self.attach, AttachEvent.SEND_ATTACH, at, "ATTACH")

    def _goodbye(self, at: float) -> None:
        self._shut = True
        self._fire(self.client, ClientEvent.SHUTDOWN, at, "the front end said goodbye")
        for call_id, (method, lc) in list(self.calls.items()):
            self._fire(lc, UtilityEvent.CLIENT_SHUTDOWN, at, f"call {call_id} ({method})")
            self._end_call(call_id)
        self.requests.clear()
        self._aborted_at.clear()

    def _end_call(self, call_id: int) -> None:
        _method, lc = self.calls.pop(call_id)
        self._ended[call_id] = lc
        while len(self._ended) > _ENDED_CALLS:
            self._ended.popitem(last=False)

    def _output(self, frames: list[bytes], at: float) -> None:
        if len(frames) == 1 and frames[0] == self._frames.sentinel:
            self._death(at, "the dead sentinel")
            return
        if self._dead:
            self._violate(ENGINE.name, self.engine.state.name, "output",
                          "a message after the dead sentinel", at)
            return
        batch = self._frames.outputs(frames, self._sealed)
        if self.attach.state in ATTACH_DROPS_MESSAGES:
            # Before its attach marker a front end reads nothing: it is an earlier one's.
            if batch.session != self._session:
                self.attach.fire(AttachEvent.FOREIGN_MESSAGE)
            elif batch.refusal is None:
                self.attach.fire(AttachEvent.MARKER)
            else:  # refused: the client's death by its own event (spec/attach.py, Rule 2)
                self.attach.fire(AttachEvent.REFUSAL)
                self._death(at, f"the engine refused the ATTACH: {batch.refusal}")
            return
        if batch.session is not None:
            if batch.refusal is not None:  # the session's end: this front end is done
                self._fire(self.attach, AttachEvent.SESSION_ENDED, at, batch.refusal)
                self._death(at, f"the engine ended the session: {batch.refusal}")
            return
        for rid, reason in batch.outputs:
            lc = self.requests.get(rid) or CLIENT_REQUEST.lifecycle(trace=self.trace)
            if reason is None:
                if self.client.state in CLIENT_ASLEEP:
                    self._violate(CLIENT.name, self.client.state.name, "output",
                                  f"{rid!r} still streaming after the engine said it slept", at)
                self._fire(lc, ClientRequestEvent.OUTPUT, at, f"an output for {rid!r}")
                continue
            event = FINISH_EVENT_BY_VALUE.get(reason)
            if event is None:
                self._violate("wire", "output", "malformed",
                              f"{rid!r} finishes with reason {reason!r}, none of the wire's", at)
                continue
            self._fire(lc, event, at, f"{rid!r} finishes ({event.name})")
            self.requests.pop(rid, None)
            self._aborted_at.pop(rid, None)
        if batch.power is not None:
            self._power(batch.power[0], batch.power[1], at)
        if batch.reply is not None:
            call_id, failure, result = batch.reply
            self._reply(call_id, failure, result, at)

    def _reply(self, call_id: int, failure: str | None, result: Any, at: float) -> None:
        event = UtilityEvent.REPLY_OK if failure is None else UtilityEvent.REPLY_ERROR
        entry = self.calls.get(call_id)
        if entry is None:
            ended = self._ended.get(call_id)
            if ended is None:
                self._violate(UTILITY.name, _NO_CALL, event.name,
                              f"a reply to call id {call_id}, which was never sent", at)
            else:  # a second reply: the table says what an ended call makes of it
                self._fire(ended, event, at, f"a second reply to call {call_id}")
            return
        method, lc = entry
        self._fire(lc, event, at, f"the reply to call {call_id} ({method})")
        self._end_call(call_id)
        if failure is None:
            self._power(method, result, at)

    def _power(self, method: str, result: Any, at: float) -> None:
        """A power utility's success moves the client as its declaration says
        (protocol/utilities.py), as the client's own ``_on_power_reply`` does."""
        decl = BY_NAME.get(method)
        if decl is None or decl.power is None:
            return
        event, guard = decl.power.resolve(result)
        if self.client.can(event, guard) or self.client.state not in CLIENT.terminal:
            self._fire(self.client, event, at, f"{method} succeeded ({result!r:.40})", guard)

    def _death(self, at: float, why: str) -> None:
        self._dead = True
        self._fire(self.engine, EngineEvent.FATAL_ERROR, at, why)
        self._fire(self.client, ClientEvent.ENGINE_DIED, at, why)
        for rid, lc in self.requests.items():
            self._fire(lc, ClientRequestEvent.ENGINE_DIED, at, f"{rid!r} live at {why}")
        self.requests.clear()
        self._aborted_at.clear()
        for call_id, (method, call) in list(self.calls.items()):
            # The spec fails it (FAILED_DEAD); the report names it: a client that leaves it
            # hanging (vLLM's do, docs/vllm.md) is told which call to look for.
            self.pending_at_death.append({"call_id": call_id, "method": method, "at": at})
            self._fire(call, UtilityEvent.ENGINE_DIED, at, f"call {call_id} ({method}): {why}")
            self._end_call(call_id)

    # -- output -----------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The judgement as the campaign's report has it (``coverage`` as its JSON holds it, so
        model_tests/coverage_html.py draws it), with the violations and what is pending."""
        cov = Coverage()
        cov.seen = dict(self.trace.seen)
        return {
            "wire": self.wire,
            "frames": dict(self.counts),
            "failed": bool(self.violations),
            "violations": [v.to_dict() for v in self.violations],
            "violations_dropped": self.violations_dropped,
            "pending": {"requests": {r: lc.state.name for r, lc in sorted(self.requests.items())},
                        "calls": {str(c): m for c, (m, _lc) in sorted(self.calls.items())}},
            "pending_at_death": list(self.pending_at_death),
            "engine_disconnects": list(self.disconnects),
            "coverage": coverage_section(cov),
        }


def coverage_section(cov: Coverage) -> dict[str, Any]:
    """``cov`` as a report's ``coverage`` (the campaign's layout: counts by transition, and
    each transition not reached with why)."""
    section = cov.report()
    seen = {k[0] for k in cov.seen}
    section["never_reached"] = [{"transition": t, "why": _why_unseen(t, seen)}
                                for t in section.pop("never_reached_transitions")]
    section["transition_counts"] = {"{} {} -{}-> {}".format(*k): n
                                    for k, n in sorted(cov.seen.items())}
    return section


# Machines the monitor follows; every other one is inside a process, not on the wire.
_FOLLOWED = frozenset({CLIENT.name, CLIENT_REQUEST.name, UTILITY.name, ATTACH.name,
                       ENGINE.name})


def _why_unseen(transition: str, seen: set[str]) -> str:
    machine = transition.split(" ", 1)[0]
    if machine not in _FOLLOWED:
        return "not on the wire: the monitor follows the client-side machines and the engine's"
    if machine == ENGINE.name:
        return ("not on the wire: the monitor sees the engine's handshake and death, not its"
                " scheduling")
    return "NOT REACHED in this traffic" if machine in seen else "NOT REACHED: no such traffic"


def replay(path: str | Path, *, abort_bound_s: float = ABORT_BOUND_S) -> dict[str, Any]:
    """The report a capture's traffic gets (the same judgement as the live monitor's)."""
    wire, records, ended = read_capture(path)
    judge = Judge(wire, abort_bound_s=abort_bound_s)
    for link, frames, at in records:
        judge.feed(link, frames, at)
    judge.end(ended[0] if ended else (judge.last_at or 0.0))
    report = judge.report()
    report["capture"] = {"path": str(path), "ended_cleanly": bool(ended)}
    return report


def summary(report: dict[str, Any]) -> str:
    """A report's verdict in a few lines (what the CLI prints)."""
    cov = report["coverage"]
    frames = ", ".join(f"{k} {v}" for k, v in report["frames"].items())
    lines = [f"monitor ({report['wire']}): {sum(report['frames'].values())} messages ({frames});"
             f" {len(report['violations'])} violation(s); coverage"
             f" {cov['transitions_reached']}/{cov['transitions_declared']} transitions"]
    lines += [f"  VIOLATION {v['machine']}: {v['event']} in {v['state']}: {v['detail']}"
              for v in report["violations"][:20]]
    pending = report["pending"]
    if pending["requests"] or pending["calls"]:
        lines.append(f"  pending at the end: {len(pending['requests'])} request(s),"
                     f" calls {sorted(pending['calls'].values())}")
    for d in report.get("engine_disconnects", []):
        if not d["after_sentinel"]:
            lines.append(f"  the engine's connection went away without its sentinel, with"
                         f" {len(d['live_requests'])} request(s) live and calls"
                         f" {sorted(d['pending_calls'].values())} pending")
    for c in report["pending_at_death"]:
        lines.append(f"  call {c['call_id']} ({c['method']}) was pending at the engine's death")
    if report.get("report"):
        lines.append(f"report: {report['report']}")
    return "\n".join(lines)


def write_report(report: dict[str, Any], directory: str | Path) -> Path:
    """``monitor-<time>.json`` and its page beside it (coverage drawn on the diagrams, the
    violations as the failures); returns the JSON's path."""
    from .coverage_html import write_coverage_html
    from .mutant_runs import new_report_path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = new_report_path(out, "monitor")
    page = dict(report)
    if report.get("violations"):
        capture = report.get("capture", {}).get("path")
        page["clients"] = [{
            "client": f"monitor ({report.get('wire')})",
            "failure": "; ".join(f"{v['machine']}: {v['event']} in {v['state']}: {v['detail']}"
                                 for v in report["violations"][:20]),
            "reproducer": f"enginewire monitor --replay {capture}" if capture else None}]
    page["html"] = path.with_suffix(".html").name
    path.write_text(json.dumps(page, indent=2, default=str))
    try:
        write_coverage_html(page, path.with_suffix(".html"), what="monitor")
    except Exception as e:  # the page is a view of the JSON: never the verdict
        print(f"monitor: coverage page not written: {e!r}", file=sys.stderr)
    return path


# --- the live monitor ---------------------------------------------------------------------------


class Monitor:
    """A transparent relay that judges what crosses it (module docstring). Use as the
    interposer: ``start()`` (or ``with``), ``attach(front_input, front_output)`` once the front
    end has bound, and give the engine ``engine_addresses``; ``stop()`` returns the report.

    ``engine``: the (input, output) pair the engine connects to (default: an ipc directory of
    its own); ``capture``: a file to write the traffic to, for ``replay``; ``live``: where each
    violation is written the moment it is seen (stderr by default, None: nowhere);
    ``report_dir``: where ``stop()`` writes the JSON + HTML report; ``fail_fast``: the first
    violation sets ``failed`` (the CLI then stops)."""

    def __init__(self, *, wire: str = "enginewire", engine: tuple[str, str] | None = None,
                 capture: str | Path | None = None, report_dir: str | Path | None = None,
                 fail_fast: bool = False, abort_bound_s: float = ABORT_BOUND_S,
                 engine_index: int = 0, live: IO[str] | None = sys.stderr) -> None:
        self.judge = Judge(wire, abort_bound_s=abort_bound_s)
        self.wire = wire
        self._capture_path = capture
        self._report_dir = report_dir
        self.fail_fast = fail_fast
        self.failed = threading.Event()
        self._live = live
        # A deque's append and popleft are atomic: the relay thread appends, the judging
        # thread pops, neither ever waits for the other.
        self._queue: collections.deque[tuple[Link, list[bytes], float, int]] = (
            collections.deque())
        self._stopping = threading.Event()
        put = self._queue.append
        clock = time.time
        # Bytes queued and bytes judged, each counted by one thread only (no lock on the
        # relay's path): their difference is the backlog, held under ``max_backlog``.
        queued, self._judged = [0], [0]
        self.max_backlog = MAX_BACKLOG_BYTES
        self.judging_stopped: str | None = None
        self.unjudged = 0

        def tap(link: Link, frames: list[bytes]) -> None:
            if self.judging_stopped is not None:
                self.unjudged += 1
                return
            size = sum(len(f) for f in frames)
            if queued[0] + size - self._judged[0] > self.max_backlog:
                self.judging_stopped = (
                    f"the judge fell {self.max_backlog} bytes behind the relay at {clock():.6f};"
                    " the relay forwarded everything, nothing after that was judged or captured")
                self.unjudged += 1
                return
            queued[0] += size
            put((link, frames, clock(), size))

        self._proxy = Interposer([], wire=WIRES[wire], engine_index=engine_index,
                                 engine_bind=engine, tap=tap)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._writer: CaptureWriter | None = None
        self._report: dict[str, Any] | None = None
        self.capture_error: str | None = None
        self.internal_errors: list[str] = []

    @property
    def engine_addresses(self) -> tuple[str, str]:
        return self._proxy.engine_addresses

    def start(self) -> Monitor:
        if self._capture_path is not None:
            self._writer = CaptureWriter(self._capture_path, self.wire)
        self._thread = threading.Thread(target=self._judging, name="MonitorJudge", daemon=True)
        self._thread.start()
        try:
            self._proxy.start()
        except BaseException:
            self.stop()
            raise
        return self

    def attach(self, front_input: str, front_output: str) -> None:
        self._proxy.attach(front_input, front_output)

    def _judging(self) -> None:
        judge, pending, writer = self.judge, self._queue, self._writer
        yield_gil = _yield_gil
        told_stop = False
        while True:
            last = self._stopping.wait(_TICK_S)  # set after the relay's last message
            with self._lock:
                seen = len(judge.violations)
                while pending:
                    link, frames, at, size = pending.popleft()
                    self._judged[0] += size
                    if writer is not None:
                        try:
                            writer.write(link, frames, at)
                        except OSError as e:  # a full disk ends the capture, not the judging
                            self.capture_error = f"capture stopped at {at}: {e}"
                            writer = None
                    try:
                        judge.feed(link, frames, at)
                    except Exception as e:  # a bug of the judge's: said, and judging goes on
                        self.internal_errors.append(f"{type(e).__name__}: {e}"[:300])
                    # Let the relay thread have the GIL between messages: held for a
                    # whole backlog, the relay waits for the interpreter's switch interval
                    # (5 ms) at each message it is woken for.
                    yield_gil()
                judge.tick(time.time())
            self._tell(seen)
            if self.judging_stopped is not None and not told_stop:
                told_stop = True
                if self._live is not None:
                    with contextlib.suppress(Exception):
                        print(f"monitor: JUDGING STOPPED: {self.judging_stopped}",
                              file=self._live, flush=True)
            if last:
                return

    def _tell(self, seen: int) -> None:
        new = self.judge.violations[seen:]
        if not new:
            return
        if self._live is not None:
            for v in new:
                with contextlib.suppress(Exception):
                    print(f"monitor: VIOLATION {v}", file=self._live, flush=True)
        if self.fail_fast:
            self.failed.set()

    @property
    def violations(self) -> list[Violation]:
        with self._lock:
            return list(self.judge.violations)

    def report(self) -> dict[str, Any]:
        """The report so far (the final one once stopped)."""
        if self._report is not None:
            return self._report
        with self._lock:
            report = self.judge.report()
        if self._capture_path is not None:
            report["capture"] = {"path": str(self._capture_path), "error": self.capture_error}
        if self.internal_errors:
            report["internal_errors"] = list(self.internal_errors)
        if self.judging_stopped is not None:
            report["judging_stopped"] = {"why": self.judging_stopped, "unjudged": self.unjudged}
        return report

    def stop(self) -> dict[str, Any]:
        """Closes the relay, judges what is queued, writes the report; idempotent."""
        if self._report is not None:
            return self._report
        self._proxy.close()
        if self._thread is not None:
            self._stopping.set()
            self._thread.join(_JOIN_S)
        at = time.time()
        with self._lock:
            self.judge.end(at)
            if self._writer is not None:
                try:
                    self._writer.close(at)
                except OSError as e:
                    self.capture_error = self.capture_error or f"capture not closed: {e}"
        report = self.report()
        if self._report_dir is not None:
            report["report"] = str(write_report(report, self._report_dir))
        self._report = report
        return report

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()



# --- a monitor on every link of a campaign ------------------------------------------------------


class MonitorSink:
    """What the monitors a campaign put on its links found, together: their coverage (one
    ``Coverage`` over every link's trace), their violations, and how many links and messages
    they judged."""

    def __init__(self) -> None:
        self.coverage = Coverage()
        self.violations: list[dict[str, Any]] = []
        self.links = 0
        self.frames: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, mon: Monitor) -> None:
        report = mon.stop()
        with self._lock:
            for key, n in mon.judge.trace.seen.items():
                self.coverage.seen[key] = self.coverage.seen.get(key, 0) + n
            self.violations += report["violations"]
            self.links += 1
            self.frames.update(report["frames"])

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"links": self.links, "frames": dict(self.frames),
                    "failed": bool(self.violations), "violations": list(self.violations),
                    "coverage": coverage_section(self.coverage)}


def monitored(factory: Any, sink: MonitorSink, *, wire: str = "enginewire",
              abort_bound_s: float = ABORT_BOUND_S) -> Any:
    """``factory`` (a conformance ``ClientFactory``) with a monitor on each client's link: the
    client binds addresses of an ipc directory of the monitor's, its engine connects to the
    monitor, and the client's ``shutdown()`` stops the monitor (before the release checks
    that follow it) and hands it to ``sink``. The factory's attributes (its declared
    contract) are kept."""
    import functools
    import shutil
    import tempfile

    @functools.wraps(factory)
    def build(**options: Any) -> Any:
        where = tempfile.mkdtemp(prefix="enginewire-mon-")
        mon = Monitor(wire=wire, abort_bound_s=abort_bound_s, live=None).start()
        inp, out = f"ipc://{where}/in", f"ipc://{where}/out"

        def done() -> None:
            sink.add(mon)
            shutil.rmtree(where, ignore_errors=True)

        try:
            mon.attach(inp, out)
            cut = factory(**options, input_address=inp, output_address=out,
                          engine_connect=mon.engine_addresses)
        except BaseException:
            done()
            raise
        shutdown = cut.shutdown

        def shutdown_then_judge(*args: Any, **kwargs: Any) -> Any:
            try:
                return shutdown(*args, **kwargs)
            finally:
                done()

        cut.shutdown = shutdown_then_judge
        return cut

    return build
