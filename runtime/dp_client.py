"""Data parallel: one client over N engine cores (``EngineConfig.data_parallel_size``).

Theory of operation
-------------------
Rule 1: the client drives its own CLIENT lifecycle and one CLIENT_REQUEST lifecycle per
request, as every client does (its engines' clients track none: the requests are tracked
once, here), and one MEMBERSHIP lifecycle per engine index (spec/membership.py); which
members take work and which still count are the spec's named sets, never a state spelled
here.
Rule 2: the loss of one engine is not the loss of the client. Its live requests end with an
output whose ``finish_reason`` is ``ERROR``, after every batch it sent before dying; its
pending utility calls raise ``EngineDeadError`` naming it; new requests go to the others.
The client itself is DEAD only when no engine is left (vLLM fails the whole front end).

Three owners, each in its module: the **membership** (``_dp_membership.py``: the engine
indexes, the start, death, restart and teardown of their incarnations), the **router**
(``_dp_router.py``: where an ADD goes, which incarnation each live request was sent to, the
load figures) and this **facade**: the requests, the client's lifecycle, delivery and the
utility calls. ``_DPClient`` holds every step but the wait, as ``MPClient`` does for one
engine: ``SyncDPClient`` and ``AsyncDPClient`` differ only in how they block.

Each engine core is a *member* (``_dp_members.Member``): a one-engine client of its own
(``SyncMPClient`` or ``AsyncMPClient``: process, sockets, handshake, monitor, utility
registry, teardown), so every hardening of the one-engine client holds per engine, and a
replacement engine has a channel of its own: nothing meant for its predecessor can reach it.
A member's output queue wakes this client whenever something is put in it; ``get_output``
takes the next batch from the members in turn, so a busy engine cannot starve another's
outputs. An abort goes to the owning engine only.

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
import math
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec

from ..protocol.codec import check_no_dataclass
from ..protocol.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from ..protocol.utilities import BY_NAME as UTILITY_DECLARATIONS
from ..protocol.utilities import POWER_METHODS
from ..spec.client import CLIENT_ASLEEP, CLIENT_LIVE, RESUMED, SLEPT, ClientEvent
from ..spec.errors import ClientClosedError, EngineDeadError, SpecViolation
from ..spec.machine import TraceEntry
from ..spec.membership import (
    LAST_POWER_CALL,
    MEMBER_GONE,
    OTHER_POWER_CALLS,
    SCALE,
    SCALE_REFUSED,
    MembershipState,
    ScaleEvent,
    ScaleState,
)
from ..spec.utility import UtilityEvent
from ._background import SigintHold
from ._dp_members import AsyncMember, Member, SyncMember
from ._dp_membership import Membership, Slot
from ._dp_router import Router
from ._registry import utility_outcome
from ._utilities import AsyncUtilityMethods
from .args import (
    MAX_WAIT_SLICE_S,
    check_method,
    check_option_flag,
    check_request_ids,
    check_timeout,
)
from .async_mp_client import call_on_loop
from .client import EngineCoreClient, SyncClientMixin
from .mp_client import MPClient
from .options import PER_ENGINE, ClientOptions, DataParallelOptions

if TYPE_CHECKING:
    from .ray_backend import Strategy

__all__ = ["AsyncDPClient", "EngineReport", "SyncDPClient"]

logger = logging.getLogger(__name__)

# How often a scale-down looks whether its leavers' requests finished.
_DRAIN_POLL_S = 0.01

# The most engines one call_utility_all asks at once (a larger group waits for a thread).
_UTILITY_THREADS = 32

# One utility call's targets: each serving slot with the incarnation taken for it under the
# state lock (a death and restart may set ``slot.client`` to None the moment it is released).
Targets = list[tuple[Slot, Any]]


class EngineReport(msgspec.Struct, frozen=True, kw_only=True):
    """``engine_reports()``: one engine index of a data-parallel client, as it sees it."""

    index: int
    state: MembershipState
    pid: int | None  # None while it restarts (or for an attached engine)
    in_flight: int  # requests sent there and not yet seen finished
    restarts: int  # replacements started under this index so far
    cause: str | None  # why it last died, if it did


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


class _DPClient(EngineCoreClient):
    """Every step of the sync and async data-parallel clients but the wait."""

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
        n = config.data_parallel_size
        self.options = opts
        self._engine_options = (ClientOptions() if opts.engine_options is None
                                else opts.engine_options)
        # Read here too (members pass batches through as they come).
        self._columnar = self._engine_options.columnar_outputs
        self._router = Router(n)
        self._scaling = SCALE.lifecycle(trace=trace)
        self._power_calls = 0  # power calls running now (SCALE: POWERING while any)
        self._failed: list[EngineCoreOutputs] = []  # ERROR batches not yet returned
        self._turn_out = 0  # the engine get_output looks at first
        self._utility_turn = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._placement: Any = None  # RayEngines for the "ray" backend
        # Members and the membership call back through weak references: a client dropped
        # without shutdown is not kept alive by its engines' threads.
        ref = weakref.ref(self)

        def notify() -> None:
            client = ref()
            if client is not None:
                client._notify()

        def died(member: MPClient, cause: BaseException) -> None:
            client = ref()
            if client is not None:
                client._membership.died(cast(Member, member), cause)

        def power() -> None:
            client = ref()
            if client is not None:
                client._follow_members_power()

        def live() -> bool:
            client = ref()
            return client is not None and not client.is_closed and not client.is_dead

        def all_dead(cause: BaseException) -> None:
            client = ref()
            if client is not None:
                client._mark_dead(cause)

        def replaced(index: int) -> None:
            client = ref()
            if client is not None:
                client._router.reset(index)

        def build(index: int, abandon: threading.Event) -> Member:
            client = ref()
            if client is None:
                raise ClientClosedError("the client was dropped")
            return client._build(index, abandon)

        self._notify_cb, self._died_cb, self._power_cb = notify, died, power
        self._membership = Membership(
            n, lock=self._state_lock, trace=trace, build=build,
            restart=opts.restart_dead_engines, restart_limit=opts.restart_limit, live=live,
            changed=notify, all_dead=all_dead, follow_power=power, replaced=replaced)
        self._slots = self._membership.slots
        try:
            if config.data_parallel_backend == "ray":
                from .ray_backend import RayEngines

                # One of ray_backend.STRATEGIES: DataParallelOptions checked it.
                strategy = cast("Strategy", opts.ray_placement_strategy)
                self._placement = RayEngines(n, strategy=strategy,
                                             address=opts.ray_address)
            self._membership.start_all()
            with self._state_lock:
                self._apply_ready(self._slots[0].client.ready_response)
                self.lifecycle.fire(ClientEvent.HANDSHAKE_OK)
        except BaseException:
            self._mark_closed()
            self._teardown()
            raise

    def _build(self, index: int, abandon: threading.Event) -> Member:
        """A new incarnation of engine ``index``, started (its handshake done); ``abandon``
        set gives its start up."""
        engine = self.options.for_engine(index)
        if self._placement is not None:
            if self._engine_options.transport == "ipc":  # the default; ipc stays on one host
                engine["transport"] = "tcp"  # across hosts: tcp, CURVE on by default
            self._placement.add(index)  # a joiner's actor (placed already: nothing)
            engine["engine_launcher"] = self._placement.launcher(index)
        return self._member_type(
            self.config, notify=self._notify_cb, died=self._died_cb, power=self._power_cb,
            abandon=abandon, options=self._engine_options,
            engine_index=index, **engine)

    def _notify(self) -> None:
        raise NotImplementedError

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
            clients = [s.client for s in self._slots if s.routable]
            if not clients:
                return
            asleep = any(c.lifecycle.state in CLIENT_ASLEEP for c in clients)
            if asleep == (lc.state in CLIENT_ASLEEP):
                return
            event, guard = (SLEPT if asleep else RESUMED).resolve(None)
            lc.fire(event, guard)

    def _no_engine(self) -> EngineDeadError:
        self.ensure_alive()
        return EngineDeadError(f"no engine core is serving ({self._membership.describe()})")

    def _engine_died(self, s: Slot, error: EngineDeadError) -> EngineDeadError:
        """``error`` from engine ``s``'s client, naming the engine."""
        err = EngineDeadError(f"engine {s.index} of {self.data_parallel_size} died; see"
                              " __cause__ and the engine log")
        err.__cause__ = error.__cause__ or error
        return err

    # -- requests ---------------------------------------------------------------------------

    def _route_add(self, request: EngineCoreRequest) -> None:
        """Track ``request`` (once: here), pick its engine, send it there. A Ctrl-C is held
        until the ADD went out whole and was recorded, so the request is never forgotten
        while an engine runs it."""
        rid = request.request_id if isinstance(request, EngineCoreRequest) else None
        router, slots = self._router, self._slots
        tried: set[int] = set()
        with SigintHold(), self._state_lock:  # members never call back holding their locks
            self._track_add(request)  # TypeError for what is not a request
            assert rid is not None
            try:
                while True:
                    s = router.pick(request, slots, tried)
                    if s is None:
                        raise self._no_engine()
                    client = s.client
                    try:
                        client.send_add(request)
                    except EngineDeadError:
                        tried.add(s.index)  # it died since: the request never left
                        continue
                    requests = self._requests
                    router.routed(rid, s.index, client, requests, len(requests))
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
            owner = self._router.owner
            for rid in ids:
                client = owner(rid)
                if client is not None and not client.is_dead:
                    groups.setdefault(id(client), (client, []))[1].append(rid)
        for client, group in groups.values():
            try:
                client.send_abort(group)
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
            slots = self._slots
            n = len(slots)
            for k in range(n):
                s = slots[(self._turn_out + k) % n]
                for client in s.incarnations():  # a snapshot: a drain may retire one
                    if client.read_to_end or not client.has_output():
                        continue
                    try:
                        out = client.take()
                    except (EngineDeadError, ClientClosedError):
                        # Read to its end (a stopped engine is gone, as a death).
                        self._drain_done(s, client)
                        if self._failed:
                            return self._deliver_failed()
                        continue
                    if out is None:
                        continue
                    self._turn_out = (s.index + 1) % n
                    return self._deliver(s, client, out)
            return None

    def _deliver(self, s: Slot, client: Member, out: EngineCoreOutputs) -> EngineCoreOutputs:
        if out.engine_index != s.index:
            out = msgspec.structs.replace(out, engine_index=s.index)
        # The one tracking of these requests: an output the spec forbids (an id this client
        # never sent, an output after its finish, one for a request another engine runs)
        # raises here, the rest tracked and redelivered.
        router = self._router
        foreign = router.foreign(client, out.stream_ids, out.outputs)
        if foreign is not None:
            skip = set(foreign[1])
            router.delivered(s.index, client, client is s.client,
                             [o for i, o in enumerate(out.outputs) if i not in skip], None)
            raise self._refuse_unsent(out, *foreign)
        self._track_outputs(out)
        router.delivered(s.index, client, client is s.client, out.outputs, out.scheduler_stats)
        return out

    def _drain_done(self, s: Slot, client: Member) -> None:
        """Every batch of dead ``client`` was returned: its requests still live here end
        with ERROR (one batch), unless no engine is left (the client is then DEAD)."""
        current = client is s.client
        self._membership.read_to_end(s, client)
        rids = self._router.release(client)
        if current:
            self._router.reset(s.index)
        live = self._requests
        rids = [r for r in rids if r in live]
        if rids and not self.is_dead and not self.is_closed:
            # A scale-down's leaver ends what it still ran as aborted (its stop reason says
            # why), a dead engine as ERROR.
            removal = client.removal
            if removal is not None:
                ends = [EngineCoreOutput(r, [], FinishReason.ABORT, stop_reason=removal)
                        for r in rids]
            else:
                why = f"engine {s.index} died: {s.cause or client.dead_cause}"
                ends = [EngineCoreOutput(r, [], FinishReason.ERROR, error=why) for r in rids]
            self._failed.append(EngineCoreOutputs(
                engine_index=s.index, timestamp=EngineCoreOutputs.now(), outputs=ends))

    def _deliver_failed(self) -> EngineCoreOutputs:
        out = self._failed.pop(0)
        self._track_outputs(out)
        return out

    def _dead_error(self) -> EngineDeadError:
        err = EngineDeadError("every engine core of this client is dead; see __cause__ and"
                              " the engine logs")
        err.__cause__ = self._dead_cause
        return err

    def _output_step(self, deadline: float | None) -> EngineCoreOutputs | None:
        """One look of ``get_output``: a batch, the empty batch of a passed deadline, the
        error of a closed or dead client; None when the caller is to wait."""
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        out = self._take()
        if out is not None:
            return out
        if self.is_dead:
            raise self._dead_error()
        if deadline is not None and deadline - time.monotonic() <= 0:
            return EngineCoreOutputs()
        return None

    # -- utilities --------------------------------------------------------------------------

    def _utility_member(self) -> tuple[Slot, Any]:
        """The next serving engine in turn and its client, taken together under the lock:
        the caller uses that client (a death and restart may set ``s.client`` to None the
        moment the lock is released; the client taken then raises EngineDeadError)."""
        with self._state_lock:
            self.ensure_alive()
            serving = self._membership.serving()
            if not serving:
                raise self._no_engine()
            s = serving[self._utility_turn % len(serving)]
            self._utility_turn += 1
            return s, s.client

    def _targets(self, method: str, args: Sequence[Any]) -> Targets:
        """Every serving engine with its client, taken under the lock (``_utility_member``)."""
        check_method(method)
        check_no_dataclass(tuple(args))
        with self._state_lock:
            self.ensure_alive()
            serving = self._membership.serving()
            if not serving:
                raise self._no_engine()
            return [(s, s.client) for s in serving]

    def _plan(self, method: str, args: tuple[Any, ...], every: bool) -> tuple[Targets, bool]:
        """What a call does before it waits, once its lifecycle began: its targets (every
        serving engine, or the next one in turn) and whether the replies combine into one."""
        if every:
            return self._targets(method, args), False
        decl = UTILITY_DECLARATIONS.get(method)
        if decl is not None and decl.every_engine is not None:
            return self._targets(method, args), True
        return [self._utility_member()], False

    @contextlib.contextmanager
    def _power_window(self, method: str) -> Iterator[None]:
        """A power call (sleep, wake-up, pause, resume) runs in SCALE's POWERING: refused
        while a scale runs, and no scale begins until the last one returned (a joiner
        starts awake, and a power call reaches only the engines serving when it is sent)."""
        if method not in POWER_METHODS:
            yield
            return
        with self._state_lock:
            if not self._scaling.can(ScaleEvent.POWER_BEGIN):
                err = SpecViolation(SCALE.name, self._scaling.state.name,
                                    ScaleEvent.POWER_BEGIN.name)
                err.args = (f"{method}: a scale of this client is running (a joiner would"
                            " miss the call and a leaver drains awake); call it once the"
                            f" scale returned; nothing was sent ({err})",)
                raise err
            self._scaling.fire(ScaleEvent.POWER_BEGIN)
            self._power_calls += 1
        try:
            yield
        finally:
            with self._state_lock:
                self._power_calls -= 1
                self._scaling.fire(ScaleEvent.POWER_END, OTHER_POWER_CALLS
                                   if self._power_calls else LAST_POWER_CALL)

    def _after_all(self, method: str, results: list[Any]) -> Any:
        """The combined reply of a call every engine answered. A power call's effect on the
        lifecycle was followed already, engine by engine (``_follow_members_power``)."""
        decl = UTILITY_DECLARATIONS[method]
        assert decl.every_engine is not None
        return _combine(decl.every_engine, results)

    def _outcomes(self, targets: Targets, outcomes: Iterable[tuple[bool, Any]]) -> list[Any]:
        """The results in target order; the first failure (in that order) raised once every
        engine answered, a death named by its engine."""
        results: list[Any] = []
        error: BaseException | None = None
        for (s, _), (ok, value) in zip(targets, outcomes, strict=True):
            if ok:
                results.append(value)
            elif error is None:
                error = (self._engine_died(s, value) if isinstance(value, EngineDeadError)
                         else value)
        if error is not None:
            raise error
        return results

    def _finish(self, method: str, targets: Targets, combine: bool, every: bool,
                outcomes: Iterable[tuple[bool, Any]]) -> Any:
        """The call's result from its targets' outcomes: one engine's, the combined reply,
        or (``call_utility_all``) one per engine."""
        results = self._outcomes(targets, outcomes)
        if combine:
            return self._after_all(method, results)
        return results if every else results[0]

    # -- scale ------------------------------------------------------------------------------

    def _scale(self, n: int, drain: bool, drain_timeout_s: float,
               remove: Sequence[int] | None) -> None:
        """``scale``'s steps, for both clients (the async one runs them in a thread)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"scale: n={n!r} must be an int >= 1 (the engines to serve with)")
        check_option_flag(drain, "drain")
        if (isinstance(drain_timeout_s, bool) or not isinstance(drain_timeout_s, int | float)
                or not math.isfinite(drain_timeout_s) or drain_timeout_s < 0):
            raise ValueError(f"scale: drain_timeout_s={drain_timeout_s!r} must be a finite"
                             " number of seconds >= 0")
        if remove is not None and (not isinstance(remove, list | tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) for i in remove)
                or len(set(remove)) != len(remove)):
            raise ValueError(f"scale: remove={remove!r} must be a list of distinct engine"
                             " indexes")
        joiners, leavers = self._scale_begin(n, remove)
        placement = self._placement
        try:
            if joiners:
                try:
                    self._membership.join(joiners)
                except BaseException:
                    if placement is not None:  # the undone joiners' actors go too
                        for s in joiners:
                            placement.remove(s.index)
                    raise
            if leavers:
                self._drain_out(leavers, drain_timeout_s if drain else 0.0)
                if placement is not None:  # a leaver's actor and its own bundle go
                    for s in leavers:
                        placement.remove(s.index)
        finally:
            with self._state_lock:
                self._scaling.fire(ScaleEvent.END)

    def _scale_begin(self, n: int, remove: Sequence[int] | None
                     ) -> tuple[list[Slot], list[Slot]]:
        """Under the lock: refuse what the spec refuses, BEGIN, then the joiners' new slots
        (STARTING) or the leavers taken out of the set (no new work from now)."""
        with self._state_lock:
            self.ensure_alive()
            state = self.lifecycle.state
            if state in SCALE_REFUSED or not self._scaling.can(ScaleEvent.BEGIN):
                err = SpecViolation(SCALE.name, self._scaling.state.name, ScaleEvent.BEGIN.name)
                if self._scaling.state is ScaleState.POWERING:
                    why = ("a power call (sleep, wake-up, pause, resume) of this client is"
                           " running; scale once it returned")
                elif state in SCALE_REFUSED:
                    why = (f"the client is {state.value}: wake it up first (a joiner starts"
                           " awake, so the group would be neither asleep nor awake)")
                else:
                    why = "another scale of this client is running (one scale at a time)"
                err.args = (f"scale: {why}; nothing changed ({err})",)
                raise err
            if not self._engine_options.launch_engine:
                raise ValueError("scale: only a client that launches its engines (the 'mp'"
                                 " or 'ray' backend) scales; this one's are attached")
            members = self._membership.in_set()
            have = [s.index for s in members]
            given = [name for name in PER_ENGINE if getattr(self.options, name) is not None]
            if given and n > len(have):
                raise ValueError(f"scale: n={n} adds engines, and {', '.join(given)} name"
                                 " one address per engine of the set this client started"
                                 " with; a joiner would have none (shrinking is fine)")
            if remove is not None:
                unknown = sorted(set(remove) - set(have))
                if unknown:
                    raise ValueError(f"scale: remove={list(remove)!r} names {unknown}, not"
                                     f" engines of this client (its engines: {have})")
                if len(have) - len(remove) != n:
                    raise ValueError(f"scale: n={n} with remove={list(remove)!r}: removing"
                                     f" {len(remove)} of {len(have)} engines leaves"
                                     f" {len(have) - len(remove)}")
            self._scaling.fire(ScaleEvent.BEGIN)
            joiners: list[Slot] = []
            leavers: list[Slot] = []
            if n > len(have):
                joiners = self._membership.add_slots(n - len(have), self.trace)
                self._router.grow(len(self._slots))
            elif n < len(have):
                chosen = set(remove) if remove is not None else set(have[n:])
                leavers = [s for s in members if s.index in chosen]
                for s in leavers:
                    self._membership.leave(s)
                    if s.client is not None:
                        s.client.watch_finishes()
                self._follow_members_power()
            return joiners, leavers

    def _drain_out(self, leavers: list[Slot], drain_s: float) -> None:
        """Each leaver's live requests finish (at its engine: read or not) until ``drain_s``
        has passed; what is left then is aborted; then its process goes (bounded)."""
        deadline = time.monotonic() + drain_s
        waiting = list(leavers)
        while waiting:
            with self._state_lock:
                live = self._requests
                left = []
                for s in waiting:
                    client = s.client
                    if client is None or self.is_closed:
                        continue  # died meanwhile (gone already), or the client closes
                    done = client.finishes_arrived()
                    rids = [r for r in self._router.sent_to(client, live) if r not in done]
                    left.append((s, client, rids))
            late = time.monotonic() >= deadline
            for s, client, rids in left:
                if not rids or late:
                    # What is left ends ABORT here once the backlog is read (``_drain_done``):
                    # the engine's own abort could not say why, and its process goes anyway.
                    self._membership.remove(s, client)
            waiting = [s for s, _, rids in left if rids and not late]
            if waiting:
                time.sleep(_DRAIN_POLL_S)

    # -- reporting --------------------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        """How many engines this client serves with now (``scale`` changes it): the indexes
        of its set, a dead one too (not those leaving)."""
        with self._state_lock:
            return len(self._membership.in_set())

    def engine_reports(self) -> list[EngineReport]:
        """One record per engine index still reported (``engines``): its membership state
        and what the client knows of it, without asking the engines (``call_utility_all(
        "get_stats")`` asks each serving one)."""
        with self._state_lock:
            reports = []
            for s in self._slots:
                if s.lifecycle.state in MEMBER_GONE:
                    continue
                client = s.client
                reports.append(EngineReport(
                    index=s.index, state=s.lifecycle.state,
                    pid=None if client is None else client.engine_pid,
                    in_flight=0 if client is None else self._router.in_flight(client),
                    restarts=s.restarts,
                    cause=None if s.cause is None else str(s.cause)))
            return reports

    @property
    def engines(self) -> dict[int, MembershipState]:
        """Each engine index's membership state (spec/membership.py)."""
        with self._state_lock:
            return self._membership.states()

    @property
    def dead_engines(self) -> list[int]:
        """The engine indexes not serving now (dead, or restarting after a death)."""
        with self._state_lock:
            return self._membership.not_serving()

    @property
    def engine_pids(self) -> list[int | None]:
        """Each index's engine pid (None while it restarts, or for an index a scale-down
        left free below a serving one)."""
        with self._state_lock:
            slots = list(self._slots)
            while slots and slots[-1].lifecycle.state in MEMBER_GONE:
                slots.pop()
            clients = [s.client for s in slots]
        return [None if c is None else c.engine_pid for c in clients]

    def send_raw_frames(self, frames: list[bytes], engine_index: int | None = None) -> None:
        """``MPClient.send_raw_frames`` to engine ``engine_index`` (default: the engine the
        last ADD went to): for conformance tests that put malformed input on the wire."""
        with self._state_lock:
            index = self._router.last_routed if engine_index is None else engine_index
            client = self._slots[index].client
            if client is None:
                raise self._no_engine()
        client.send_raw_frames(frames)

    def engine_client(self, index: int) -> Any:
        """The one-engine client behind engine ``index`` (for tests and the fault harness);
        None while that engine restarts."""
        return self._slots[index].client

    def pending_utility_calls(self) -> int:
        with self._state_lock:
            clients = [s.client for s in self._slots if s.client is not None]
        return sum(c.pending_utility_calls() for c in clients)

    def queued_outputs(self) -> int:
        with self._state_lock:
            n = len(self._failed) + len(self._redeliver)
            for c in self._membership.held():
                if not c.read_to_end:
                    n += c.queued_outputs()
            return n

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every engine (each as ``SyncMPClient.shutdown`` does, all at once) and free
        everything; idempotent."""
        if timeout is not None:
            check_timeout(timeout)
        self._abort_left_behind()
        self._mark_closed()
        self._teardown(timeout)

    def _abort_left_behind(self) -> None:
        """Before the requests are forgotten: an attached engine outlives this client, so it
        is told to abort what it still runs for us (``MPClient.abort_left_behind``)."""
        with self._state_lock:
            if self.is_closed or self.is_dead:
                return
            live = self._requests
            held = [(c, self._router.sent_to(c, live)) for s in self._slots
                    for c in (s.client,) if c is not None]
        for client, rids in held:
            client.abort_left_behind(rids)

    def _teardown(self, timeout: float | None = None) -> None:
        with self._state_lock:
            self._failed.clear()
        self._membership.teardown(timeout)
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


def _attempt(client: Any, method: str, args: tuple[Any, ...], timeout: float | None
             ) -> tuple[bool, Any]:
    try:
        return True, client.call_utility(method, *args, timeout=timeout)
    except Exception as e:  # handed back in order, raised by _outcomes
        return False, e


def _result(fut: concurrent.futures.Future[Any]) -> tuple[bool, Any]:
    try:
        return True, fut.result()
    except Exception as e:  # as _attempt
        return False, e


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

    def scale(self, n: int, *, drain: bool = True, drain_timeout_s: float = 30.0,
              remove: Sequence[int] | None = None) -> None:
        """Grow or shrink the set of engines to ``n`` while requests flow; returns when the
        new set is in place (every joiner serving, every leaver's process gone).

        Joiners start with this client's config and backend and take work only once all
        are up; one that fails to start undoes the scale (``EngineStartupError`` naming it).
        Leavers (``remove``, default the highest indexes) take no new work from this call
        on; with ``drain`` their live requests finish until ``drain_timeout_s``, and what
        is left then (everything, without ``drain``) ends with ``FinishReason.ABORT`` and an
        error saying the engine was removed; their pending calls raise ``EngineDeadError``.
        One scale at a time, none while the client sleeps: a ``SpecViolation`` says why."""
        self._scale(n, drain, drain_timeout_s, remove)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next batch from any engine (its ``engine_index`` says which); an empty batch
        if ``timeout`` passes first. ``EngineDeadError`` only once no engine is left."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self._arrivals
            out = self._output_step(deadline)
            if out is not None:
                return out
            slice_s = (MAX_WAIT_SLICE_S if deadline is None
                       else min(deadline - time.monotonic(), MAX_WAIT_SLICE_S))
            with self._arrival:
                if self._arrivals == seen:
                    self._arrival.wait(slice_s)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self._call(method, args, timeout, every=False)

    def call_utility_all(self, method: str, *args: Any, timeout: float | None = None
                         ) -> list[Any]:
        """``call_utility`` on every serving engine at once; their results in index order.
        The first failure (in index order) is raised once every engine answered."""
        result: list[Any] = self._call(method, args, timeout, every=True)
        return result

    def _call(self, method: str, args: tuple[Any, ...], timeout: float | None, every: bool
              ) -> Any:
        timeout = check_timeout(timeout)  # bad arguments begin no call
        check_method(method)
        with self._power_window(method):
            lc = self._new_utility_lifecycle()
            with utility_outcome(lc):
                targets, combine = self._plan(method, args, every)
                result = self._finish(method, targets, combine, every,
                                      self._call_each(method, args, timeout, targets))
                lc.fire(UtilityEvent.REPLY_OK)
        return result

    def _call_each(self, method: str, args: tuple[Any, ...], timeout: float | None,
                   targets: Targets) -> list[tuple[bool, Any]]:
        """Each target's outcome: the one target's in this thread, several at once."""
        if len(targets) == 1:
            return [_attempt(targets[0][1], method, args, timeout)]
        with self._state_lock:
            if self._pool is None:  # its threads start as calls need them
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _UTILITY_THREADS, thread_name_prefix="EngineCoreUtility")
            pool = self._pool
        futures = [pool.submit(_attempt, client, method, args, timeout)
                   for _, client in targets]
        return [f.result() for f in futures]


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
            clients = self._membership.held()
        rebind = self._loop is not loop
        for c in clients:
            # A replacement built off the loop binds too (``bind_loop`` is a no-op when bound).
            if not c.is_closed:
                c.bind_loop()
        if rebind:
            self._loop, self._arrived = loop, asyncio.Event()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._bind()
        self._route_add(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._route_abort(request_ids)

    async def scale_async(self, n: int, *, drain: bool = True, drain_timeout_s: float = 30.0,
                          remove: Sequence[int] | None = None) -> None:
        """See ``SyncDPClient.scale``. The steps run in a worker thread (the loop keeps
        serving meanwhile); a cancelled caller does not stop a scale that began."""
        self._bind()
        await asyncio.to_thread(self._scale, n, drain, drain_timeout_s, remove)
        self._bind()  # the joiners read on this loop from now on

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
            out = self._output_step(deadline)
            if out is not None:
                return out
            slice_s = (MAX_WAIT_SLICE_S if deadline is None
                       else min(deadline - time.monotonic(), MAX_WAIT_SLICE_S))
            try:
                async with asyncio.timeout(slice_s):
                    await event.wait()
            except TimeoutError:
                pass

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout: float | None = None) -> Any:
        return await self._call_async(method, args, timeout, every=False)

    async def call_utility_all_async(self, method: str, *args: Any,
                                     timeout: float | None = None) -> list[Any]:
        """See ``SyncDPClient.call_utility_all``."""
        result: list[Any] = await self._call_async(method, args, timeout, every=True)
        return result

    async def _call_async(self, method: str, args: tuple[Any, ...], timeout: float | None,
                          every: bool) -> Any:
        timeout = check_timeout(timeout)  # bad arguments begin no call
        check_method(method)
        self._bind()
        with self._power_window(method):
            lc = self._new_utility_lifecycle()
            with utility_outcome(lc):
                targets, combine = self._plan(method, args, every)
                outcomes = await self._call_each_async(method, args, timeout, targets)
                result = self._finish(method, targets, combine, every, outcomes)
                lc.fire(UtilityEvent.REPLY_OK)
        return result

    async def _call_each_async(self, method: str, args: tuple[Any, ...],
                               timeout: float | None, targets: Targets
                               ) -> Iterator[tuple[bool, Any]]:
        """Each target's outcome, all awaited at once; a cancellation is the caller's."""
        if len(targets) == 1:
            try:
                return iter([(True, await targets[0][1].call_utility_async(
                    method, *args, timeout=timeout))])
            except Exception as e:  # handed back, raised by _outcomes
                return iter([(False, e)])
        got = await asyncio.gather(
            *(client.call_utility_async(method, *args, timeout=timeout) for _, client in targets),
            return_exceptions=True)
        for g in got:
            if isinstance(g, asyncio.CancelledError):
                raise g
        return ((not isinstance(g, BaseException), g) for g in got)

    async def shutdown_async(self, timeout: float | None = None) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    async def __aenter__(self) -> AsyncDPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown_async()

