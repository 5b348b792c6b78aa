"""The campaign's oracle: a request-level model of what a client may show, plus the spec.

Theory of operation
-------------------
Rule 1: the oracle never looks at the system under test to decide what is *allowed*; it is
told what the test did (``add``, ``abort``, ``sleep``...) and judges what was *observed*
(``observe`` a batch of outputs). A violation raises ``OracleViolation`` naming the request
and the rule that was broken.
Rule 2: where the protocol allows a race (an abort against a natural finish, outputs already in
flight when a pause lands) the oracle keeps the *set* of allowed endings per request and only
narrows it when an observation picks one.

Per request it checks: tokens arrive in order and (null model) equal ``null_token(seed, i)``
(a real model's greedy tokens are the differential oracle's, ``reference.py``: a lone run's);
a LENGTH finish has exactly ``max_tokens`` tokens, a STOP finish ends on the first stop token;
ABORT only after an abort was sent (or a pause/sleep in abort mode), ERROR only for requests
built to be invalid; nothing arrives after a finish; an id is reused only once it finished.
The spec machines are the second oracle: ``check_traces`` replays a client's recorded trace
through every machine, and ``Coverage`` counts which declared transitions a campaign reached.
``check_released`` is the teardown liveness check (process reaped, no leaked threads, fds or
ipc files).
"""

from __future__ import annotations

import enum
import functools
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..protocol.messages import EngineCoreOutputs, FinishReason
from ..protocol.records import ResourceAudit, TraceDrain
from ..runtime.executor import MEMORY_TAGS
from ..spec import (
    ENGINE,
    ENGINE_REQUEST,
    MACHINES,
    SESSION,
    ClientState,
    EngineRequestEvent,
    EngineRequestState,
    TraceEntry,
    validate_trace,
)
from ..spec.client import CLIENT_ASLEEP, CLIENT_LIVE
from ..spec.engine import REPORTS_SLEEPING
from ..spec.request import ENGINE_REQUEST_LIVE
from ._harness import (
    RELEASE_BOUND_S,
    ResourceSnapshot,
    describe_leaks,
    left_behind,
    reaped,
    wait_until,
)

__all__ = [
    "ENGINE_FINISHED",
    "Coverage",
    "DPOracle",
    "Oracle",
    "OracleViolation",
    "Phase",
    "RequestModel",
    "ResourceSnapshot",
    "audit_violations",
    "check_reaped",
    "check_released",
    "check_traces",
    "engine_trace_entries",
    "null_tokens",
]

# The null model's token formula (runtime/model.py null_token; kept equal by its own test).
_NULL_FIRST = 3


def null_tokens(seed: int, prompt_len: int, n: int, vocab_size: int) -> list[int]:
    span = vocab_size - _NULL_FIRST
    return [_NULL_FIRST + (seed * 1_000_003 + (prompt_len + i) * 7919) % span for i in range(n)]


class OracleViolation(AssertionError):
    """What the system did is outside what the model allows."""


class Phase(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    CLOSED = "closed"


@dataclass
class RequestModel:
    rid: str
    max_tokens: int
    # Null model: the exact tokens and the index of the first stop token (None: runs to length).
    expected: list[int] | None
    stop_index: int | None
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    abort_ok: bool = False  # an abort (or a pause/sleep in abort mode) may end it
    error_ok: bool = False  # built invalid: it must end with ERROR
    parked: bool = False  # paused/asleep in keep mode (or added while paused): will not finish
    ended_by_death: bool = False
    # Its id reached the engine again while live (in-process only, past the client's own
    # refusal): the engine ends it with ERROR at once, whatever tokens it already had.
    duplicated: bool = False
    # What it went through, for the differential oracle's message (reference.py): the most
    # requests live beside it, its prefix-cache hit, each pause or sleep that parked it.
    peers: int = 0
    cached_tokens: int = 0
    history: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish is not None or self.ended_by_death

    def describe_history(self) -> str:
        """What it went through, as the model knows it ("": nothing of note)."""
        parts = [f"ran beside up to {self.peers} other request(s)"] if self.peers else []
        if self.cached_tokens:
            parts.append(f"had {self.cached_tokens} prompt tokens from the prefix cache")
        return "; ".join(parts + self.history)

    @property
    def must_finish(self) -> bool:
        """A drain may wait for it: it finishes without further action from the test."""
        return not self.finished and (not self.parked or self.abort_ok or self.error_ok
                                      or self.duplicated)


class Oracle:
    """The model of one client's life (one engine incarnation)."""

    def __init__(self, *, exact_tokens: bool) -> None:
        self.exact_tokens = exact_tokens
        self.phase = Phase.ALIVE
        self.requests: dict[str, RequestModel] = {}
        self.finished_ids: list[str] = []  # in finish order: candidates for id reuse
        self.paused = False  # scheduling stopped (pause, or any sleep)
        self.asleep_tags: frozenset[str] = frozenset()  # memory tags released and not woken
        self.max_in_flight = 0
        # The engine's side (``judge_engine_traces``): each client finish the engine's drained
        # trace must confirm, as (request id, reason, engine label), in the order seen; the
        # ids not judged (sent before the first drain of this model); each engine's replay.
        self.engine_pending: list[tuple[str, FinishReason, int]] = []
        self.engine_unjudged: set[str] = set()
        # id -> its last endings on the client, (reason, engine, judged): a violation names
        # what led to it (formatted then, not per output)
        self.finish_log: dict[str, deque[tuple[FinishReason, int, bool]]] = {}
        self.engine_sides: dict[int, _EngineSide] = {}
        self.trace_incomplete = 0  # records the engines dropped past their bound
        # A read raised EngineDeadError (``death_read``): the death reached the caller. Where
        # the factory declares DEAD_DELIVERED_ONCE, no later read owes it again.
        self.death_delivered = False

    # -- what the test did -----------------------------------------------------------------

    def live_ids(self) -> list[str]:
        return sorted(r for r, m in self.requests.items() if not m.finished)

    def must_finish_ids(self) -> list[str]:
        return sorted(r for r, m in self.requests.items() if m.must_finish)

    def add(self, rid: str, max_tokens: int, expected: list[int] | None,
            stop_index: int | None, *, invalid: bool = False) -> None:
        old = self.requests.get(rid)
        if old is not None and not old.finished:
            raise OracleViolation(f"model error: {rid!r} is live; the test must not re-add it")
        self.requests[rid] = RequestModel(rid, max_tokens, expected, stop_index,
                                          error_ok=invalid, parked=self.paused and not invalid)
        if rid in self.finished_ids:
            self.finished_ids.remove(rid)
        live = self.live_ids()
        self.max_in_flight = max(self.max_in_flight, len(live))
        for r in live:
            m = self.requests[r]
            m.peers = max(m.peers, len(live) - 1)

    def abort(self, ids: Iterable[str]) -> None:
        for rid in ids:
            m = self.requests.get(rid)
            if m is not None and not m.finished:
                m.abort_ok = True

    def duplicate(self, rid: str) -> None:
        """``rid`` was sent to the engine again while the engine still ran it."""
        self.requests[rid].duplicated = True

    def pause(self, mode: str, level: int | None = None) -> list[str]:
        """A pause or sleep was acknowledged; returns the ids a ``wait`` must have finished."""
        drained: list[str] = []
        what = f"pause({mode})" if level is None else f"sleep(level={level}, {mode})"
        for m in self.requests.values():
            if m.finished:
                continue
            if mode == "abort":
                m.abort_ok = True
            elif mode == "wait" and not (self.paused or m.parked or m.abort_ok or m.error_ok):
                # abort/error endings are queued outputs that a wait does not wait for
                drained.append(m.rid)
            else:
                m.parked = True
                m.history.append(f"was parked by {what}")
        self.paused = True
        if level is not None and level >= 1:
            self.asleep_tags = frozenset(MEMORY_TAGS)
        return sorted(drained)

    def expect_wake(self, tags: list[str] | None) -> bool:
        """What ``wake_up(tags)`` must return."""
        left = frozenset() if tags is None else self.asleep_tags - set(tags)
        return not left

    def wake(self, tags: list[str] | None) -> bool:
        full = self.expect_wake(tags)
        self.asleep_tags = frozenset() if tags is None else self.asleep_tags - set(tags)
        if full:
            self._resume()
        return full

    def resume_allowed(self) -> bool:
        """resume_scheduler is a SpecViolation (UtilityError) while memory is released."""
        return not self.asleep_tags

    def resume(self) -> None:
        self._resume()

    def _resume(self) -> None:
        self.paused = False
        for m in self.requests.values():
            m.parked = False

    def died(self) -> None:
        self.phase = Phase.DEAD
        self.engine_pending.clear()  # the engine's records went with it
        for m in self.requests.values():
            if not m.finished:
                m.ended_by_death = True

    def death_read(self) -> None:
        """A read raised EngineDeadError (observed, not done: it may come after ``died``)."""
        self.death_delivered = True

    def closed(self) -> None:
        self.engine_pending.clear()
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.CLOSED
            for m in self.requests.values():
                if not m.finished:
                    m.ended_by_death = True

    # -- what was observed -------------------------------------------------------------------

    def check_audit(self, audit: ResourceAudit, *, engine: str = "the engine",
                    memory: bool = True) -> None:
        """``EngineCore.audit_resources()`` against this model: the books always balance,
        and once no request is live (the quiet points the campaign audits at) nothing is
        held. A leak changes no output; only this sees it."""
        problems = audit_violations(audit, quiet=not self.live_ids(),
                                    asleep_tags=self.asleep_tags if memory else None)
        if problems:
            raise OracleViolation(f"{engine}'s resource accounting is off: "
                                  + "; ".join(problems) + f" (audit: {audit})")

    def expected_client_states(self) -> frozenset[ClientState]:
        if self.phase is Phase.DEAD:
            return frozenset({ClientState.DEAD})
        if self.phase is Phase.CLOSED:
            return frozenset({ClientState.SHUTDOWN})
        if self.paused:
            return frozenset({ClientState.SLEEPING})
        return CLIENT_LIVE - CLIENT_ASLEEP

    def observe(self, batch: EngineCoreOutputs) -> list[str]:
        """Judge one batch; returns the ids it finished."""
        done: list[str] = []
        for out in batch.outputs:
            rid = out.request_id
            m = self.requests.get(rid)
            if m is None:
                raise OracleViolation(f"output for {rid!r}, which was never sent")
            if m.finish is not None:
                raise OracleViolation(
                    f"output for {rid!r} after it finished with {m.finish.name}")
            if m.ended_by_death:
                continue  # delivered after the death was seen: queued before it; not judged
            if out.num_cached_tokens:
                m.cached_tokens = max(m.cached_tokens, out.num_cached_tokens)
            self._tokens(m, list(out.new_token_ids))
            if out.finish_reason is not None:
                self._finish(m, FinishReason(out.finish_reason), out.error)
                done.append(rid)
        return done

    def _tokens(self, m: RequestModel, new: list[int]) -> None:
        if m.error_ok and new:
            raise OracleViolation(f"{m.rid!r} was invalid yet produced tokens {new}")
        start = len(m.tokens)
        m.tokens.extend(new)
        limit = m.max_tokens if m.stop_index is None else min(m.max_tokens, m.stop_index + 1)
        if len(m.tokens) > limit:
            raise OracleViolation(f"{m.rid!r} got {len(m.tokens)} tokens, more than {limit}")
        if self.exact_tokens and m.expected is not None:
            want = m.expected[start:len(m.tokens)]
            if new != want:
                raise OracleViolation(
                    f"{m.rid!r}: tokens {start}.. are {new}, the null model says {want}")

    def _finish(self, m: RequestModel, reason: FinishReason, error: str | None) -> None:
        n = len(m.tokens)
        if m.duplicated and reason is not FinishReason.ERROR:
            raise OracleViolation(f"{m.rid!r} was sent again while live yet ended {reason.name}"
                                  " (the engine must end it with ERROR)")
        if reason is FinishReason.ERROR:
            if not (m.error_ok or m.duplicated):
                raise OracleViolation(f"{m.rid!r} ended with ERROR ({error!r}) unexpectedly")
            if not error:
                raise OracleViolation(f"{m.rid!r}: an ERROR finish must say why")
        elif m.error_ok:
            raise OracleViolation(f"{m.rid!r} was invalid yet ended with {reason.name}")
        elif reason is FinishReason.ABORT:
            if not m.abort_ok:
                raise OracleViolation(f"{m.rid!r} ended with ABORT but no abort was sent")
        elif reason is FinishReason.LENGTH:
            if n != m.max_tokens:
                raise OracleViolation(
                    f"{m.rid!r} ended LENGTH after {n} tokens; max_tokens={m.max_tokens}")
            if self.exact_tokens and m.stop_index is not None and m.stop_index < m.max_tokens:
                raise OracleViolation(f"{m.rid!r} ran past its stop token (index {m.stop_index})")
        elif reason is FinishReason.STOP:
            if self.exact_tokens and (m.stop_index is None or n != m.stop_index + 1):
                raise OracleViolation(
                    f"{m.rid!r} ended STOP after {n} tokens; stop token at {m.stop_index}")
        m.finish = reason
        self.finished_ids.append(m.rid)
        judged = self._engine_judges(m)
        self.finish_log.setdefault(m.rid, deque(maxlen=8)).append(
            (reason, self._finish_engine(), judged))
        if judged:
            self.engine_pending.append((m.rid, reason, self._finish_engine()))

    def _finish_engine(self) -> int:
        """The label of the engine whose output finished a request (one engine: 0)."""
        return 0

    def _engine_judges(self, m: RequestModel) -> bool:
        """Whether the engine's trace can confirm ``m``'s ending (one engine: always)."""
        return True

    # -- the engine's side ---------------------------------------------------------------

    def judge_engine_traces(self, drains: list[tuple[int, TraceDrain, ClientState | None]], *,
                            baseline: bool = False) -> list[TraceEntry]:
        """Judge what ``drain_trace`` returned at a sync point, one ``(label, reply, client
        view)`` per engine (the client view: the state of the client that engine serves).
        Each reply's records are replayed through the spec and in order per machine
        instance (a step must start where the last one ended); the engine's state must be
        the one its trace ends in, and must agree with the client's view of sleep
        (SLEEPING exactly when the engine's state is in ``REPORTS_SLEEPING``). Unless this
        is the ``baseline`` (the first drain of this model: what came before is nobody's
        here), every request the client saw finish must have ended the same way in the
        engine's lifecycle (``ENGINE_FINISHED``), and with no request live on the client,
        none may be live in the engine. Returns every reply's records as trace entries."""
        entries: list[TraceEntry] = []
        for label, reply, view in drains:
            got = engine_trace_entries(reply)
            check_traces(got)
            entries += got
            side = self.engine_sides.get(label)
            if side is None or side.source != reply.source:
                side = self.engine_sides[label] = _EngineSide(reply.source)
            side.replay(reply, label, baseline=baseline)
            self.trace_incomplete += reply.dropped
            asleep = reply.state in REPORTS_SLEEPING
            if view in CLIENT_LIVE and (view in CLIENT_ASLEEP) != asleep:
                raise OracleViolation(
                    f"{_engine_name(label)} is {reply.state.name} (is_sleeping() {asleep}),"
                    f" but its client is {view.name}: the two sides disagree about sleep")
        if not baseline:
            self._confirm_finishes()
            if not self.live_ids():
                for label, side in sorted(self.engine_sides.items()):
                    live = side.live_requests()
                    if live and not side.incomplete:
                        raise OracleViolation(
                            f"no request is live on the client, yet {_engine_name(label)}'s"
                            f" trace leaves {live} live (an engine request nobody will end)")
        return entries

    def _confirm_finishes(self) -> None:
        keep: list[tuple[str, FinishReason, int]] = []
        for rid, reason, label in self.engine_pending:
            side = self.engine_sides.get(label)
            if rid in self.engine_unjudged or (side is not None and side.incomplete):
                continue
            if side is None:  # not drained yet
                keep.append((rid, reason, label))
                continue
            ended = side.finished.get(rid)
            want = ENGINE_FINISHED[reason]
            if not ended:
                now = side.requests.get(rid)
                raise OracleViolation(
                    f"{rid!r} finished {reason.name} on the client, but"
                    f" {_engine_name(label)}'s trace "
                    + (f"leaves it {now}" if now else "never names it")
                    + f" (it must end {want})")
            got = ended.popleft()
            if got != want:
                raise OracleViolation(
                    f"{rid!r} finished {reason.name} on the client, but"
                    f" {_engine_name(label)}'s own lifecycle ended it {got} (want {want}):"
                    " the engine's books disagree with what it sent (its steps for that id:"
                    + ";".join(f" {b} -{e}-> {a}{' (baseline)' if base else ''}"
                                for b, e, a, base in side.steps.get(rid, ()))
                    + "; the client's endings:"
                    + ",".join(f" {r.name} from engine {i}{'' if j else ' (not judged)'}"
                               for r, i, j in self.finish_log.get(rid, ())) + ")")
        self.engine_pending = keep


# --- spec as oracle --------------------------------------------------------------------------


# Counts that are zero in every audit (a double free, a block both free and held, one neither,
# a cache entry naming a block that holds something else, a finished or foreign request left
# in the running list) and those that must be zero once no request is live.
_ALWAYS_ZERO = (("kv", "negative_refs"), ("kv", "free_and_referenced"), ("kv", "unaccounted"),
                ("kv", "cache_mismatch"), ("scheduler", "running_finished"),
                ("scheduler", "running_unknown"))
_QUIET_ZERO = (("kv", "referenced"), ("scheduler", "live"), ("scheduler", "running"),
               ("scheduler", "waiting"), ("scheduler", "waiting_in_queue"),
               ("scheduler", "draining"), ("scheduler", "draining_waiting"),
               ("", "pending_outputs"), ("", "deferred_replies"), ("", "mid_step_aborts"))


def audit_violations(audit: ResourceAudit, *, quiet: bool,
                     asleep_tags: frozenset[str] | None = None) -> list[str]:
    """What is wrong with one engine's ``audit_resources()`` reply (an empty list: nothing).
    ``quiet``: no request is live, as the client sees it; ``asleep_tags``: the memory the
    model says is released (None: not known)."""
    if not isinstance(audit, ResourceAudit):
        return [f"audit_resources replied no ResourceAudit: {audit!r:.300}"]

    def get(part: str, key: str) -> Any:
        return getattr(getattr(audit, part) if part else audit, key)

    out = [f"{part + '.' if part else ''}{key} = {get(part, key)}"
           for part, key in _ALWAYS_ZERO + (_QUIET_ZERO if quiet else ())
           if get(part, key) != 0]
    kv, sched = audit.kv, audit.scheduler
    if kv.total_refs != sched.request_block_refs:
        out.append(f"kv.total_refs = {kv.total_refs} but the live requests hold"
                   f" {sched.request_block_refs} block references")
    if kv.num_free_blocks + kv.referenced != kv.num_blocks:
        out.append(f"{kv.num_free_blocks} free + {kv.referenced} held blocks"
                   f" != {kv.num_blocks}")
    if quiet and kv.num_free_blocks != kv.num_blocks:
        out.append(f"only {kv.num_free_blocks} of {kv.num_blocks} KV blocks free"
                   " with no request live (a leak)")
    if asleep_tags is not None and set(audit.asleep_tags) != set(asleep_tags):
        out.append(f"memory asleep {sorted(audit.asleep_tags)}, the model says"
                   f" {sorted(asleep_tags)}")
    return out


# What each finish reason is in the engine's request machine: the event of the reason's name
# from RUNNING (spec/request.py); a rejected request ends FINISHED_ERROR too.
ENGINE_FINISHED: dict[FinishReason, str] = {
    r: ENGINE_REQUEST.table()[(EngineRequestState.RUNNING, EngineRequestEvent[r.name], None)].name
    for r in FinishReason}
_E_LIVE = frozenset(s.name for s in ENGINE_REQUEST_LIVE)
_E_NEW = EngineRequestState.UNKNOWN.name  # where a request id's next lifecycle starts
_E_FINISHED = frozenset(ENGINE_FINISHED.values())


def _engine_name(label: int) -> str:
    return f"engine {label}"


def engine_trace_entries(reply: TraceDrain) -> list[TraceEntry]:
    """A ``drain_trace`` reply's records as trace entries; their place in the engine's order
    stands in for the time (another process's clock is not comparable with ours)."""
    # The types are the decoder's to check; the columns' lengths are not.
    if not isinstance(reply, TraceDrain) or len({len(c) for c in _columns(reply)}) != 1:
        raise OracleViolation(f"drain_trace returned no trace: {reply!r:.300}")
    return [(m, b, e, a, float(i))
            for i, (m, b, e, a, _) in enumerate(zip(*_columns(reply), strict=True))]


def _columns(reply: TraceDrain) -> tuple[tuple[str, ...], ...]:
    return reply.machine, reply.before, reply.event, reply.after, reply.subject


@dataclass
class _EngineSide:
    """One engine core's replayed trace, as one model of the client saw it drained."""

    source: str
    state: str | None = None
    session: str | None = None
    requests: dict[str, str] = field(default_factory=dict)  # id -> its latest lifecycle's state
    ours: set[str] = field(default_factory=set)  # ids whose latest lifecycle began after baseline
    # id -> the finished states of its lifecycles begun after the baseline, in engine order
    finished: dict[str, deque[str]] = field(default_factory=dict)
    incomplete: bool = False  # records were dropped: requests are no longer judged
    # id -> its last steps as recorded, (before, event, after, in a baseline drain): a
    # violation names what led to it (formatted then, not per record)
    steps: dict[str, deque[tuple[str, str, str, bool]]] = field(default_factory=dict)

    def live_requests(self) -> list[str]:
        return sorted(r for r, s in self.requests.items() if s in _E_LIVE)

    def replay(self, reply: TraceDrain, label: int, *, baseline: bool) -> None:
        """Each machine instance's steps in order: a step starts where its last one ended."""
        def jump(what: str, was: str | None, step: str) -> OracleViolation:
            return OracleViolation(f"{_engine_name(label)}'s trace jumps: {what} was {was},"
                                   f" then recorded {step}")

        for m, b, e, a, rid in zip(*_columns(reply), strict=True):
            if m == ENGINE.name:
                if self.state is not None and b != self.state:
                    raise jump("the engine", self.state, f"{b} -{e}-> {a}")
                self.state = a
            elif m == SESSION.name:
                if self.session is not None and b != self.session:
                    raise jump("the session", self.session, f"{b} -{e}-> {a}")
                self.session = a
            elif m == ENGINE_REQUEST.name:
                was = self.requests.get(rid)
                if b == _E_NEW:
                    if was in _E_LIVE:
                        raise jump(f"request {rid!r}", was, f"a new lifecycle: {b} -{e}-> {a}")
                    if baseline:
                        self.ours.discard(rid)
                    else:
                        self.ours.add(rid)
                elif was is not None and b != was:
                    raise jump(f"request {rid!r}", was, f"{b} -{e}-> {a}")
                self.requests[rid] = a
                self.steps.setdefault(rid, deque(maxlen=12)).append((b, e, a, baseline))
                if a in _E_FINISHED and b not in _E_FINISHED and rid in self.ours:
                    self.finished.setdefault(rid, deque()).append(a)
        if reply.dropped:
            # The kept records came first: what followed them is lost, so the instances'
            # states are unknown from here and the requests are no longer judged.
            self.incomplete = True
            self.requests.clear()
            self.session = None
            self.state = None
        # The replay follows the records' names; the engine's own word is its state member.
        if self.state is None:
            self.state = reply.state.name
        elif self.state != reply.state.name:
            raise OracleViolation(f"{_engine_name(label)}'s trace ends in {self.state}, but"
                                  f" the engine says it is {reply.state.name}")


def check_traces(trace: Iterable[TraceEntry]) -> None:
    """Replay a recorded trace through every spec machine (SpecViolation on a bad step)."""
    entries = list(trace)
    for machine in MACHINES:
        validate_trace(machine, entries)


class Coverage:
    """Which declared (machine, source, event, target) steps the campaign reached."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, str, str], int] = {}

    def add(self, trace: Iterable[TraceEntry]) -> None:
        seen = self.seen
        for name, before, event, after, _ in trace:
            key = (name, before, event, after)
            seen[key] = seen.get(key, 0) + 1

    def merge(self, other: Coverage) -> None:
        for k, v in other.seen.items():
            self.seen[k] = self.seen.get(k, 0) + v

    def declared(self) -> list[tuple[str, str, str, str]]:
        keys = {(m.name, t.source.name, t.event.name, t.target.name)
                for m in MACHINES for t in m.transitions}
        return sorted(keys)

    def report(self) -> dict[str, Any]:
        declared = self.declared()
        states = sorted({(m.name, s.name) for m in MACHINES for s in m.states})
        seen_states = {(k[0], k[1]) for k in self.seen} | {(k[0], k[3]) for k in self.seen}
        seen_states |= {(m.name, m.initial.name) for m in MACHINES}
        missing = [k for k in declared if k not in self.seen]
        per_machine = {}
        for m in MACHINES:
            total = sum(1 for k in declared if k[0] == m.name)
            hit = sum(1 for k in declared if k[0] == m.name and k in self.seen)
            per_machine[m.name] = {"transitions": total, "reached": hit}
        return {
            "transitions_declared": len(declared),
            "transitions_reached": len(declared) - len(missing),
            "states_declared": len(states),
            "states_reached": sum(1 for s in states if s in seen_states),
            "per_machine": per_machine,
            "never_reached_transitions": ["{} {} -{}-> {}".format(*k) for k in missing],
            "never_reached_states": [f"{m} {s}" for m, s in states if (m, s) not in seen_states],
        }


# --- liveness at teardown --------------------------------------------------------------------
# What counts as left behind is _harness.py's one definition; these say it as OracleViolation.


def check_released(before: ResourceSnapshot, *, engine_pid: int | None,
                   ipc_path: str | None, bound: float = RELEASE_BOUND_S,
                   threads_fds: bool = True) -> None:
    """After shutdown: the engine process is reaped, and no thread, fd or ipc file is left."""
    problems: list[str] = []
    if engine_pid is not None and not wait_until(lambda: reaped(engine_pid), bound):
        problems.append(f"engine process {engine_pid} was not reaped")
    if ipc_path is not None and not wait_until(lambda: not os.path.exists(ipc_path), bound):
        problems.append(f"ipc directory {ipc_path} was left behind")
    if threads_fds:
        leaks = left_behind(before, bound=bound, kinds=("threads", "fds"))
        problems += describe_leaks(leaks, before)
    if problems:
        raise OracleViolation("; ".join(problems))


# --- data parallel: one client over N engines -------------------------------------------------


class DPOracle(Oracle):
    """The request model of a data-parallel client (runtime/dp_client.py) over ``engines``
    engine cores, on top of ``Oracle``'s per-request judgement.

    It is told which engines the test killed (``engine_died``) and which requests it pinned
    (``add(..., rank=k)``); it learns where a routed request runs from its first output's
    ``engine_index``, and then judges: a request's outputs all come from one engine; none
    comes from an engine that was dead when the request was added; an ERROR ending comes only
    from an engine whose death could have ended it (it ran there, or nobody knew where it ran
    yet), and names that engine; a request known to run on a killed engine must end (a drain
    waits for it even when it was parked). The client is DEAD only when every engine is."""

    def __init__(self, *, exact_tokens: bool, engines: int,
                 dead: Iterable[int] = (), members: Iterable[int] | None = None) -> None:
        super().__init__(exact_tokens=exact_tokens)
        # The indexes of the client's set (``data_parallel_size`` of them): 0..engines-1
        # until a scale (stateful_dp_elastic.py) takes some out or adds others.
        self.members: list[int] = sorted(range(engines) if members is None else members)
        self.dead: set[int] = set(dead)
        # Indexes that left by a scale-down (not in the set since), and those joining now.
        self.gone: set[int] = set()
        self.joining: set[int] = set()
        # rid -> the engines that served when it was added: no other may send its outputs.
        self.allowed: dict[str, frozenset[int]] = {}
        # rid -> the leaver it was live on when a scale took it out, where only that removal
        # (not an abort the test sent) may end it ABORT: its stop reason must name the removal.
        self.removed_on: dict[str, int] = {}
        self.placed: dict[str, int] = {}  # rid -> the engine it was pinned to or seen on
        self.avoid: dict[str, frozenset[int]] = {}  # rid -> engines dead when it was added
        self.may_fail_on: dict[str, set[int]] = {}  # rid -> engines whose death may end it
        self.doomed: set[str] = set()  # known to run on an engine that died: must end
        self._batch_engine: int | None = None

    @property
    def engines(self) -> int:
        """How many engines the client's set has (``data_parallel_size``)."""
        return len(self.members)

    def serving(self) -> list[int]:
        return [i for i in self.members if i not in self.dead]

    def add(self, rid: str, max_tokens: int, expected: list[int] | None,
            stop_index: int | None, *, invalid: bool = False, rank: int | None = None,
            avoid: Iterable[int] | None = None) -> None:
        super().add(rid, max_tokens, expected, stop_index, invalid=invalid)
        self.placed.pop(rid, None)
        if rank is not None:
            self.placed[rid] = rank
        self.avoid[rid] = frozenset(self.dead if avoid is None else avoid)
        self.allowed[rid] = frozenset(i for i in self.serving() if i not in self.joining)
        self.may_fail_on[rid] = set()
        self.doomed.discard(rid)
        self.removed_on.pop(rid, None)

    def engine_died(self, index: int, *, restarted: bool = False) -> None:
        """Engine ``index`` was killed and its death seen (``restarted``: a replacement under
        the same index serves again). Ends the client when no engine is left."""
        # Its records since the last drain went with it: what it finished is not judged.
        self.engine_pending = [p for p in self.engine_pending if p[2] != index]
        self.engine_sides.pop(index, None)
        for rid in self.live_ids():
            where = self.placed.get(rid)
            if where is None or where == index:
                self.may_fail_on[rid].add(index)
            if where == index:
                self.doomed.add(rid)
        if not restarted:
            self.dead.add(index)
            if not self.serving():
                self.died()

    def abort(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        super().abort(ids)
        for rid in ids:  # an abort of the test's own may end it now, with no stop reason
            self.removed_on.pop(rid, None)

    def pause(self, mode: str, level: int | None = None) -> list[str]:
        if mode == "abort":  # ends what still runs ABORT, with no stop reason
            self.removed_on.clear()
        return super().pause(mode, level)

    def joined(self, indexes: Iterable[int]) -> None:
        """A scale-up committed: ``indexes`` serve from now (new engines, new channels)."""
        for i in indexes:
            self.gone.discard(i)
            self.dead.discard(i)
            self.engine_sides.pop(i, None)  # a reused index is another engine
            if i not in self.members:
                self.members.append(i)
        self.members.sort()
        self.joining.clear()

    def left(self, index: int) -> None:
        """A scale-down took engine ``index`` out of the set (from the moment ``scale`` was
        called). Each request live there ends exactly once: normally (its drain), ABORT
        naming the removal (the rest at the drain's end), or ERROR where the leaver died
        meanwhile; a request not yet seen anywhere may have gone there too. Its records
        went with it: what it finished is not judged against its trace."""
        self.engine_pending = [p for p in self.engine_pending if p[2] != index]
        self.engine_sides.pop(index, None)
        for rid in self.live_ids():
            where = self.placed.get(rid)
            if where is None or where == index:
                m = self.requests[rid]
                self.may_fail_on[rid].add(index)
                if not m.abort_ok:
                    m.abort_ok = True
                    self.removed_on[rid] = index
            if where == index:
                self.doomed.add(rid)
        if index in self.members:
            self.members.remove(index)
        self.dead.discard(index)
        self.gone.add(index)

    def must_finish_ids(self) -> list[str]:
        doomed = {r for r in self.doomed if not self.requests[r].finished}
        return sorted(set(super().must_finish_ids()) | doomed)

    def observe(self, batch: EngineCoreOutputs) -> list[str]:
        e = batch.engine_index
        for out in batch.outputs:
            rid = out.request_id
            m = self.requests.get(rid)
            if m is None or m.finished:
                continue  # judged by Oracle.observe
            if e in self.avoid.get(rid, ()):
                raise OracleViolation(
                    f"{rid!r} was added while engine {e} was dead, yet engine {e} sent an"
                    " output for it: a request was routed to a dead engine")
            allowed = self.allowed.get(rid)
            if allowed is not None and e not in allowed:
                raise OracleViolation(
                    f"{rid!r} was added while engines {sorted(allowed)} served, yet engine"
                    f" {e} sent an output for it: a request was routed to an engine that was"
                    " not serving (joining, leaving or removed)")
            if (rid in self.removed_on and out.finish_reason is not None
                    and FinishReason(out.finish_reason) is FinishReason.ABORT
                    and "removed" not in str(out.stop_reason)):
                raise OracleViolation(
                    f"{rid!r} was live on engine {self.removed_on[rid]} when a scale removed"
                    f" it and no abort was sent, yet it ended ABORT with stop reason"
                    f" {out.stop_reason!r}, which does not name the removal")
            where = self.placed.get(rid)
            if where is None:
                self.placed[rid] = e
            elif where != e:
                raise OracleViolation(f"{rid!r} runs on engine {where}, yet engine {e} sent an"
                                      " output for it")
        self._batch_engine = e
        try:
            return super().observe(batch)
        finally:
            self._batch_engine = None

    def _finish_engine(self) -> int:
        return 0 if self._batch_engine is None else self._batch_engine

    def _engine_judges(self, m: RequestModel) -> bool:
        # An engine that may have run it died while it was live: an ending delivered under
        # that index may be a batch that incarnation queued, whose records went with it (read
        # after the replacement, under the same index, was drained). An ending another engine
        # delivered is that engine's, fully recorded: judged, or its record would be left to
        # pair with the next lifecycle of a reused id (found by the campaign: a reused id's
        # STOP judged against the ABORT of its previous lifecycle, ended while another engine
        # died).
        died = self.may_fail_on.get(m.rid)
        return not died or (self._batch_engine is not None and self._batch_engine not in died)

    def _finish(self, m: RequestModel, reason: FinishReason, error: str | None) -> None:
        e = self._batch_engine
        if (reason is FinishReason.ERROR and not (m.error_ok or m.duplicated)):
            if e not in self.may_fail_on.get(m.rid, ()):
                died = sorted(i for r in self.may_fail_on.values() for i in r) or "none"
                raise OracleViolation(
                    f"{m.rid!r} ended with ERROR from engine {e} ({error!r}), whose death"
                    f" could not end it (it ran on {self.placed.get(m.rid)}; engines killed"
                    f" while it was live: {died})")
            if not error or f"engine {e}" not in error:
                raise OracleViolation(f"{m.rid!r}: the ERROR ending of engine {e}'s death does"
                                      f" not name the engine: {error!r}")
            m.finish = reason
            self.finished_ids.append(m.rid)
            return
        super()._finish(m, reason, error)


def check_reaped(pids: Iterable[int], before: ResourceSnapshot,
                 bound: float = RELEASE_BOUND_S) -> None:
    """After a shutdown: every engine process in ``pids`` is gone (reaped, not a zombie), and
    this process has no child it did not have in ``before`` (_harness.py: what a child is)."""
    problems = [f"engine process {pid} was not reaped" for pid in sorted(set(pids))
                if not wait_until(functools.partial(reaped, pid), bound)]
    problems += describe_leaks(left_behind(before, bound=bound, kinds=("processes",)), before)
    if problems:
        raise OracleViolation("; ".join(problems))
