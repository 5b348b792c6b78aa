"""The engine's own trace, kept for its front end: what ``drain_trace`` hands out.

Theory of operation
-------------------
Rule 1: the engine's lifecycles (``ENGINE``, every ``ENGINE_REQUEST``, the process's
``SESSION``) append their transitions here exactly as they append to any trace list; this
object keeps them, each with the request id it is about ("" for the engine and the session),
until ``drain()`` hands them out and forgets them.
Rule 2: it is bounded. Past ``bound`` records since the last drain a record is not kept but
counted, and the drain says how many were dropped: a reader must then treat the trace as
incomplete (model_tests/oracle.py does), never as a full one. Memory never grows past the
bound, whether or not anybody drains.

Records keep the engine's order, not its clock: another process's monotonic time means
nothing to the front end, so a drain carries no timestamps. A caller that gave the engine a
list of its own (an in-process client in trace mode) still gets every entry there, as
before; this object only keeps a bounded copy for ``drain_trace`` beside it.

An engine records when its config asks (``EngineConfig.engine_trace_records``), and a
subprocess one also when its program starts with ``ENGINEWIRE_ENGINE_TRACE`` set (see
``trace_from_env``; the harness sets it for engines it does not configure); an in-process one
also whenever its client records a trace.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..protocol.records import TraceDrain
from ..spec.engine import EngineState
from ..spec.machine import TraceEntry

__all__ = ["ENGINE_TRACE_ENV", "TRACE_BOUND", "EngineTrace", "engine_trace_for",
           "trace_from_env"]

# A launched engine records its trace when this is set: a positive number of records to keep
# between two drains, or "1"/"on" for ``TRACE_BOUND``. Read by the engine program at start.
ENGINE_TRACE_ENV = "ENGINEWIRE_ENGINE_TRACE"
# Records kept between two drains: a campaign drains every few steps (tens of records), so
# this is only reached by a run that records and never drains; about 10 MiB at the bound.
TRACE_BOUND = 100_000


class EngineTrace(list[TraceEntry]):
    """A trace list for the engine's lifecycles that keeps a bounded, drainable copy.

    The list itself stays empty: ``Lifecycle.fire`` calls ``append`` and nothing else, and
    that is overridden. The lock is there because the session machine records on the engine
    process's input thread while the busy loop records (and drains) on its own."""

    def __init__(self, bound: int = TRACE_BOUND, sink: list[TraceEntry] | None = None) -> None:
        super().__init__()
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise ValueError(f"trace bound={bound!r}: must be an integer >= 1")
        self.bound = bound
        self.sink = sink
        self._records: list[tuple[str, str, str, str, str]] = []
        self._dropped = 0
        self._lock = threading.Lock()

    def append(self, entry: TraceEntry) -> None:  # what Lifecycle.fire calls
        self.record(entry, "")

    def record(self, entry: TraceEntry, subject: str) -> None:
        if self.sink is not None:
            self.sink.append(entry)
        with self._lock:
            if len(self._records) >= self.bound:
                self._dropped += 1
            else:
                self._records.append((entry[0], entry[1], entry[2], entry[3], subject))

    def for_request(self, request_id: str) -> list[TraceEntry]:
        """The trace list one request's lifecycle appends to: its records name it."""
        return _RequestTrace(self, request_id)

    def drain(self, *, source: str, state: EngineState) -> TraceDrain:
        """The records since the last drain, as columns (strs: a client checks them in one
        pass), and how many were dropped past the bound; both are then reset. ``source`` and
        ``state``: the engine core's name and its state now, which the record carries."""
        with self._lock:
            records, self._records = self._records, []
            dropped, self._dropped = self._dropped, 0
        return TraceDrain(
            state=state,
            source=source,
            machine=tuple(r[0] for r in records),
            before=tuple(r[1] for r in records),
            event=tuple(r[2] for r in records),
            after=tuple(r[3] for r in records),
            subject=tuple(r[4] for r in records),
            dropped=dropped,
            bound=self.bound,
        )


class _RequestTrace(list[TraceEntry]):
    """One request's view of an ``EngineTrace`` (empty itself, as its owner is)."""

    __slots__ = ("_owner", "_subject")

    def __init__(self, owner: EngineTrace, subject: str) -> None:
        super().__init__()
        self._owner = owner
        self._subject = subject

    def append(self, entry: TraceEntry) -> None:
        self._owner.record(entry, self._subject)


def trace_from_env() -> EngineTrace | None:
    """The trace a launched engine records, as ``ENGINEWIRE_ENGINE_TRACE`` says (None: off);
    a value that is neither a positive count nor "1"/"on" is a ValueError naming it."""
    raw = os.environ.get(ENGINE_TRACE_ENV, "").strip()
    if not raw or raw.lower() in ("0", "off"):
        return None
    if raw.lower() in ("1", "on"):
        return EngineTrace()
    try:
        bound = int(raw)
    except ValueError:
        bound = 0
    if bound < 1:
        raise ValueError(f"{ENGINE_TRACE_ENV}={raw!r}: must be a positive number of records,"
                         " or 1/on for the default bound")
    return EngineTrace(bound)


def engine_trace_for(config: Any) -> EngineTrace | None:
    """The trace a launched engine records: the environment's choice when set, else its
    config's ``engine_trace_records`` (0: none)."""
    from_env = trace_from_env()
    if from_env is not None:
        return from_env
    records = getattr(config, "engine_trace_records", 0)
    return EngineTrace(records) if records else None
