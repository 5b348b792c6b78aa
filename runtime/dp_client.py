"""Data parallel: one client over N engine cores (``EngineConfig.data_parallel_size``).

Theory of operation
-------------------
Rule 1: the client drives its own CLIENT lifecycle and one CLIENT_REQUEST lifecycle per
request, as every client does, and one MEMBERSHIP lifecycle per engine index
(spec/membership.py); which members take work and which still count are the spec's named
sets, never a state spelled here.
Rule 2: the loss of one engine is not the loss of the client. Its live requests end with an
output whose ``finish_reason`` is ``ERROR``, after every batch it sent before dying; its
pending utility calls raise ``EngineDeadError`` naming it; new requests go to the others.
The client itself is DEAD only when no engine is left (vLLM fails the whole front end).

Each engine core is a *member*: a one-engine client of its own (``SyncMPClient`` or
``AsyncMPClient``: process, sockets, handshake, monitor, utility registry, teardown), so
every hardening of the one-engine client holds per engine, and a replacement engine has a
channel of its own: nothing meant for its predecessor can reach it. A member's output queue
wakes this client whenever something is put in it; ``get_output`` takes the next batch from
the members in turn, so a busy engine cannot starve another's outputs.

Routing: an ADD goes to ``EngineCoreRequest.data_parallel_rank`` when set, else to the
serving engine with the lowest load, ``4 * waiting + running`` as the engine last reported
them (``SchedulerStats`` on its step batches), with the ADDs sent since that report counted
as waiting, each term capped by the requests this client has in flight there (a report
taken just before the last request finished does not make an idle engine look busy). Ties
go to fewer requests in flight, then round robin, so N idle engines fill evenly. An abort
goes to the owning engine only.

Start-up: every engine starts at once and the client is ready when all are; any engine
that fails to start, or dies before the others are up, fails the construction (nothing is
left). A dead engine's client is shut down once its batches are read (with restarts) or
with this client.

Utilities: a call goes to one serving engine (in turn), unless its declaration says it
applies to every engine (``Utility.every_engine``, protocol/utilities.py: sleep, wake-up,
pause, resume, reset of the prefix cache, profile, is_sleeping), whose replies combine as
declared; ``call_utility_all`` returns one result per serving engine, in index order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec

from ..protocol.codec import check_no_dataclass
from ..protocol.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from ..protocol.utilities import BY_NAME as UTILITY_DECLARATIONS
from ..spec.client import CLIENT_ASLEEP, CLIENT_LIVE, RESUMED, SLEPT, ClientEvent
from ..spec.errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
)
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.membership import (
    MEMBER_LEFT,
    MEMBER_ROUTABLE,
    MEMBERSHIP,
    MembershipEvent,
    MembershipState,
)
from ..spec.utility import UtilityEvent, outcome_of
from ._dp_members import AsyncMember, SyncMember
from ._utilities import AsyncUtilityMethods
from .args import (
    MAX_WAIT_SLICE_S,
    check_method,
    check_request_ids,
    check_timeout,
)
from .async_mp_client import call_on_loop
from .client import EngineCoreClient, SyncClientMixin
from .mp_client import MPClient
from .options import ClientOptions, DataParallelOptions

if TYPE_CHECKING:
    from .ray_backend import Strategy

__all__ = ["AsyncDPClient", "SyncDPClient"]

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


def _combine(how: str, results: list[Any]) -> Any:
    """One reply from one per engine, as ``Utility.every_engine`` declares."""
    if how == "all":
        return all(results)
    if how == "any":
        return any(results)
    if how == "none":
        return None
    if how == "each":
        return list(results)
    return results[0]  # "first"


class _Member:
    """One engine index: its membership lifecycle, its current client and load figures."""

    def __init__(self, index: int, trace: list[TraceEntry] | None) -> None:
        self.index = index
        self.lifecycle: Lifecycle[MembershipState, MembershipEvent] = MEMBERSHIP.lifecycle(
            trace=trace)
        # SyncMember | AsyncMember; None while restarting. Changed only under the client's
        # state lock: a path that uses it takes it once, under that lock, and keeps that value
        # (a restart may set None at any moment outside it).
        self.client: Any = None
        # Dead incarnations whose queued batches are still to be read (then ERROR outputs):
        # all a dead incarnation still owes. Read to its end, it is shut down and forgotten.
        self.retired: list[Any] = []
        self.cause: BaseException | None = None
        self.restarts = 0
        self.serving_since = 0.0  # monotonic time of the current incarnation's handshake
        self.quick_deaths = 0  # consecutive incarnations that died within RESTART_STABLE_S
        self.waiting = 0  # the engine's last report
        self.running = 0
        self.sent_since_report = 0

    def reset_load(self) -> None:
        self.waiting = self.running = self.sent_since_report = 0

    @property
    def routable(self) -> bool:
        client = self.client
        return (self.lifecycle.state in MEMBER_ROUTABLE and client is not None
                and not client.is_dead)

    def load(self) -> tuple[int, int]:
        # In flight: the engine's own client tracks each live request it was sent.
        client = self.client
        n = 0 if client is None else len(client._requests)
        return 4 * min(self.waiting + self.sent_since_report, n) + min(self.running, n), n


def _ensure_gone(dead: Any, index: int) -> None:
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


class _DPClient(EngineCoreClient):
    """What the sync and async data-parallel clients share: members, routing, death."""

    multiprocess = True
    _member_type: type[SyncMember] | type[AsyncMember]

    def __init__(self, config: Any, *, trace: list[TraceEntry] | None = None,
                 options: ClientOptions | DataParallelOptions | None = None,
                 **kwargs: Any) -> None:
        # Every option is checked here, once, before any engine starts: a typo is the
        # ValueError or TypeError a one-engine client raises, never an engine's start-up.
        opts = DataParallelOptions.of(options, kwargs)
        n = getattr(config, "data_parallel_size", 1)
        opts.check_engines(n)
        backend = getattr(config, "data_parallel_backend", "mp")
        if backend != "ray":
            for name in ("ray_placement_strategy", "ray_address"):
                if name in opts.given():
                    raise ValueError(f"{name}: only the data_parallel_backend 'ray' places"
                                     f" engines (this config's is {backend!r})")
        super().__init__(config, trace=trace)
        self.data_parallel_size: int = config.data_parallel_size
        self.options = opts
        self._engine_options = (ClientOptions() if opts.engine_options is None
                                else opts.engine_options)
        self._restart = opts.restart_dead_engines
        self._restart_limit = opts.restart_limit
        # Read here too (members pass batches through as they come).
        self._columnar = self._engine_options.columnar_outputs
        self._abandon = threading.Event()
        self._members = [_Member(i, trace) for i in range(self.data_parallel_size)]
        self._owner: dict[str, Any] = {}  # request id -> the member client it was sent to
        self._failed: list[EngineCoreOutputs] = []  # ERROR batches not yet returned
        self._turn = 0  # where the routing's round robin starts
        self._turn_out = 0  # the member get_output looks at first
        self._last_routed = 0
        self._utility_turn = 0
        # Restarts and reaps in progress: teardown joins them, so a dead incarnation being
        # shut down is waited for without being kept once it is gone.
        self._threads: set[threading.Thread] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._placement: Any = None  # RayEngines for the "ray" backend
        ref = weakref.ref(self)

        def notify() -> None:
            client = ref()
            if client is not None:
                client._notify()

        def died(member: MPClient, cause: BaseException) -> None:
            client = ref()
            if client is not None:
                client._member_died(member, cause)

        def power() -> None:
            client = ref()
            if client is not None:
                client._follow_members_power()

        self._notify_cb, self._died_cb, self._power_cb = notify, died, power
        try:
            if config.data_parallel_backend == "ray":
                from .ray_backend import RayEngines

                # One of ray_backend.STRATEGIES: DataParallelOptions checked it.
                strategy = cast("Strategy", opts.ray_placement_strategy)
                self._placement = RayEngines(self.data_parallel_size, strategy=strategy,
                                             address=opts.ray_address)
            self._start_all()
        except BaseException:
            self._mark_closed()
            self._teardown()
            raise

    # -- members ----------------------------------------------------------------------------

    def _build(self, index: int) -> Any:
        engine = self.options.for_engine(index)
        if self._placement is not None:
            if self._engine_options.transport == "ipc":  # the default; ipc stays on one host
                engine["transport"] = "tcp"  # across hosts: tcp, CURVE on by default
            engine["engine_launcher"] = self._placement.launcher(index)
        return self._member_type(
            self.config, notify=self._notify_cb, died=self._died_cb, power=self._power_cb,
            abandon=self._abandon, options=self._engine_options, engine_index=index, **engine)

    def _start_all(self) -> None:
        """Start every engine at once (each waits for its own handshake)."""
        n = self.data_parallel_size
        with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="EngineCoreStart"
                                                   ) as pool:
            futures = [pool.submit(self._build, i) for i in range(n)]
            errors: list[tuple[int, BaseException]] = []
            for i, fut in enumerate(futures):
                try:
                    self._members[i].client = fut.result()
                except BaseException as e:  # each is reported below
                    errors.append((i, e))
                    self._abandon.set()  # the others need not finish starting
        if errors:
            i, first = errors[0]
            raise EngineStartupError(
                f"engine {i} of {n} failed to start: {first}") from first
        with self._state_lock:
            # The client is ready once every engine is: one that died after its own
            # handshake, while the others were still starting, fails the construction too
            # (as the two-engine model says, spec/compose_dp.py).
            for m in self._members:
                if m.client.is_dead:
                    cause = m.client._dead_cause
                    raise EngineStartupError(
                        f"engine {m.index} of {n} died while the others started: {cause}"
                    ) from cause
            now = time.monotonic()
            for m in self._members:
                m.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)
                m.serving_since = now
            self._apply_ready(self._members[0].client.ready_response)
            self.lifecycle.fire(ClientEvent.HANDSHAKE_OK)

    def _notify(self) -> None:
        raise NotImplementedError

    def _member_died(self, client: MPClient, cause: BaseException) -> None:
        """A member's engine died (its monitor, reader or a send saw it); idempotent."""
        with self._state_lock:
            m = self._members[client.engine_index]
            if m.client is not client or m.lifecycle.state not in MEMBER_ROUTABLE:
                return  # a retired incarnation, a second notice, or a shutdown
            m.lifecycle.fire(MembershipEvent.DIED)
            m.cause = cause
            restart = self._restart and not self.is_closed
            if restart:
                quick = time.monotonic() - m.serving_since < RESTART_STABLE_S
                m.quick_deaths = m.quick_deaths + 1 if quick else 0
                if m.quick_deaths > self._restart_limit:
                    restart = False
                    m.cause = EngineDeadError(
                        f"engine {m.index} is not restarted again: {m.quick_deaths}"
                        f" incarnations in a row died within {RESTART_STABLE_S:g} s of their"
                        f" start (restart_limit={self._restart_limit}); last: {cause}")
                    m.cause.__cause__ = cause
            if restart:
                m.lifecycle.fire(MembershipEvent.RESTART)
                m.retired.append(client)
                m.client = None
                m.reset_load()
                delay = 0.0 if not m.quick_deaths else min(
                    RESTART_BACKOFF_S * 2 ** (m.quick_deaths - 1), RESTART_BACKOFF_MAX_S)
                thread = threading.Thread(target=self._restart_member, args=(m, client, delay),
                                          name=f"EngineCoreRestart_{m.index}", daemon=True)
                self._threads.add(thread)
                thread.start()
            left = [x.index for x in self._members if x.lifecycle.state in MEMBER_LEFT]
            logger.warning("engine %d died (%s); engines left: %s", m.index, m.cause, left)
            if not left:
                self._mark_dead(self._all_dead_cause())
            self._follow_members_power()
        self._notify()

    def _all_dead_cause(self) -> BaseException:
        causes = ", ".join(f"engine {m.index}: {m.cause}" for m in self._members)
        return EngineDeadError(f"every engine core of this client is dead ({causes})")

    def _restart_member(self, m: _Member, dead: Any, delay: float) -> None:
        """Start a replacement for ``dead`` under index ``m.index``, once ``dead``'s process
        is gone (killed here: a hung engine declared dead by its heartbeat is still alive,
        and on Ray its actor runs one engine at a time) and after ``delay`` (a crash loop's
        backoff; a shutdown ends the wait)."""
        try:
            if delay and self._abandon.wait(delay):
                raise ClientClosedError("the client was shut down during the restart backoff")
            _ensure_gone(dead, m.index)
            client = self._build(m.index)
        except BaseException as e:  # reported as the member's death
            with self._state_lock:
                # Still waiting for this replacement's handshake (not shut down meanwhile).
                if m.lifecycle.can(MembershipEvent.HANDSHAKE_OK):
                    m.lifecycle.fire(MembershipEvent.DIED)
                    m.cause = e
                    logger.warning("engine %d: its replacement failed to start: %s", m.index, e)
                    if not any(x.lifecycle.state in MEMBER_LEFT for x in self._members):
                        self._mark_dead(self._all_dead_cause())
            self._notify()
            return
        finally:
            self._threads.discard(threading.current_thread())
        with self._state_lock:
            keep = (not self.is_closed and not self.is_dead
                    and m.lifecycle.can(MembershipEvent.HANDSHAKE_OK))
            if keep:
                m.client = client
                m.restarts += 1
                m.serving_since = time.monotonic()
                m.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)
                logger.info("engine %d restarted (pid %s)", m.index, client.engine_pid)
                self._follow_members_power()
        if not keep:
            client.shutdown()
        self._notify()

    def _serving(self) -> list[_Member]:
        return [m for m in self._members if m.routable]

    def _follow_members_power(self) -> None:
        """The client's power state is its serving engines': in ``CLIENT_ASLEEP`` while any
        serving engine's client is (a sleep that took on some engines only, a reply that came
        after its caller gave up), awake once none is (a wake-up, or the last sleeping engine
        lost). Each member follows its own engine's replies, late ones included, and calls
        this after each; so do deaths and restarts. The client never claims a state its
        engines are not in, so the next power reply always has its row."""
        with self._state_lock:
            lc = self.lifecycle
            if lc.state not in CLIENT_LIVE:
                return
            clients = [m.client for m in self._members if m.routable]
            if not clients:
                return
            asleep = any(c.lifecycle.state in CLIENT_ASLEEP for c in clients)
            if asleep == (lc.state in CLIENT_ASLEEP):
                return
            event, guard = (SLEPT if asleep else RESUMED).resolve(None)
            lc.fire(event, guard)

    def _no_engine(self) -> EngineDeadError:
        self.ensure_alive()
        states = ", ".join(f"{m.index}: {m.lifecycle.state.value}" for m in self._members)
        return EngineDeadError(f"no engine core is serving ({states})")

    def _engine_died(self, m: _Member, error: EngineDeadError) -> EngineDeadError:
        """``error`` from engine ``m``'s client, naming the engine."""
        err = EngineDeadError(f"engine {m.index} of {self.data_parallel_size} died; see"
                              " __cause__ and the engine log")
        err.__cause__ = error.__cause__ or error
        return err

    # -- requests ---------------------------------------------------------------------------

    def _pick(self, request: EngineCoreRequest, tried: set[int]) -> _Member:
        rank = request.data_parallel_rank
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not (
                    0 <= rank < self.data_parallel_size):
                raise ValueError(f"data_parallel_rank={rank!r}: must be None or an engine"
                                 f" index in [0, {self.data_parallel_size})")
            m = self._members[rank]
            if not m.routable or rank in tried:
                raise EngineDeadError(f"engine {rank} (the request's data_parallel_rank) is"
                                      f" {m.lifecycle.state.value}")
            return m
        n = self.data_parallel_size
        best: _Member | None = None
        best_key: tuple[int, int, int] | None = None
        for k in range(n):
            m = self._members[(self._turn + k) % n]
            if m.index in tried or not m.routable:
                continue
            key = (*m.load(), k)
            if best_key is None or key < best_key:
                best, best_key = m, key
        if best is None:
            raise self._no_engine()
        self._turn = (best.index + 1) % n
        return best

    def _route_add(self, request: EngineCoreRequest) -> None:
        if not isinstance(request, EngineCoreRequest):
            raise TypeError(f"add_request expects an EngineCoreRequest, got {type(request)!r}")
        rid = request.request_id
        tried: set[int] = set()
        with self._state_lock:  # members never call back into it while holding their locks
            self._track_add(request)
            try:
                while True:
                    m = self._pick(request, tried)
                    client = m.client
                    try:
                        client._send_add(request)
                    except EngineDeadError:
                        tried.add(m.index)  # it died since: the request never left
                        continue
                    owner = self._owner
                    owner[rid] = client
                    self._last_routed = m.index
                    m.sent_since_report += 1
                    if len(owner) > 2 * len(self._requests) + 64:
                        # Entries of finished requests are dropped here, in bulk, not per
                        # output: aborts and deaths read only the live ones.
                        live = self._requests
                        self._owner = {r: c for r, c in owner.items() if r in live}
                    return
            except BaseException:
                self._untrack_add(rid)
                raise

    def _route_abort(self, request_ids: list[str]) -> None:
        ids = check_request_ids(request_ids)
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        if not ids or self.is_dead:
            return
        groups: dict[int, tuple[Any, list[str]]] = {}
        with self._state_lock:
            self._track_abort(ids)
            for rid in ids:
                client = self._owner.get(rid)
                if client is not None and not client.is_dead:
                    groups.setdefault(id(client), (client, []))[1].append(rid)
        for client, group in groups.values():
            try:
                client._send_abort(group)
            except (EngineDeadError, ClientClosedError):
                pass  # died or replaced since: its requests end with ERROR instead

    # -- outputs ----------------------------------------------------------------------------

    def _take(self) -> EngineCoreOutputs | None:
        """The next batch from any member, in turn, or None; holds nothing while idle."""
        with self._state_lock:
            if self._redeliver:
                return self._redeliver.popleft()
            if self._failed:
                return self._deliver_failed()
            n = self.data_parallel_size
            for k in range(n):
                m = self._members[(self._turn_out + k) % n]
                for client in (*m.retired, m.client):
                    if client is None or client.read_to_end or not client.has_output():
                        continue
                    try:
                        out = client.take()
                    except EngineDeadError:
                        self._drain_done(m, client)
                        if self._failed:
                            return self._deliver_failed()
                        continue
                    except ClientClosedError:  # its engine was stopped: gone, as a death
                        self._drain_done(m, client)
                        if self._failed:
                            return self._deliver_failed()
                        continue
                    if out is None:
                        continue
                    self._turn_out = (m.index + 1) % n
                    return self._deliver(m, client, out)
            return None

    def _deliver(self, m: _Member, client: Any, out: EngineCoreOutputs) -> EngineCoreOutputs:
        if out.engine_index != m.index:
            out = msgspec.structs.replace(out, engine_index=m.index)
        stats = out.scheduler_stats
        if stats is not None and client is m.client:
            m.waiting, m.running, m.sent_since_report = stats.num_waiting, stats.num_running, 0
        # No per-output work beyond the tracking: the engine's own client already refused
        # any output for a request it was not sent (an id lives in one engine's client).
        self._track_outputs(out)
        return out

    def _drain_done(self, m: _Member, client: Any) -> None:
        """Every batch of dead ``client`` was returned: its requests still live here end
        with ERROR (one batch), unless no engine is left (the client is then DEAD)."""
        client.read_to_end = True
        if client in m.retired:
            # Read to its end: its process, sockets and reader go now, off this lock (a
            # dead engine's teardown may wait out a grace), and teardown waits for the
            # reaper; once it is done nothing here refers to the incarnation.
            m.retired.remove(client)
            reaper = threading.Thread(target=self._reap, args=(client,),
                                      name=f"EngineCoreReap_{m.index}", daemon=True)
            self._threads.add(reaper)
            reaper.start()
        if client is m.client and m.lifecycle.state in MEMBER_ROUTABLE:
            self._member_died(client, client._dead_cause or ClientClosedError(
                f"engine {m.index}'s client was shut down"))
        owner = self._owner
        rids = [rid for rid, c in owner.items() if c is client]
        for rid in rids:
            del owner[rid]
        if client is m.client:
            m.reset_load()
        live = set(self.live_requests()) if rids else set()
        rids = [r for r in rids if r in live]
        if rids and not self.is_dead and not self.is_closed:
            why = f"engine {m.index} died: {m.cause or client._dead_cause}"
            self._failed.append(EngineCoreOutputs(
                engine_index=m.index, timestamp=EngineCoreOutputs.now(),
                outputs=[EngineCoreOutput(r, [], FinishReason.ERROR, error=why) for r in rids]))

    def _reap(self, client: Any) -> None:
        try:
            client.shutdown()
        finally:
            self._threads.discard(threading.current_thread())

    def _deliver_failed(self) -> EngineCoreOutputs:
        out = self._failed.pop(0)
        self._track_outputs(out)
        return out

    def _dead_error(self) -> EngineDeadError:
        err = EngineDeadError("every engine core of this client is dead; see __cause__ and"
                              " the engine logs")
        err.__cause__ = self._dead_cause
        return err

    # -- utilities --------------------------------------------------------------------------

    def _utility_member(self) -> tuple[_Member, Any]:
        """The next serving engine in turn and its client, taken together under the lock:
        the caller uses that client (a death and restart may set ``m.client`` to None the
        moment the lock is released; the client taken then raises EngineDeadError)."""
        with self._state_lock:
            self.ensure_alive()
            serving = self._serving()
            if not serving:
                raise self._no_engine()
            m = serving[self._utility_turn % len(serving)]
            self._utility_turn += 1
            return m, m.client

    def _targets(self, method: str, args: Sequence[Any]) -> list[tuple[_Member, Any]]:
        """Every serving engine with its client, taken under the lock (``_utility_member``)."""
        check_method(method)
        check_no_dataclass(tuple(args))
        with self._state_lock:
            self.ensure_alive()
            serving = self._serving()
            if not serving:
                raise self._no_engine()
            return [(m, m.client) for m in serving]

    @contextlib.contextmanager
    def _utility_lifecycle(self) -> Iterator[Lifecycle[Any, UtilityEvent]]:
        """One UTILITY lifecycle per call on this client (its engines' clients keep their
        own): the caller fires REPLY_OK; an error fires the outcome its type names."""
        lc = self._new_utility_lifecycle()
        try:
            yield lc
        except BaseException as e:
            event = outcome_of(e)  # spec/utility.py's map, the same for every client
            if event is not None and lc.can(event):
                lc.fire(event)
            raise

    def _after_all(self, method: str, results: list[Any]) -> Any:
        """The combined reply of a call every engine answered. A power call's effect on the
        lifecycle was followed already, engine by engine (``_follow_members_power``)."""
        decl = UTILITY_DECLARATIONS[method]
        assert decl.every_engine is not None
        return _combine(decl.every_engine, results)

    def _outcomes(self, targets: list[tuple[_Member, Any]],
                  outcomes: Iterator[tuple[bool, Any]]) -> list[Any]:
        results: list[Any] = []
        error: BaseException | None = None
        for (m, _), (ok, value) in zip(targets, outcomes, strict=True):
            if ok:
                results.append(value)
            elif error is None:
                error = (self._engine_died(m, value) if isinstance(value, EngineDeadError)
                         else value)
        if error is not None:
            raise error
        return results

    # -- reporting --------------------------------------------------------------------------

    @property
    def engines(self) -> dict[int, MembershipState]:
        """Each engine index's membership state (spec/membership.py)."""
        with self._state_lock:
            return {m.index: m.lifecycle.state for m in self._members}

    @property
    def dead_engines(self) -> list[int]:
        """The engine indexes not serving now (dead, or restarting after a death)."""
        with self._state_lock:
            return [m.index for m in self._members if m.lifecycle.state not in MEMBER_ROUTABLE
                    and m.lifecycle.state not in MEMBERSHIP.terminal]

    @property
    def engine_pids(self) -> list[int | None]:
        with self._state_lock:
            clients = [m.client for m in self._members]
        return [None if c is None else c.engine_pid for c in clients]

    def send_raw_frames(self, frames: list[bytes], engine_index: int | None = None) -> None:
        """``MPClient.send_raw_frames`` to engine ``engine_index`` (default: the engine the
        last ADD went to): for conformance tests that put malformed input on the wire."""
        with self._state_lock:
            index = self._last_routed if engine_index is None else engine_index
            client = self._members[index].client
            if client is None:
                raise self._no_engine()
        client.send_raw_frames(frames)

    def engine_client(self, index: int) -> Any:
        """The one-engine client behind engine ``index`` (for tests and the fault harness);
        None while that engine restarts."""
        return self._members[index].client

    def pending_utility_calls(self) -> int:
        with self._state_lock:
            clients = [c for m in self._members for c in (m.client,) if c is not None]
        return sum(c.pending_utility_calls() for c in clients)

    def queued_outputs(self) -> int:
        with self._state_lock:
            n = len(self._failed) + len(self._redeliver)
            for m in self._members:
                for c in (*m.retired, m.client):
                    if c is not None and not c.read_to_end:
                        n += c.queued_outputs()
            return n

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every engine (each as ``SyncMPClient.shutdown`` does, all at once) and free
        everything; idempotent."""
        if timeout is not None:
            check_timeout(timeout)
        self._mark_closed()
        self._teardown(timeout)

    def _teardown(self, timeout: float | None = None) -> None:
        self._abandon.set()
        with self._state_lock:
            clients = [c for m in self._members for c in (*m.retired, m.client)
                       if c is not None]
            for m in self._members:
                if m.lifecycle.can(MembershipEvent.SHUTDOWN):
                    m.lifecycle.fire(MembershipEvent.SHUTDOWN)
            self._failed.clear()
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
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        placement, self._placement = self._placement, None
        if placement is not None:
            placement.close()
        self._notify()

    def __repr__(self) -> str:
        states = ", ".join(f"{i}:{s.value}" for i, s in self.engines.items())
        return f"<{type(self).__name__} engines=[{states}] {self.lifecycle.state.name}>"


class SyncDPClient(SyncClientMixin, _DPClient):
    """Blocking data-parallel client over ``data_parallel_size`` engine cores."""

    _member_type = SyncMember

    def __init__(self, config: Any, **options: Any) -> None:
        self._arrival = threading.Condition(threading.Lock())
        self._arrivals = 0  # bumped on every put into a member's queue
        super().__init__(config, **options)

    def _notify(self) -> None:
        with self._arrival:
            self._arrivals += 1
            self._arrival.notify_all()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._route_add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._route_abort(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next batch from any engine (its ``engine_index`` says which); an empty batch
        if ``timeout`` passes first. ``EngineDeadError`` only once no engine is left."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.is_closed:
                raise ClientClosedError(self._closed_message)
            seen = self._arrivals
            out = self._take()
            if out is not None:
                return out
            if self.is_dead:
                raise self._dead_error()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return EngineCoreOutputs()
            with self._arrival:
                if self._arrivals == seen:
                    self._arrival.wait(MAX_WAIT_SLICE_S if remaining is None
                                       else min(remaining, MAX_WAIT_SLICE_S))

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        timeout = check_timeout(timeout)
        check_method(method)
        decl = UTILITY_DECLARATIONS.get(method)
        with self._utility_lifecycle() as lc:
            if decl is not None and decl.every_engine is not None:
                result = self._after_all(method, self._call_all(method, args, timeout))
            else:
                m, client = self._utility_member()
                try:
                    result = client.call_utility(method, *args, timeout=timeout)
                except EngineDeadError as e:
                    raise self._engine_died(m, e) from None
            lc.fire(UtilityEvent.REPLY_OK)
        return result

    def call_utility_all(self, method: str, *args: Any, timeout: float | None = None
                         ) -> list[Any]:
        """``call_utility`` on every serving engine at once; their results in index order.
        The first failure (in index order) is raised once every engine answered."""
        timeout = check_timeout(timeout)
        with self._utility_lifecycle() as lc:
            results = self._call_all(method, args, timeout)
            lc.fire(UtilityEvent.REPLY_OK)
        return results

    def _call_all(self, method: str, args: tuple[Any, ...], timeout: float | None
                  ) -> list[Any]:
        targets = self._targets(method, args)
        if len(targets) == 1:
            only = targets[0][1]
            calls: list[Callable[[], Any]] = [
                lambda: only.call_utility(method, *args, timeout=timeout)]
            return self._outcomes(targets, map(_attempt, calls))
        with self._state_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.data_parallel_size, thread_name_prefix="EngineCoreUtility")
            pool = self._pool
        futures = [pool.submit(client.call_utility, method, *args, timeout=timeout)
                   for _, client in targets]
        return self._outcomes(targets, (_result(f) for f in futures))


def _attempt(call: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, call()
    except Exception as e:  # handed back in order, raised by _outcomes
        return False, e


def _result(fut: concurrent.futures.Future[Any]) -> tuple[bool, Any]:
    try:
        return True, fut.result()
    except Exception as e:  # as _attempt
        return False, e


class AsyncDPClient(AsyncUtilityMethods, _DPClient):
    """asyncio data-parallel client; bound to the loop it first runs on, as AsyncMPClient."""

    _member_type = AsyncMember

    def __init__(self, config: Any, **options: Any) -> None:
        self._arrived: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config, **options)

    def _notify(self) -> None:
        event = self._arrived
        if event is not None:
            call_on_loop(self._loop, event.set)

    def _bind(self) -> None:
        """Members read on the running loop; the arrival event lives there too."""
        loop = asyncio.get_running_loop()
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        with self._state_lock:  # each member's clients taken once, under the lock
            clients = [c for m in self._members for c in (*m.retired, m.client)
                       if c is not None]
        if self._loop is not loop:
            for c in clients:
                if not c.is_closed:
                    c._ensure_reader()
            self._loop, self._arrived = loop, asyncio.Event()
        else:
            for c in clients:
                if c._loop is not loop and not c.is_closed:
                    c._ensure_reader()  # a replacement, built off the loop

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._bind()
        self._route_add(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._route_abort(request_ids)

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        """See ``SyncDPClient.get_output``."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.is_closed:
                raise ClientClosedError(self._closed_message)
            self._bind()
            event = self._arrived
            assert event is not None
            event.clear()  # on the loop: nothing is put between this and the look below
            out = self._take()
            if out is not None:
                return out
            if self.is_dead:
                raise self._dead_error()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return EngineCoreOutputs()
            try:
                async with asyncio.timeout(min(remaining or MAX_WAIT_SLICE_S,
                                               MAX_WAIT_SLICE_S)):
                    await event.wait()
            except TimeoutError:
                pass

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout: float | None = None) -> Any:
        timeout = check_timeout(timeout)
        check_method(method)
        self._bind()
        decl = UTILITY_DECLARATIONS.get(method)
        with self._utility_lifecycle() as lc:
            if decl is not None and decl.every_engine is not None:
                result = self._after_all(method, await self._call_all_async(method, args,
                                                                            timeout))
            else:
                m, client = self._utility_member()
                try:
                    result = await client.call_utility_async(method, *args, timeout=timeout)
                except EngineDeadError as e:
                    raise self._engine_died(m, e) from None
            lc.fire(UtilityEvent.REPLY_OK)
        return result

    async def call_utility_all_async(self, method: str, *args: Any,
                                     timeout: float | None = None) -> list[Any]:
        """See ``SyncDPClient.call_utility_all``."""
        timeout = check_timeout(timeout)
        self._bind()
        with self._utility_lifecycle() as lc:
            results = await self._call_all_async(method, args, timeout)
            lc.fire(UtilityEvent.REPLY_OK)
        return results

    async def _call_all_async(self, method: str, args: tuple[Any, ...],
                              timeout: float | None) -> list[Any]:
        targets = self._targets(method, args)
        got = await asyncio.gather(
            *(client.call_utility_async(method, *args, timeout=timeout) for _, client in targets),
            return_exceptions=True)
        outcomes = ((not isinstance(g, BaseException), g) for g in got)
        for g in got:  # a cancellation is the caller's, not an engine's outcome
            if isinstance(g, asyncio.CancelledError):
                raise g
        return self._outcomes(targets, outcomes)

    async def shutdown_async(self, timeout: float | None = None) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    async def __aenter__(self) -> AsyncDPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown_async()
