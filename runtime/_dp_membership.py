"""A data-parallel client's membership (dp_client.py): which engine indexes serve, their
start, death, restart and teardown, one MEMBERSHIP lifecycle per index (spec/membership.py).

``Membership`` owns the slots and every incarnation of every engine (the current one, and
dead ones whose batches are still to be read); the client owns the requests and its own
CLIENT lifecycle, and is told through the callbacks it hands over: ``changed`` (wake the
readers), ``all_dead`` (no engine is left), ``follow_power`` (derive the client's power state
from the members'). Everything here runs under the client's state lock, which it shares.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..spec.errors import ClientClosedError, EngineDeadError, EngineStartupError
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.membership import (
    MEMBER_DOWN,
    MEMBER_GONE,
    MEMBER_IN_SET,
    MEMBER_LEFT,
    MEMBER_ROUTABLE,
    MEMBERSHIP,
    MembershipEvent,
    MembershipState,
)
from ._dp_members import Member

__all__ = [
    "GONE_BOUND_S",
    "RESTART_BACKOFF_MAX_S",
    "RESTART_BACKOFF_S",
    "RESTART_STABLE_S",
    "Membership",
    "Slot",
]

logger = logging.getLogger(__name__)

# A crash loop's bound: an incarnation that dies within RESTART_STABLE_S of its handshake died
# "at once". Each such death in a row waits RESTART_BACKOFF_S, doubled per death up to
# RESTART_BACKOFF_MAX_S, before the next start; after ``restart_limit`` of them in a row the
# index stays DEAD (membership's DEAD: no RESTART is fired) and its cause says why.
RESTART_STABLE_S = 5.0
RESTART_BACKOFF_S = 0.25
RESTART_BACKOFF_MAX_S = 4.0
# How long a dead incarnation's process may take to go after SIGKILL before its replacement is
# refused: two engines under one index would share a device and (on Ray) an actor.
GONE_BOUND_S = 10.0


class Slot:
    """One engine index: its membership lifecycle and its incarnations."""

    __slots__ = ("cause", "client", "index", "lifecycle", "quick_deaths", "restarts",
                 "retired", "serving_since")

    def __init__(self, index: int, trace: list[TraceEntry] | None) -> None:
        self.index = index
        self.lifecycle: Lifecycle[MembershipState, MembershipEvent] = MEMBERSHIP.lifecycle(
            trace=trace)
        # The current incarnation; None while restarting. Changed only under the state lock:
        # a path that uses it takes it once, under that lock, and keeps that value (a restart
        # may set None at any moment outside it).
        self.client: Any = None
        # Dead incarnations whose queued batches are still to be read (then ERROR outputs):
        # all a dead incarnation still owes. Read to its end, it is shut down and forgotten.
        self.retired: list[Any] = []
        self.cause: BaseException | None = None
        self.restarts = 0
        self.serving_since = 0.0  # monotonic time of the current incarnation's handshake
        self.quick_deaths = 0  # consecutive incarnations that died within RESTART_STABLE_S

    @property
    def routable(self) -> bool:
        client = self.client
        return (self.lifecycle.state in MEMBER_ROUTABLE and client is not None
                and not client.is_dead)

    def incarnations(self) -> list[Any]:
        """Every incarnation still held, the dead ones first, then the current one (a copy:
        reading one to its end retires it)."""
        client = self.client
        return [*self.retired] if client is None else [*self.retired, client]


def ensure_gone(dead: Member, index: int) -> None:
    """Kill dead incarnation ``dead``'s engine process and wait (bounded) until it is gone;
    ``EngineStartupError`` if it outlives the bound. An attached engine is not ours to kill."""
    proc = dead.resources.proc
    if proc is None:
        return
    try:
        if proc.is_alive():
            proc.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
            proc.join(GONE_BOUND_S)
        alive = proc.is_alive()
    except ValueError:  # closed: its reaper shut the incarnation down, process included
        return
    if alive:
        raise EngineStartupError(
            f"engine {index}'s previous process (pid {proc.pid}) was still alive"
            f" {GONE_BOUND_S:g} s after SIGKILL; no replacement is started beside it")


class Membership:
    """The engine indexes of one data-parallel client and their incarnations."""

    def __init__(self, size: int, *, lock: threading.RLock, trace: list[TraceEntry] | None,
                 build: Callable[[int, threading.Event], Member], restart: bool,
                 restart_limit: int,
                 live: Callable[[], bool], changed: Callable[[], None],
                 all_dead: Callable[[BaseException], None],
                 follow_power: Callable[[], None], replaced: Callable[[int], None]) -> None:
        self.size = size
        self.slots = [Slot(i, trace) for i in range(size)]
        self._lock = lock
        self._build = build
        self._restart = restart
        self._restart_limit = restart_limit
        self._live, self._changed, self._all_dead = live, changed, all_dead
        self._follow_power, self._replaced = follow_power, replaced
        # Starts, restarts and reaps end here: set once, by teardown.
        self.abandon = threading.Event()
        # Restarts and reaps in progress: teardown joins them, so a dead incarnation being
        # shut down is waited for without being kept once it is gone.
        self._threads: set[threading.Thread] = set()
        # The abandon events of the scales starting engines now: teardown sets them too.
        self._starts: set[threading.Event] = set()

    # -- reading ------------------------------------------------------------------------------

    def serving(self) -> list[Slot]:
        return [s for s in self.slots if s.routable]

    def any_left(self) -> bool:
        return any(s.lifecycle.state in MEMBER_LEFT for s in self.slots)

    def states(self) -> dict[int, MembershipState]:
        """Each index's state, less the slots gone for good (``scale``)."""
        return {s.index: s.lifecycle.state for s in self.slots
                if s.lifecycle.state not in MEMBER_GONE}

    def not_serving(self) -> list[int]:
        """Indexes of the set whose engine died (dead, or restarting after a death)."""
        return [s.index for s in self.slots if s.lifecycle.state in MEMBER_DOWN]

    def in_set(self) -> list[Slot]:
        """The slots the client is meant to have: not leaving, not gone."""
        return [s for s in self.slots if s.lifecycle.state in MEMBER_IN_SET]

    def held(self) -> list[Any]:
        """Every incarnation still held, dead ones included."""
        return [c for s in self.slots for c in s.incarnations()]

    def describe(self) -> str:
        return ", ".join(f"{s.index}: {s.lifecycle.state.value}" for s in self.slots)

    def all_dead_cause(self) -> EngineDeadError:
        causes = ", ".join(f"engine {s.index}: {s.cause}" for s in self.slots)
        return EngineDeadError(f"every engine core of this client is dead ({causes})")

    # -- start --------------------------------------------------------------------------------

    def _build_all(self, slots: list[Slot], abandon: threading.Event
                   ) -> tuple[list[tuple[Slot, Member]], list[tuple[int, BaseException]]]:
        """Start the engines of ``slots`` at once (each waits for its own handshake); the
        first failure abandons the others' starts."""
        built: list[tuple[Slot, Member]] = []
        errors: list[tuple[int, BaseException]] = []
        with concurrent.futures.ThreadPoolExecutor(len(slots), thread_name_prefix="EngineCoreStart"
                                                   ) as pool:
            futures = [pool.submit(self._build, s.index, abandon) for s in slots]
            for s, fut in zip(slots, futures, strict=True):
                try:
                    built.append((s, fut.result()))
                except BaseException as e:  # each is reported by the caller
                    errors.append((s.index, e))
                    abandon.set()  # the others need not finish starting
        return built, errors

    def start_all(self) -> None:
        """Start every engine at once (each waits for its own handshake); the group is
        SERVING once all are, else ``EngineStartupError`` naming the first that failed."""
        n = self.size
        built, errors = self._build_all(self.slots, self.abandon)
        for s, client in built:
            s.client = client
        if errors:
            i, first = errors[0]
            raise EngineStartupError(
                f"engine {i} of {n} failed to start: {first}") from first
        with self._lock:
            # The client is ready once every engine is: one that died after its own
            # handshake, while the others were still starting, fails the construction too
            # (as the two-engine model says, spec/compose_dp.py).
            for s in self.slots:
                if s.client.is_dead:
                    cause = s.client.dead_cause
                    raise EngineStartupError(
                        f"engine {s.index} of {n} died while the others started: {cause}"
                    ) from cause
            now = time.monotonic()
            for s in self.slots:
                s.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)
                s.serving_since = now

    # -- scale --------------------------------------------------------------------------------

    def add_slots(self, count: int, trace: list[TraceEntry] | None) -> list[Slot]:
        """``count`` new slots, STARTING, at the lowest free indexes (a gone slot's index is
        free: its dead incarnations still to be read move to the new slot). Under the lock."""
        new: list[Slot] = []
        for i, old in enumerate(self.slots):
            if len(new) == count:
                break
            if old.lifecycle.state in MEMBER_GONE:
                slot = Slot(i, trace)
                slot.retired = old.retired
                self.slots[i] = slot
                new.append(slot)
        while len(new) < count:
            slot = Slot(len(self.slots), trace)
            self.slots.append(slot)
            new.append(slot)
        return new

    def join(self, slots: list[Slot]) -> None:
        """Start the engines of new ``slots`` and make them SERVING together; if any fails to
        start (or dies before the others are up, or the client closes), every one of them is
        REMOVED, the engines started are stopped, and ``EngineStartupError`` names it."""
        abandon = threading.Event()
        self._starts.add(abandon)
        if self.abandon.is_set():
            abandon.set()
        try:
            built, errors = self._build_all(slots, abandon)
        finally:
            self._starts.discard(abandon)
        with self._lock:
            for s, client in built:
                if client.is_dead and not errors:
                    errors.append((s.index, EngineStartupError(
                        f"engine {s.index} died while the others joined: {client.dead_cause}")))
            if not errors and not self._live():
                errors.append((slots[0].index, ClientClosedError(
                    "the client was shut down while engines joined")))
            if not errors:
                now = time.monotonic()
                for s, client in built:
                    s.client = client
                    s.serving_since = now
                    s.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)
                self._follow_power()
            else:
                failed = {i for i, _ in errors}
                for s in slots:
                    if s.index in failed and s.lifecycle.can(MembershipEvent.DIED):
                        s.lifecycle.fire(MembershipEvent.DIED)
                    if s.lifecycle.can(MembershipEvent.REMOVE):
                        s.lifecycle.fire(MembershipEvent.REMOVE)
        if not errors:
            self._changed()
            return
        for _, client in built:
            client.shutdown()
        i, first = errors[0]
        if isinstance(first, ClientClosedError):
            raise first
        raise EngineStartupError(
            f"engine {i} failed to join: {first}; the scale was undone (engines"
            f" {[s.index for s in self.in_set()]} serve as before)") from first

    def leave(self, s: Slot) -> None:
        """Scale-down takes ``s`` out of the set now: a serving engine DRAINS (no new work),
        a dead or restarting one is REMOVED at once. Under the lock."""
        if s.lifecycle.can(MembershipEvent.LEAVE):
            s.lifecycle.fire(MembershipEvent.LEAVE)
        elif s.lifecycle.can(MembershipEvent.REMOVE):
            s.lifecycle.fire(MembershipEvent.REMOVE)
            if s.client is not None:  # a replacement's start lost the race: it goes too
                s.retired.append(s.client)
                s.client = None

    def remove(self, s: Slot, client: Member) -> None:
        """A drained leaver goes: its process killed and gone (bounded), then DRAINED (its
        exit is no death); its batches still queued are read, then it is shut down."""
        with self._lock:
            if s.client is not client:
                return  # it died during the drain: gone already
            # Its exit is then DRAINED, not a death (``died``), and what it still ran ends ABORT.
            client.removal = f"engine {s.index} was removed by a scale-down"
        try:
            ensure_gone(client, s.index)
        finally:
            self.died(client, ClientClosedError(f"engine {s.index} was removed by a scale"))

    # -- death and restart --------------------------------------------------------------------

    # -- death and restart --------------------------------------------------------------------

    def died(self, client: Member, cause: BaseException) -> None:
        """Incarnation ``client``'s engine died (its monitor, reader or a send saw it), or a
        scale stopped it; idempotent: a retired incarnation, a second notice or a shutdown
        change nothing."""
        with self._lock:
            i = client.engine_index
            s = self.slots[i] if i < len(self.slots) else None
            if s is None or s.client is not client:
                return
            lc = s.lifecycle
            if lc.can(MembershipEvent.DRAINED):
                # A leaver: gone either way, never restarted; its batches are still read. A
                # planned exit (the drain ended) is DRAINED, any other a death (its live
                # requests then end with ERROR).
                planned = client.removal is not None
                lc.fire(MembershipEvent.DRAINED if planned else MembershipEvent.DIED)
                if not planned:
                    s.cause = cause
                s.retired.append(client)
                s.client = None
                self._replaced(s.index)
            elif lc.state in MEMBER_ROUTABLE:
                self._serving_died(s, client, cause)
            else:
                return
            self._after_loss(s, client.removal is not None)
        self._changed()

    def _serving_died(self, s: Slot, client: Member, cause: BaseException) -> None:
        """A serving engine died: DEAD, then (with restarts, within the limit) RESTARTING
        with a replacement starting. Under the lock."""
        s.lifecycle.fire(MembershipEvent.DIED)
        s.cause = cause
        restart = self._restart and self._live()
        if restart:
            quick = time.monotonic() - s.serving_since < RESTART_STABLE_S
            s.quick_deaths = s.quick_deaths + 1 if quick else 0
            if s.quick_deaths > self._restart_limit:
                restart = False
                s.cause = EngineDeadError(
                    f"engine {s.index} is not restarted again: {s.quick_deaths}"
                    f" incarnations in a row died within {RESTART_STABLE_S:g} s of their"
                    f" start (restart_limit={self._restart_limit}); last: {cause}")
                s.cause.__cause__ = cause
        if restart:
            s.lifecycle.fire(MembershipEvent.RESTART)
            s.retired.append(client)
            s.client = None
            self._replaced(s.index)
            delay = 0.0 if not s.quick_deaths else min(
                RESTART_BACKOFF_S * 2 ** (s.quick_deaths - 1), RESTART_BACKOFF_MAX_S)
            self._spawn(self._restart_slot, (s, client, delay), f"EngineCoreRestart_{s.index}")

    def _after_loss(self, s: Slot, planned: bool) -> None:
        """Engine ``s`` stopped serving (a death, or a scale took it): the client is DEAD if
        no engine is left, and its power state follows the rest. Under the lock."""
        left = [x.index for x in self.slots if x.lifecycle.state in MEMBER_LEFT]
        if planned:
            logger.info("engine %d left (a scale-down); engines left: %s", s.index, left)
        else:
            logger.warning("engine %d died (%s); engines left: %s", s.index, s.cause, left)
        if not left:
            self._all_dead(self.all_dead_cause())
        self._follow_power()

    def _spawn(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.add(thread)
        thread.start()

    def _restart_slot(self, s: Slot, dead: Member, delay: float) -> None:
        """Start a replacement for ``dead`` under index ``s.index``, once ``dead``'s process
        is gone (killed here: a hung engine declared dead by its heartbeat is still alive,
        and on Ray its actor runs one engine at a time) and after ``delay`` (a crash loop's
        backoff; a shutdown ends the wait)."""
        try:
            if delay and self.abandon.wait(delay):
                raise ClientClosedError("the client was shut down during the restart backoff")
            ensure_gone(dead, s.index)
            client = self._build(s.index, self.abandon)
        except BaseException as e:  # reported as the member's death
            with self._lock:
                # Still waiting for this replacement's handshake (not shut down meanwhile).
                if s.lifecycle.can(MembershipEvent.HANDSHAKE_OK):
                    s.lifecycle.fire(MembershipEvent.DIED)
                    s.cause = e
                    logger.warning("engine %d: its replacement failed to start: %s", s.index, e)
                    if not self.any_left():
                        self._all_dead(self.all_dead_cause())
            self._changed()
            return
        finally:
            self._threads.discard(threading.current_thread())
        with self._lock:
            keep = self._live() and s.lifecycle.can(MembershipEvent.HANDSHAKE_OK)
            if keep:
                s.client = client
                s.restarts += 1
                s.serving_since = time.monotonic()
                s.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)
                logger.info("engine %d restarted (pid %s)", s.index, client.engine_pid)
                self._follow_power()
        if not keep:
            client.shutdown()
        self._changed()

    def read_to_end(self, s: Slot, client: Member) -> None:
        """Every batch of dead incarnation ``client`` was taken: a retired one is shut down
        now, off this lock (a dead engine's teardown may wait out a grace; teardown waits for
        the reaper), and forgotten; the current one is taken as dead if it was not yet."""
        client.read_to_end = True
        if client in s.retired:
            s.retired.remove(client)
            self._spawn(self._reap, (client,), f"EngineCoreReap_{s.index}")
        if client is s.client:
            self.died(client, client.dead_cause or ClientClosedError(
                f"engine {s.index}'s client was shut down"))

    def _reap(self, client: Member) -> None:
        try:
            client.shutdown()
        finally:
            self._threads.discard(threading.current_thread())

    # -- teardown -----------------------------------------------------------------------------

    def teardown(self, timeout: float | None) -> None:
        """Stop every incarnation (all at once) and join the restarts and reaps."""
        self.abandon.set()
        for start in list(self._starts):
            start.set()
        with self._lock:
            clients = self.held()
            for s in self.slots:
                if s.lifecycle.can(MembershipEvent.SHUTDOWN):
                    s.lifecycle.fire(MembershipEvent.SHUTDOWN)
        if len(clients) == 1:
            clients[0].shutdown(timeout)
        elif clients:
            threads = [threading.Thread(target=c.shutdown, args=(timeout,),
                                        name="EngineCoreStop", daemon=True) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for t in list(self._threads):  # a restart gives up within a poll slice
            t.join()
