"""``ElasticDPStateMachine``: the data-parallel campaign with engines joining and leaving.

Theory of operation
-------------------
Rule 1: as in ``stateful_dp.py``, preconditions and strategies read only the model
(``DPOracle``): which indexes are in the set (``members``), which the test killed, whether it
paused them. The set stays between ``MIN_ENGINES`` and ``MAX_ENGINES`` engines, so a program
on a 2-core machine never runs more than three engine processes of its own.
Rule 2: every rule ends at a bounded synchronization point: a scale's call returned (or
raised), and what it owes was seen (the leaver's requests ended, its process gone).

On top of ``DataParallelStateMachine``'s rules (which it inherits, unchanged), the machine
calls ``scale`` (``scale_async`` on the async client, runtime/dp_client.py) while requests
stream:

- ``scale_up``: one or two engines join (at most ``MAX_ENGINES``). The last joiner's start
  is held back (a ``before_ready`` delay), so the scale stays open while the test sends
  routed ADDs, a ``call_utility_all`` and a second ``scale`` (refused: one at a time). None
  of those may reach a joiner: the ADDs' outputs come from the engines that served when they
  were sent, the call answers once per engine serving then, and no joiner serves while
  another still starts. With ``joiner_dies`` the joiners' processes are SIGKILLed as they
  appear, before their handshake: the scale raises ``EngineStartupError`` naming one and
  the previous set serves on.
- ``scale_down``: one engine leaves (the default leaver, the highest index, or
  ``remove=[i]``), with a drain of ``DRAIN_S`` or none. ``during`` says what races it: long
  requests streaming on every engine (the stayers busier, so a router that still counts the
  leaver would pick it), a ``call_utility_all`` held pending on the SIGSTOPped leaver (it
  raises ``EngineDeadError`` naming it), or a SIGKILL of the leaver during its drain (a
  dead leaver is simply gone: its requests end ERROR naming it).
- ``scale_down_racing``, ``scale_up_racing_a_kill`` and ``scale_to_one_then_three`` call the
  two above with the races drawn more often (the last: two joiners at once).
- both are refused (``SpecViolation`` of the SCALE machine) on a sleeping or paused client,
  which is then woken and resumed (each a rule of its own, in the reproducer).

What the oracle adds (``oracle.DPOracle``): an output's engine served when its request was
sent (never a joiner before the scale committed, never a leaver from the scale's call on,
never a removed index); each request live on a leaver ends exactly once, normally, ABORT
with a stop reason naming the removal, or ERROR naming it where it died; ``engines`` and
``data_parallel_size`` match the model after each scale; the client is DEAD only when no
engine is left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import time
from typing import Any

import psutil
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ..runtime.fault_points import FaultPoint
from ..runtime.faults import Fault, FaultAction
from ..spec.errors import EngineDeadError, EngineStartupError, SpecViolation
from ..spec.membership import MembershipState
from . import conformance as cf
from ._harness import wait_until
from .bounds import MAX_LIVE, WAIT_S
from .oracle import OracleViolation, Phase
from .stateful_dp import DOOMED_TOKENS, RESTART_BOUND_S, DataParallelStateMachine

__all__ = ["DRAIN_S", "MAX_ENGINES", "MIN_ENGINES", "ElasticDPStateMachine"]

MIN_ENGINES = 1
MAX_ENGINES = 3
# A scale-down's drain: long enough that a streaming leaver is still draining while the test
# sends its ADDs, short enough that a campaign of many scales stays fast.
DRAIN_S = 0.5
# How long the last joiner's start is held back: the window in which the scale is open.
JOIN_HOLD_S = 0.6
# The gap between the ADDs a scale's window sends: spread over it, not all at its start.
SEND_GAP_S = 0.15
# A scale's own bound: engine starts (about 0.7 s each, on a loaded 2-core machine more), the
# hold, the drain, and a leaver's process going.
SCALE_BOUND_S = RESTART_BOUND_S + JOIN_HOLD_S + DRAIN_S


class ElasticDPStateMachine(DataParallelStateMachine):
    """``DataParallelStateMachine`` plus ``scale_up``/``scale_down`` (the module docstring)."""

    # -- plumbing ---------------------------------------------------------------------------

    def _refused_while_paused(self, n: int) -> bool:
        """A paused or sleeping client refuses ``scale`` (SpecViolation, nothing changed);
        then it is woken and resumed. Whether it is still alive and serving."""
        if not self.oracle.paused:
            return True
        err = self._expect_raises(SpecViolation, lambda: self.cut._call("scale", n),
                                  "scale on a sleeping/paused client")
        if "wake it up first" not in str(err):
            raise OracleViolation(f"scale on a sleeping client: the refusal does not say"
                                  f" why: {err}")
        self._check_set("a refused scale")
        return self._unpause(True)

    def _check_set(self, after: str) -> None:
        """``engines`` and ``data_parallel_size`` are the model's picture."""
        client = self.cut.client
        want = {i: (MembershipState.DEAD if i in self.oracle.dead else MembershipState.SERVING)
                for i in self.oracle.members}
        if client.engines != want or client.data_parallel_size != self.engines:
            raise OracleViolation(
                f"after {after}: engines {self._states()}, data_parallel_size"
                f" {client.data_parallel_size}; the model says"
                f" {({i: s.name for i, s in want.items()})}")
        if self.oracle.phase is Phase.ALIVE and client.is_dead:
            raise OracleViolation(f"after {after}: the client is DEAD with engines"
                                  f" {self.oracle.serving()} serving")

    def _long(self, rank: int | None, n: int) -> None:
        """``n`` long requests (pinned to ``rank``, or routed) that stream through a scale."""
        for _ in range(n):
            if len(self.oracle.live_ids()) >= MAX_LIVE:
                return
            req, expected, _ = self._request(self._fresh_id(), [4, 5, 6],
                                             self.limits.cap(3, DOOMED_TOKENS), 3, None,
                                             rank=rank, ignore_eos=True)
            self._send(req, expected, None)

    def _during(self, fut: concurrent.futures.Future[Any], avoid: set[int], sends: int,
                call: bool, target: int | None, joiners: list[int] | None = None) -> None:
        """While scale ``fut`` runs: reads, and ``sends`` routed ADDs spread over it (one per
        ``SEND_GAP_S``), and (``call``) one ``call_utility_all``, none of which may reach an
        engine of ``avoid`` (joining or leaving); a second scale (to ``target``, where the
        first leads: harmless should the first have ended just before) is refused. The
        ``joiners`` serve together: never one while another still starts, and an ADD whose
        send may have followed the commit (it showed only after the send) may go to one."""
        joiners = joiners or []
        serving = [i for i in self.oracle.serving() if i not in avoid]
        deadline = time.monotonic() + SCALE_BOUND_S
        second = target is None
        last_send = 0.0
        while not fut.done() and time.monotonic() < deadline:
            committed = self._joiners_serve(joiners)
            if (sends and not committed and len(self.oracle.live_ids()) < MAX_LIVE
                    and time.monotonic() - last_send >= SEND_GAP_S):
                sends -= 1
                last_send = time.monotonic()
                req, expected, _ = self._request(self._fresh_id(), [7, 8], 6, 9, None)
                self._send(req, expected, None)  # not to a joiner or leaver: oracle.allowed
                if joiners and self._joiners_serve(joiners):
                    self.oracle.allowed[req.request_id] |= frozenset(joiners)
            if call:
                call = False
                got = self.cut._call("call_utility_all", "echo", "scaling")
                if got != ["scaling"] * len(serving) and not self._joiners_serve(joiners):
                    raise OracleViolation(
                        f"call_utility_all during a scale answered {got!r}; engines"
                        f" {serving} served when it was sent (not {sorted(avoid)})")
            if not second and not fut.done():
                second = True
                try:
                    self.cut._call("scale", target)
                except SpecViolation as e:
                    if "another scale" not in str(e):
                        raise OracleViolation(f"a second scale was refused without saying"
                                              f" why: {e}") from None
                except BaseException as e:
                    if not fut.done():
                        raise OracleViolation(f"a second scale while one ran raised {e!r},"
                                              " not SpecViolation") from e
                else:
                    if not fut.done():
                        raise OracleViolation("a second scale ran while one was running")
            with contextlib.suppress(EngineDeadError):
                self._poll(0.01)

    def _joiners_serve(self, joiners: list[int]) -> bool:
        """Whether the scale-up of ``joiners`` committed (all SERVING). One serving while
        another still starts is a violation: they take work together, once all are up."""
        if not joiners:
            return False
        engines = self.cut.client.engines
        states = {i: engines.get(i) for i in joiners}
        up = [i for i, st_ in states.items() if st_ is MembershipState.SERVING]
        if up and len(up) < len(joiners) and any(
                st_ is MembershipState.STARTING for st_ in states.values()):
            raise OracleViolation(
                f"joiners {up} serve while joiners"
                f" {[i for i in joiners if i not in up]} still start: a joiner takes work"
                f" before the scale commits (engines {self._states()})")
        return len(up) == len(joiners)

    def _result(self, fut: concurrent.futures.Future[Any], what: str) -> BaseException | None:
        """The scale's end: None when it returned, its exception otherwise (bounded)."""
        try:
            fut.result(timeout=SCALE_BOUND_S + WAIT_S)
        except concurrent.futures.TimeoutError:
            raise OracleViolation(f"{what} did not return within"
                                  f" {SCALE_BOUND_S + WAIT_S:g} s (engines"
                                  f" {self._states()})") from None
        except BaseException as e:  # judged by the caller
            return e
        return None

    # -- scale up ---------------------------------------------------------------------------

    @precondition(lambda self: self.alive and self.engines < MAX_ENGINES)
    @rule(by=st.integers(1, 2), during=st.sampled_from(["idle", "streaming", "call"]),
          joiner_dies=st.booleans())
    def scale_up(self, by: int, during: str, joiner_dies: bool) -> None:
        """One or two engines join while requests stream (the module docstring)."""
        with self._rule("scale_up", locals()):
            by = min(by, MAX_ENGINES - self.engines)
            n = self.engines + by
            if not self._refused_while_paused(n):
                return
            free = (i for i in range(MAX_ENGINES + 1) if i not in self.oracle.members)
            joiners = [next(free) for _ in range(by)]
            held = joiners[-1]
            if during == "streaming":
                self._long(None, 2)
            client = self.cut.client
            options = client.options
            client.options = dataclasses.replace(options, engine_fault={
                held: Fault(point=FaultPoint.BEFORE_READY, action=FaultAction.DELAY,
                            arg=JOIN_HOLD_S)})
            before = {p.pid for p in psutil.Process().children()}
            self.oracle.joining = set(joiners)
            try:
                fut = self.cut.submit("scale", n)
                killed = self._kill_joiners(before, by) if joiner_dies else []
                self._during(fut, set(joiners), 12 if during != "idle" else 0,
                             during == "call", None if joiner_dies else n, joiners)
                err = self._result(fut, f"scale({n})")
            finally:
                client.options = options
                self.oracle.joining = set()
            assert self.live is not None
            self.live.pids.update(killed)
            if joiner_dies:
                # The held joiner was killed before its handshake (it waits JOIN_HOLD_S
                # after its start): the scale fails naming a joiner, the set is as before.
                self.stats.faults["joiner_sigkill"] += len(killed)
                if not killed:
                    raise OracleViolation(f"scale({n}): no joiner process showed within"
                                          f" {RESTART_BOUND_S:g} s")
                if not isinstance(err, EngineStartupError) or "failed to join" not in str(err):
                    raise OracleViolation(f"scale({n}) whose joiners were killed before their"
                                          f" handshake raised {err!r}, not EngineStartupError")
                if not any(f"engine {j} " in str(err) for j in joiners):
                    raise OracleViolation(f"scale({n}): the EngineStartupError does not name"
                                          f" a joiner ({joiners}): {err}") from err
                self._check_set(f"scale({n}) that failed")
                self.echo_count()
                return
            if err is not None:
                raise OracleViolation(f"scale({n}) raised {type(err).__name__}: {err}"
                                      ) from err
            self.oracle.joined(joiners)
            self.stats.engines_started += by
            self.live.note_pids()
            self._check_set(f"scale({n})")
            self.echo_count()

    def _kill_joiners(self, before: set[int], count: int) -> list[int]:
        """SIGKILL the ``count`` joiners' processes (this process's children not in
        ``before``) as soon as they show, during their start; their pids."""
        found: list[int] = []

        def started() -> bool:
            found[:] = [p.pid for p in psutil.Process().children() if p.pid not in before]
            return len(found) >= count

        wait_until(started, RESTART_BOUND_S, poll=0.005)
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return list(found)

    def echo_count(self) -> None:
        """``call_utility_all`` answers once per serving engine, in index order."""
        if not self.alive:
            return
        got = self.cut._call("call_utility_all", "echo", 0)
        if got != [0] * len(self.oracle.serving()):
            raise OracleViolation(f"call_utility_all answered {got!r} with engines"
                                  f" {self.oracle.serving()} serving")

    # -- scale down -------------------------------------------------------------------------

    @precondition(lambda self: self.alive and self.engines > MIN_ENGINES)
    @rule(pick=st.integers(0, 3), default_leaver=st.booleans(), drain=st.booleans(),
          during=st.sampled_from(["idle", "streaming", "call_pending", "kill_leaver"]))
    def scale_down(self, pick: int, default_leaver: bool, drain: bool, during: str) -> None:
        """One engine leaves while requests stream (the module docstring)."""
        with self._rule("scale_down", locals()):
            n = self.engines - 1
            if not self._refused_while_paused(n):
                return
            members = self.oracle.members
            # The set keeps a serving engine: the client is DEAD only when none is left.
            can = [i for i in members if set(self.oracle.serving()) - {i}]
            if not can:
                return
            k = max(members) if default_leaver and max(members) in can else can[pick % len(can)]
            remove = None if k == max(members) and default_leaver else [k]
            client = self.cut.client
            alive = k not in self.oracle.dead
            member = client.engine_client(k) if alive else None
            pid = None if member is None else member.engine_pid
            if during != "idle" and alive:
                self._long(k, 1)
                for i in self.oracle.serving():
                    if i != k:
                        self._long(i, 2)
            pending: concurrent.futures.Future[Any] | None = None
            if during == "call_pending" and pid is not None:
                cf.stop_process(pid)
                try:
                    pending = self.cut.submit("call_utility_all", "echo", "pending")
                    self._wait_pending(1, pending)
                except BaseException:
                    os.kill(pid, signal.SIGKILL)
                    raise
            drain_s = DRAIN_S if drain else 0.0
            fut = self.cut.submit("scale", n, drain=drain, drain_timeout_s=drain_s,
                                  remove=remove)
            # From the call on, the leaver takes nothing new (the model: it left now); the
            # call runs in a thread (or a task): it began once the leaver is not SERVING.
            wait_until(lambda: fut.done()
                       or client.engines.get(k) is not MembershipState.SERVING, WAIT_S,
                       poll=0.001)
            self.oracle.left(k)
            assert self.live is not None
            self.live.dead.discard(k)
            if during == "kill_leaver" and pid is not None:
                wait_until(lambda: client.engines.get(k) is not MembershipState.SERVING,
                           WAIT_S, poll=0.001)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.stats.faults["leaver_sigkill"] += 1
            self._during(fut, {k}, 4 if during == "streaming" else 0, False, n)
            err = self._result(fut, f"scale({n}, remove={remove!r})")
            if err is not None:
                raise OracleViolation(f"scale({n}, remove={remove!r}) raised"
                                      f" {type(err).__name__}: {err}") from err
            if pid is not None and not wait_until(lambda: _gone(pid), 1.0):
                raise OracleViolation(f"engine {k}'s process {pid} outlived the scale that"
                                      " removed it")
            if pending is not None:
                self.stats.faults["call_pending_on_leaver"] += 1
                self._pending_fails(pending, k, WAIT_S, f"engine {k}", "left")
            self._check_set(f"scale({n}, remove={remove!r})")
            # What the leaver ran ends (its drain, the removal's ABORT, or its death's ERROR).
            self._drain(sorted(self.oracle.doomed), bound=WAIT_S)
            # Routed after the removal: never to the removed index (the oracle's check).
            self._long(None, 1)
            self.echo_count()

    # -- the races, as rules of their own ----------------------------------------------------
    # As choices of scale_up/scale_down alone, a short derandomized run met each race about
    # once (the machine has some twenty rules): these weigh them up. Each is its inner
    # rule's call, in the reproducer.

    @precondition(lambda self: self.alive and self.engines > MIN_ENGINES)
    @rule(pick=st.integers(0, 3), drain=st.booleans(),
          how=st.sampled_from(["call_pending", "kill_leaver", "streaming"]))
    def scale_down_racing(self, pick: int, drain: bool, how: str) -> None:
        """``scale_down`` with ``remove=[i]`` racing a pending call, a kill or streams."""
        self.scale_down(pick=pick, default_leaver=False, drain=drain, during=how)

    @precondition(lambda self: self.alive and self.engines < MAX_ENGINES)
    @rule(by=st.integers(1, 2))
    def scale_up_racing_a_kill(self, by: int) -> None:
        """``scale_up`` whose joiners are SIGKILLed during their start."""
        self.scale_up(by=by, during="idle", joiner_dies=True)

    @precondition(lambda self: self.alive and self.engines > MIN_ENGINES)
    @rule(drain=st.booleans())
    def scale_to_one_then_three(self, drain: bool) -> None:
        """Down to one engine (default leavers), then two join at once while requests
        stream: only two joiners show whether they serve together."""
        while self.alive and self.engines > MIN_ENGINES and set(self.oracle.serving()) - {
                max(self.oracle.members)}:
            self.scale_down(pick=0, default_leaver=True, drain=drain, during="idle")
        if self.alive and self.engines == MIN_ENGINES:
            self.scale_up(by=2, during="streaming", joiner_dies=False)


def _gone(pid: int) -> bool:
    """``pid`` exited (a zombie not yet reaped counts: its reaper is the client's)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
