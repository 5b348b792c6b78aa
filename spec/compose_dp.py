"""The two-engine model: one data-parallel client over two engines, channels and monitors.

Theory of operation
-------------------
Rule 1: as in the one-engine model (``compose.py``), every component fires its events through
the machine tables of this package, and an event the tables forbid is a violation
(``dp_spec_conformance``); each engine index has a ``membership`` lifecycle
(``membership.py``), and the client reads its named sets (``MEMBER_ROUTABLE``,
``MEMBER_LEFT``) exactly as the runtime does.
Rule 2: this model is about what data parallelism adds, so everything one engine already
does is left to the one-engine model: no aborts, attach, hangs or corrupt frames here, and of
power only what a group adds (below). It is bounded: ``N`` engine indexes, ``REQS`` request
slots (ids, reusable once finished), one utility call, one power call, ``BUDGET`` owner
actions (scales included), ``FAULTS`` engine deaths, channels of ``IN_CAP`` and ``OUT_CAP``
frames.

The owner constructs the client with or without restarts (``restart_dead_engines``). The
constructor waits for every engine's handshake; an engine lost before then fails the
construction (every engine is killed, the client ends in SHUTDOWN). An ADD or a utility call
goes to one engine the owner's router may pick: any engine whose member is in
``MEMBER_ROUTABLE``. An engine dies silently (its monitor notices the exit) or with the dead
sentinel (its reader notices; the monitor's later notice loops in DEAD), at any time, also
while starting. The client learns it once per incarnation: the member goes DEAD, exactly the
live requests and pending calls that engine owns end (``FinishReason.ERROR``,
``EngineDeadError``), its channel is closed and what was in flight on it dropped. With
restarts the member goes RESTARTING at once and a replacement starts under the same index
with a fresh channel and a new *incarnation* number; its handshake makes the member SERVING,
its death before that leaves the member DEAD (no second restart). The client is DEAD only
when no member is in ``MEMBER_LEFT``. shutdown() ends every member at once (an engine's exit
after it loops in SHUT_DOWN), kills every engine and fails what is still live; a second
shutdown() changes nothing.

Power (sleep and wake-up, pause and resume alike): the owner's power call goes to every
serving engine; each engine sleeps, or wakes fully or partly (some memory still asleep), and
replies. Each member's client follows its own engine's replies, a late one too (``mslp``:
that client is in ``CLIENT_ASLEEP``); the owner may stop waiting (its timeout) while replies
are in flight, and a target may die first. The group's client state is derived, after every
reply, death and restart, from its serving members: in ``CLIENT_ASLEEP`` while any of them
is, awake (WAKE_ACKED, fully) once none is; a replacement starts awake. So the client never
claims a state its engines are not in, and no power reply can find the client in a state
with no row for it (``dp_power_follows_engines``, ``dp_spec_conformance``). Requests are
stepped whatever the power state: what sleeping does to them is the one-engine model's.

Scale (``scale(n)``, membership's "Elastic scaling"): with the client live and not asleep
(``SCALE_REFUSED``), no power call in progress and no other scale running (``SCALE``: one at
a time), the owner may make one index leave, as long as the other stays in the set
(``MEMBER_IN_SET``), or make a removed index join again; both are owner calls of ``BUDGET``,
so a leave, a join of the same index and one request, call or shutdown() fit in a run, and
requests, the utility call and deaths (``FAULTS``) race the scale. A serving leaver is LEAVE'd
to DRAINING at once: nothing new is routed to it (it is not in ``MEMBER_ROUTABLE``) while
what it already holds goes on; the drain ends (the client's ``drain_ends`` step) when none
of its requests or calls is live, or at its deadline, which may fire at any time (at once:
``drain=False``): what is still its own then ends, requests with ABORT and the call with
EngineDeadError. Either way the client kills and reaps the process, closes its channel and
fires DRAINED (REMOVED); its monitor's later report of that exit loops in REMOVED. A leaver
that dies first is REMOVED by DIED, its work failed like any dead engine's, and it is never
restarted. A dead or restarting index is REMOVEd at once (a replacement is killed). A
joiner is a new slot: a new membership lifecycle in STARTING, a new incarnation (the restart
numbering, so its frames and channel are its own) and a fresh process; the scale's waiter
for it exists before it starts, and its handshake (SERVING, then it takes work) or its
death (DIED, then REMOVE) wakes it; a joiner that misses its handshake deadline is REMOVEd
from STARTING and killed. A scale ends (``SCALE`` END) when its leaver is REMOVED or its
joiner serves or failed, or when shutdown() fails it. The client is DEAD only when no
member is in ``MEMBER_LEFT``, so a draining leaver still counts, and a removal can be what
leaves none (``dp_client_dead_iff_none_left``).

Every frame carries the incarnation of the engine it was sent to or by, so the model can
tell a frame meant for a predecessor from one meant for its replacement
(``dp_fresh_channel``); bit 7 of a frame (``FROM_REMOVED``) is ground truth no client reads:
a removed tenure's process sent it (``dp_removed_engine_silent``; only the negative control
``removed_identity_reused`` leaves such a process running and hands its identity to the
joiner, as vLLM PR #37357's removed Ray actors did). Negative controls (``BUGS``) are
one-line deviations, carried by the generated ``spec/enginewire_dp.pml`` under
``#ifdef BUG_<NAME>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

from ._compose_world import ComposedModel, StepBase, Table, ix
from .client import (
    CLIENT,
    CLIENT_ASLEEP,
    CLIENT_LIVE,
    FULLY_AWAKE,
    PARTIALLY_AWAKE,
    ClientEvent,
    ClientState,
)
from .compose import Action
from .engine import ENGINE, EngineEvent, EngineState
from .membership import (
    LAST_POWER_CALL,
    MEMBER_IN_SET,
    MEMBER_LEFT,
    MEMBER_ROUTABLE,
    MEMBERSHIP,
    OTHER_POWER_CALLS,
    SCALE,
    SCALE_REFUSED,
    MembershipEvent,
    MembershipState,
    ScaleEvent,
    ScaleState,
)
from .request import (
    CLIENT_REQUEST,
    CLIENT_REQUEST_LIVE,
    ENGINE_REQUEST,
    ENGINE_REQUEST_LIVE,
    ClientRequestEvent,
    ClientRequestState,
    EngineRequestEvent,
    EngineRequestState,
)
from .utility import UTILITY, UtilityEvent, UtilityState

__all__ = [
    "BUGS",
    "COVERS",
    "FIELDS",
    "UNEXERCISED",
    "DPComposition",
    "World",
    "describe_world",
]

# ---- bounds --------------------------------------------------------------------------------
N = 2  # engines
REQS = 2  # request slots (ids), reusable once finished
BUDGET = 3  # owner calls: construction aside, shutdown() included
FAULTS = 2  # engine deaths: two, so that both engines can be lost, or a replacement too
IN_CAP = 2
OUT_CAP = 2

# ---- frames: kind in the low 3 bits, request slot in bit 3, incarnation in bits 4-6 ----------
IN_MSGS = ("ADD", "UTIL", "SLEEP", "WAKE")
OUT_MSGS = ("HS", "FIN", "UREPLY", "DEAD", "SLEPT", "WOKE")
I_ADD, I_UTIL, I_SLEEP, I_WAKE = 1, 2, 3, 4
O_HS, O_FIN, O_UREPLY, O_DEAD, O_SLEPT, O_WOKE = 1, 2, 3, 4, 5, 6
# The owner's power call: none, a sleep or a wake-up (the frame's slot bit, on a WOKE reply,
# says whether that engine is fully awake).
P_NONE, P_SLEEP, P_WAKE = 0, 1, 2


# Bit 7 is the model's ground truth, read by no client: the frame was sent by the process of a
# removed tenure (only a removed engine left running sends one: BUG removed_identity_reused).
FROM_REMOVED = 1 << 7


def frame(kind: int, slot: int, gen: int) -> int:
    return kind | slot << 3 | gen << 4


def gen_of(msg: int) -> int:
    """The incarnation (identity) a frame names."""
    return (msg >> 4) & 7


# ---- world layout ----------------------------------------------------------------------------
_GLOBAL = ("client", "started", "restart_on", "util", "uown", "ugen", "closing", "budget",
           "faults", "pcall", "pmask", "ppart", "pfail", "scale", "sjoin", "sleave", "swait")
_PER_REQ = ("creq", "own", "ogen", "ereq")  # own/ogen: the engine and incarnation it went to
_PER_ENGINE = ("mem", "eng", "gen", "inq", "outq", "exited", "seen", "asleep", "mslp", "zombie")
FIELDS: tuple[str, ...] = (
    *_GLOBAL,
    *(f"{name}{r}" for name in _PER_REQ for r in range(REQS)),
    *(f"{name}{i}" for name in _PER_ENGINE for i in range(N)),
    "bad",
)
_AT = {name: i for i, name in enumerate(FIELDS)}
(C, STARTED, RESTART_ON, UTIL, UOWN, UGEN, CLOSING, BUDGET_LEFT, FAULTS_LEFT, PCALL, PMASK,
 PPART, PFAIL, SCALE_ST, SJOIN, SLEAVE, SWAIT) = (_AT[n] for n in _GLOBAL)
CREQ, OWN, OGEN, EREQ = (tuple(_AT[f"{n}{r}"] for r in range(REQS)) for n in _PER_REQ)
MEM, ENG, GEN, INQ, OUTQ, EXITED, SEEN, ASLEEP, MSLP, ZOMBIE = (
    tuple(_AT[f"{n}{i}"] for i in range(N)) for n in _PER_ENGINE)
BAD = _AT["bad"]
# started: the owner has constructed the client (choosing restarts or not); seen: the monitor
# reported the exit of this incarnation; asleep: the engine sleeps (some memory asleep);
# mslp: the member's client believes it does (it followed a power reply of this incarnation's).
# pcall: the owner's power call in progress (P_*), pmask: the engines it still waits for (a
# bit each); under the negative control power_follows_combined_reply only (nothing else reads
# them, so SPIN keeps them out of its state vector elsewhere): ppart, one of them woke only
# partly; pfail, one died before replying or the owner stopped waiting.
# scale: the SCALE machine's state; sjoin / sleave: the index the running scale joins or
# removes, plus one (0: none); swait: the scale's waiter for its joiner is armed (set with the
# joiner's start, but for the negative control join_waiter_after_event). zombie: the identity,
# plus one, of a removed tenure's process still running on this index (only under the negative
# control removed_identity_reused: the protocol reaps a leaver before it is REMOVED).
NO_UTIL = -1
World = tuple[Any, ...]

BUGS = (
    "every_handshake_readies_client",
    "death_fails_every_engine",
    "fail_only_when_client_dies",
    "route_to_restarting",
    "replay_on_restart",
    "restart_reuses_channel",
    "client_dies_with_first_member",
    "replacement_unmonitored",
    "reader_forgets_replacement",
    "power_follows_combined_reply",
    "route_to_leaver",
    "deadline_forgets_live",
    "join_waiter_after_event",
    "joiner_death_unwaited",
    "removed_identity_reused",
    "draining_not_counted",
    "power_beside_scale",
)

# The machines whose every row this model must exercise (the others are the one-engine
# model's; it fires some of their rows too).
COVERS = (MEMBERSHIP, SCALE)
_ONE_CALLER = ("bounded: the owner makes one power call at a time (overlapping power calls"
               " are the runtime's, tested in tests/runtime/test_dp_scale.py)")
UNEXERCISED: dict[tuple[str, str], str] = {
    ("scale", "POWERING --POWER_BEGIN--> POWERING"): _ONE_CALLER,
    ("scale", f"POWERING --POWER_END [{OTHER_POWER_CALLS}]--> POWERING"): _ONE_CALLER,
}

CS, CE = ClientState, ClientEvent
ES, EE = EngineState, EngineEvent
MS, ME = MembershipState, MembershipEvent
SS, SE = ScaleState, ScaleEvent
RS, RE = EngineRequestState, EngineRequestEvent
QS, QE = ClientRequestState, ClientRequestEvent
US, UE = UtilityState, UtilityEvent

C_CONSTRUCTING, C_DEAD, C_SHUTDOWN = ix(CS.CONSTRUCTING), ix(CS.DEAD), ix(CS.SHUTDOWN)
C_LIVE = frozenset(ix(s) for s in CLIENT_LIVE)
C_ASLEEP = frozenset(ix(s) for s in CLIENT_ASLEEP)
M_STARTING, M_SERVING, M_DRAINING, M_DEAD, M_RESTARTING, M_REMOVED, M_SHUT_DOWN = (
    ix(s) for s in (MS.STARTING, MS.SERVING, MS.DRAINING, MS.DEAD, MS.RESTARTING, MS.REMOVED,
                    MS.SHUT_DOWN))
M_ROUTABLE = frozenset(ix(s) for s in MEMBER_ROUTABLE)
M_LEFT = frozenset(ix(s) for s in MEMBER_LEFT)
M_IN_SET = frozenset(ix(s) for s in MEMBER_IN_SET)
S_IDLE, S_SCALING, S_POWERING = ix(SS.IDLE), ix(SS.SCALING), ix(SS.POWERING)
C_SCALE_REFUSED = frozenset(ix(s) for s in SCALE_REFUSED)
E_CONSTRUCTING, E_IDLE, E_RUNNING = ix(ES.CONSTRUCTING), ix(ES.IDLE), ix(ES.RUNNING)
E_LOOP = frozenset({E_IDLE, E_RUNNING})  # the states this model's engines serve input in
R_UNKNOWN, R_WAITING = ix(RS.UNKNOWN), ix(RS.WAITING)
R_LIVE = frozenset(ix(s) for s in ENGINE_REQUEST_LIVE)
Q_LIVE = frozenset(ix(s) for s in CLIENT_REQUEST_LIVE)
Q_FREE = frozenset(ix(s) for s in QS) - Q_LIVE
Q_ERROR = ix(QS.FINISHED_ERROR)
U_PENDING = ix(US.PENDING)


class _Step(StepBase):
    """A step of the two-engine model (``StepBase``: the one-engine model's, shared)."""

    __slots__ = ()
    BAD_FIELD = BAD
    CONFORMANCE = "dp_spec_conformance"


def owns(w: World | list[Any], r: int, i: int) -> bool:
    """Request slot ``r`` was sent to engine ``i``'s current incarnation."""
    return bool(w[OWN[r]] == i and w[OGEN[r]] == w[GEN[i]])


class DPComposition(ComposedModel):
    """The two-engine model; ``bug`` selects one negative control (``None``: the protocol)."""

    BUGS = BUGS
    BAD_FIELD = BAD
    TABLES = (("t_client", CLIENT), ("t_mem", MEMBERSHIP), ("t_engine", ENGINE),
              ("t_ereq", ENGINE_REQUEST), ("t_creq", CLIENT_REQUEST), ("t_util", UTILITY),
              ("t_scale", SCALE))
    t_client: Table
    t_mem: Table
    t_engine: Table
    t_ereq: Table
    t_creq: Table
    t_util: Table
    t_scale: Table

    def initial(self) -> World:
        w: list[Any] = [0] * len(FIELDS)
        w[C] = C_CONSTRUCTING
        w[UTIL] = NO_UTIL
        w[BUDGET_LEFT] = BUDGET
        w[FAULTS_LEFT] = FAULTS
        w[SCALE_ST] = S_IDLE
        for r in range(REQS):
            w[CREQ[r]] = ix(QS.UNKNOWN)
            w[EREQ[r]] = R_UNKNOWN
        for i in range(N):
            w[MEM[i]] = M_STARTING
            w[ENG[i]] = E_CONSTRUCTING
            w[INQ[i]] = w[OUTQ[i]] = ()
        w[BAD] = ""
        return tuple(w)

    # ---- shared effects ----------------------------------------------------------------------
    def _fail_request(self, s: _Step, r: int, dead: int) -> None:
        if not owns(s.w, r, dead):
            s.flag("dp_death_fails_its_own")  # another engine's request, failed by this death
        s.fire(CREQ[r], self.t_creq, QE.ENGINE_DIED)

    def _fail_call(self, s: _Step, dead: int) -> None:
        if not (s.w[UOWN] == dead and s.w[UGEN] == s.w[GEN[dead]]):
            s.flag("dp_death_fails_its_own")
        s.fire(UTIL, self.t_util, UE.ENGINE_DIED)

    def _fail_owned(self, s: _Step, i: int, *, everyone: bool = False) -> None:
        """Exactly engine ``i``'s live requests and pending call end (``everyone``: all)."""
        for r in range(REQS):
            if s.w[CREQ[r]] in Q_LIVE and (everyone or owns(s.w, r, i)):
                self._fail_request(s, r, i)
        if s.w[UTIL] == U_PENDING and (everyone or (s.w[UOWN] == i
                                                    and s.w[UGEN] == s.w[GEN[i]])):
            self._fail_call(s, i)

    def _derive_power(self, s: _Step) -> None:
        """The group's client state from its serving members' (the runtime's
        ``_DPClient._follow_members_power``): asleep while any is, awake once none is."""
        if self.bug == "power_follows_combined_reply" or s.w[C] not in C_LIVE:
            return
        serving = [i for i in range(N) if s.w[MEM[i]] in M_ROUTABLE]
        if not serving:
            return
        asleep = any(s.w[MSLP[i]] for i in serving)
        if asleep and s.w[C] not in C_ASLEEP:
            s.fire(C, self.t_client, CE.SLEEP_ACKED)
        elif not asleep and s.w[C] in C_ASLEEP:
            s.fire(C, self.t_client, CE.WAKE_ACKED, FULLY_AWAKE)

    def _power_settled(self, s: _Step, i: int, *, partial: bool = False,
                       died: bool = False) -> None:
        """Engine ``i`` answered the owner's power call, or died before it did."""
        bit = 1 << i
        if not s.w[PMASK] & bit:
            return  # a late reply, or an engine the call did not go to
        s.w[PMASK] &= ~bit
        if self.bug == "power_follows_combined_reply":  # only its combined reply reads them
            s.w[PPART] |= partial
            s.w[PFAIL] |= died
        if not s.w[PMASK]:
            self._power_ends(s)

    def _power_ends(self, s: _Step) -> None:
        """The owner's power call returns (every target answered or died, or it gave up).
        BUG power_follows_combined_reply: the client moves only on a call every target
        answered in time, by their combined reply (as the runtime did before issue 44)."""
        if (self.bug == "power_follows_combined_reply" and not s.w[PFAIL]
                and s.w[C] in C_LIVE):
            if s.w[PCALL] == P_SLEEP:
                s.fire(C, self.t_client, CE.SLEEP_ACKED)
            else:
                s.fire(C, self.t_client, CE.WAKE_ACKED,
                       PARTIALLY_AWAKE if s.w[PPART] else FULLY_AWAKE)
        self._power_call_over(s)

    def _power_call_over(self, s: _Step) -> None:
        """The owner's power call is over (answered, given up, or failed by shutdown())."""
        if s.w[SCALE_ST] == S_POWERING:
            s.fire(SCALE_ST, self.t_scale, SE.POWER_END, LAST_POWER_CALL)
        s.w[PCALL] = P_NONE
        s.w[PMASK] = s.w[PPART] = s.w[PFAIL] = 0

    def _close_channel(self, s: _Step, i: int) -> None:
        if self.bug != "restart_reuses_channel":
            s.w[INQ[i]] = s.w[OUTQ[i]] = ()

    def _any_left(self, s: _Step) -> bool:
        """Whether a member still counts for the client (BUG draining_not_counted: a
        draining leaver does not, as before elastic scaling)."""
        counted = M_LEFT - {M_DRAINING} if self.bug == "draining_not_counted" else M_LEFT
        return any(s.w[MEM[j]] in counted for j in range(N))

    def _notice(self, s: _Step, i: int) -> None:
        """The client learns that engine ``i``'s current incarnation is gone."""
        bug = self.bug
        before = s.w[MEM[i]]
        s.fire(MEM[i], self.t_mem, ME.DIED)  # DEAD, REMOVED and SHUT_DOWN loop: a later notice
        if before not in M_LEFT:
            return
        if s.w[C] == C_CONSTRUCTING:  # an engine lost before every handshake: start-up fails
            s.fire(C, self.t_client, CE.CONSTRUCTION_FAILED)
            for j in range(N):
                s.fire(MEM[j], self.t_mem, ME.SHUTDOWN)
                s.w[EXITED[j]] = 1  # the constructor kills and reaps every engine
                s.w[INQ[j]] = s.w[OUTQ[j]] = ()
            return
        if bug != "fail_only_when_client_dies":
            self._fail_owned(s, i, everyone=bug == "death_fails_every_engine")
        self._power_settled(s, i, died=True)
        self._close_channel(s, i)
        if before == M_SERVING and s.w[RESTART_ON]:
            s.fire(MEM[i], self.t_mem, ME.RESTART)
            s.w[GEN[i]] += 1  # a new incarnation: a new process with a fresh channel
            s.w[ENG[i]] = E_CONSTRUCTING
            s.w[EXITED[i]] = s.w[SEEN[i]] = 0
            s.w[ASLEEP[i]] = s.w[MSLP[i]] = 0  # it starts awake, and its client with it
        elif before == M_DRAINING:  # a dead leaver is gone (REMOVED), never restarted
            s.w[ASLEEP[i]] = s.w[MSLP[i]] = 0
            if s.w[SLEAVE] == i + 1:
                self._end_scale(s)
        elif before == M_STARTING:  # a joiner that failed to start fails its scale
            s.fire(MEM[i], self.t_mem, ME.REMOVE)
            if bug != "joiner_death_unwaited":
                self._wake_waiter(s, i)
        if not self._any_left(s) or (bug == "client_dies_with_first_member"
                                     and s.w[C] != C_DEAD):
            s.fire(C, self.t_client, CE.ENGINE_DIED)
            if bug == "fail_only_when_client_dies":  # the one-engine client's death path
                for j in range(N):
                    self._fail_owned(s, j)
        self._derive_power(s)

    # ---- scale -------------------------------------------------------------------------------
    def _end_scale(self, s: _Step) -> None:
        """The running scale returns (done, failed, or failed by shutdown())."""
        s.fire(SCALE_ST, self.t_scale, SE.END)
        s.w[SJOIN] = s.w[SLEAVE] = s.w[SWAIT] = 0

    def _wake_waiter(self, s: _Step, i: int) -> None:
        """Joiner ``i`` handshook or failed: its scale's waiter wakes, and the scale returns.
        An event with no waiter yet is lost (BUG join_waiter_after_event arms it too late)."""
        if s.w[SJOIN] == i + 1 and s.w[SWAIT]:
            self._end_scale(s)

    def _removed(self, s: _Step, i: int) -> None:
        """The client made member ``i`` REMOVED itself (drained, its deadline, a dead or
        restarting index, a joiner too late): it kills and reaps the process and closes its
        channel; a scale waiting for that index returns; the client is DEAD if none is left.
        BUG removed_identity_reused: the process is left running on its channel (its exit
        is never noticed), and a later joiner takes its identity (``scale_join``)."""
        if self.bug == "removed_identity_reused":
            if not s.w[EXITED[i]]:
                s.w[ZOMBIE[i]] = s.w[GEN[i]] + 1
            self._engine_exits(s, i)
            s.w[SEEN[i]] = 1
        else:
            self._engine_exits(s, i)  # its monitor reports the exit later: REMOVED loops
            s.w[INQ[i]] = s.w[OUTQ[i]] = ()
        s.w[ASLEEP[i]] = s.w[MSLP[i]] = 0
        if i + 1 in (s.w[SLEAVE], s.w[SJOIN]):
            self._end_scale(s)
        if s.w[C] in C_LIVE and not self._any_left(s):
            s.fire(C, self.t_client, CE.ENGINE_DIED)
        self._derive_power(s)

    def _engine_exits(self, s: _Step, i: int) -> None:
        """The process is gone, and every request it held with it."""
        s.w[EXITED[i]] = 1
        for r in range(REQS):
            if owns(s.w, r, i):
                s.w[EREQ[r]] = R_UNKNOWN

    def _replay(self, s: _Step, i: int) -> None:
        """BUG replay_on_restart: the predecessor's failed requests go to the replacement."""
        for r in range(REQS):
            if (s.w[CREQ[r]] == Q_ERROR and s.w[OWN[r]] == i
                    and s.w[OGEN[r]] == s.w[GEN[i]] - 1 and len(s.w[INQ[i]]) < IN_CAP):
                s.w[OGEN[r]] = s.w[GEN[i]]
                s.w[INQ[i]] = (*s.w[INQ[i]], frame(I_ADD, r, s.w[GEN[i]]))

    # ---- actions -----------------------------------------------------------------------------
    def _actions(self) -> tuple[Action, ...]:
        bug = self.bug
        acts: list[Action] = []

        def add(actor: str, name: str, fn: Callable[[World], Iterator[tuple[str, World]]]
                ) -> None:
            acts.append(Action(actor, name, fn))

        def routable(w: World, i: int) -> bool:
            return w[MEM[i]] in M_ROUTABLE or (
                bug == "route_to_restarting" and w[MEM[i]] == M_RESTARTING) or (
                bug == "route_to_leaver" and w[MEM[i]] == M_DRAINING)

        def owner_may_call(w: World) -> bool:
            return bool(w[STARTED] and not w[CLOSING] and w[BUDGET_LEFT] > 0)

        def route(s: _Step, i: int, kind: int, slot: int) -> None:
            if s.w[MEM[i]] not in M_ROUTABLE:
                s.flag("dp_routes_to_serving")
            s.w[INQ[i]] = (*s.w[INQ[i]], frame(kind, slot, s.w[GEN[i]]))

        # -- the owner -------------------------------------------------------------------------
        def construct(w: World) -> Iterator[tuple[str, World]]:
            if not w[STARTED]:
                for restart, label in ((0, "construct"), (1, "construct_with_restarts")):
                    s = _Step(self, w)
                    s.w[STARTED] = 1
                    s.w[RESTART_ON] = restart
                    yield label, s.freeze()

        add("user", "construct", construct)

        for i in range(N):
            def add_request(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if not (owner_may_call(w) and w[C] in C_LIVE and routable(w, i)
                        and w[PCALL] == P_NONE and len(w[INQ[i]]) < IN_CAP):
                    return
                free = [r for r in range(REQS) if w[CREQ[r]] in Q_FREE]
                if not free:
                    return
                r = free[0]
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.fire(C, self.t_client, CE.ADD_REQUEST)
                s.fire(CREQ[r], self.t_creq, QE.SEND)
                s.w[OWN[r]], s.w[OGEN[r]] = i, s.w[GEN[i]]
                route(s, i, I_ADD, r)
                yield f"add_request_{i}", s.freeze()

            def call_utility(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if not (owner_may_call(w) and w[UTIL] == NO_UTIL and w[PCALL] == P_NONE
                        and w[C] in C_LIVE
                        and routable(w, i) and len(w[INQ[i]]) < IN_CAP):
                    return
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.w[UTIL], s.w[UOWN], s.w[UGEN] = U_PENDING, i, s.w[GEN[i]]
                route(s, i, I_UTIL, 0)
                yield f"call_utility_{i}", s.freeze()

            add("user", f"add_request_{i}", add_request)
            add("user", f"call_utility_{i}", call_utility)

        def power_call(w: World) -> Iterator[tuple[str, World]]:
            # One call of the owner's at a time, none while a request is live (bounds: what the
            # model must show is a power call against deaths, restarts, late replies, its own
            # timeout and a scale; requests beside a sleep are the one-engine model's).
            # A running scale refuses it (SCALE: POWER_BEGIN has no row in SCALING); BUG
            # power_beside_scale: sent anyway, to the engines serving then (not the joiner).
            if not (owner_may_call(w) and w[PCALL] == P_NONE and w[UTIL] == NO_UTIL
                    and (w[SCALE_ST] == S_IDLE or bug == "power_beside_scale")
                    and w[C] in C_LIVE and not any(w[q] in Q_LIVE for q in CREQ)):
                return
            targets = [i for i in range(N) if routable(w, i)]
            if not targets or any(len(w[INQ[i]]) >= IN_CAP for i in targets):
                return
            # As its client's state says, the owner sleeps an awake client and wakes a sleeping
            # one (the other calls are loops the one-engine model has).
            asleep = w[C] in C_ASLEEP
            for call, kind, label in ((P_SLEEP, I_SLEEP, "sleep"), (P_WAKE, I_WAKE, "wake_up")):
                if (call == P_WAKE) != asleep:
                    continue
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                if s.w[SCALE_ST] == S_IDLE:
                    s.fire(SCALE_ST, self.t_scale, SE.POWER_BEGIN)
                s.w[PCALL] = call
                for i in targets:
                    s.w[PMASK] |= 1 << i
                    route(s, i, kind, 0)
                yield label, s.freeze()

        def power_gives_up(w: World) -> Iterator[tuple[str, World]]:
            if w[PCALL] != P_NONE and w[PMASK]:
                s = _Step(self, w)  # its timeout: the replies still due come late
                if self.bug == "power_follows_combined_reply":
                    s.w[PFAIL] = 1
                self._power_ends(s)
                yield "power_call_times_out", s.freeze()

        add("user", "power_call", power_call)
        add("user", "power_call_times_out", power_gives_up)

        # -- scale(n): one index leaves, or a removed index joins again -----------------------
        def may_scale(w: World) -> bool:
            # Refused on a sleeping client (SCALE_REFUSED), one at a time (SCALE), not during
            # a power call (bounds, as above); requests and calls go on while it runs.
            return bool(owner_may_call(w) and w[C] in C_LIVE and w[C] not in C_SCALE_REFUSED
                        and w[PCALL] == P_NONE and w[SCALE_ST] == S_IDLE)

        for i in range(N):
            def leave(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                # The index leaves; the other stays in the set (scale(n) keeps n >= 1).
                if not (may_scale(w) and w[MEM[i]] in M_IN_SET and w[MEM[1 - i]] in M_IN_SET):
                    return
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.fire(SCALE_ST, self.t_scale, SE.BEGIN)
                s.w[SLEAVE] = i + 1
                if s.w[MEM[i]] == M_SERVING:
                    s.fire(MEM[i], self.t_mem, ME.LEAVE)  # no new work from now: drains
                    self._derive_power(s)
                else:  # a dead or restarting index goes at once (a replacement is killed)
                    s.fire(MEM[i], self.t_mem, ME.REMOVE)
                    self._removed(s, i)
                yield f"scale_leave_{i}", s.freeze()

            def join(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if not (may_scale(w) and w[MEM[i]] == M_REMOVED):
                    return
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.fire(SCALE_ST, self.t_scale, SE.BEGIN)
                s.w[MEM[i]] = M_STARTING  # a new slot: a membership lifecycle of its own
                if bug != "removed_identity_reused":
                    s.w[GEN[i]] += 1  # a new identity, and a fresh channel (closed at removal)
                s.w[ENG[i]] = E_CONSTRUCTING
                s.w[EXITED[i]] = s.w[SEEN[i]] = 0
                s.w[SJOIN] = i + 1
                # The waiter for "joiner ready" exists before the joiner starts.
                s.w[SWAIT] = int(bug != "join_waiter_after_event")
                yield f"scale_join_{i}", s.freeze()

            def join_times_out(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                # The joiner's handshake deadline: the scale fails, the joiner is REMOVED.
                if w[SJOIN] == i + 1 and w[SWAIT] and w[MEM[i]] == M_STARTING:
                    s = _Step(self, w)
                    s.fire(MEM[i], self.t_mem, ME.REMOVE)
                    self._removed(s, i)
                    yield f"scale_join_times_out_{i}", s.freeze()

            add("user", f"scale_leave_{i}", leave)
            add("user", f"scale_join_{i}", join)
            add("user", f"scale_join_times_out_{i}", join_times_out)

        if bug == "join_waiter_after_event":
            def arm_waiter(w: World) -> Iterator[tuple[str, World]]:
                if w[SCALE_ST] == S_SCALING and w[SJOIN] and not w[SWAIT]:
                    s = _Step(self, w)
                    s.w[SWAIT] = 1
                    yield "scale_waits_for_joiner", s.freeze()

            add("user", "scale_waits_for_joiner", arm_waiter)

        def shutdown(w: World) -> Iterator[tuple[str, World]]:
            if owner_may_call(w) and (w[C] in C_LIVE or w[C] == C_DEAD):
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.w[CLOSING] = 1
                for i in range(N):
                    s.fire(MEM[i], self.t_mem, ME.SHUTDOWN)
                if s.w[SCALE_ST] == S_SCALING:  # the running scale fails (the client closed)
                    self._end_scale(s)
                yield "shutdown", s.freeze()
            elif w[CLOSING] and w[BUDGET_LEFT] > 0 and w[C] == C_SHUTDOWN:
                s = _Step(self, w)  # shutdown() again: idempotent
                s.w[BUDGET_LEFT] -= 1
                s.fire(C, self.t_client, CE.SHUTDOWN)
                for i in range(N):
                    s.fire(MEM[i], self.t_mem, ME.SHUTDOWN)
                yield "shutdown_again", s.freeze()

        add("user", "shutdown", shutdown)

        # -- the client: teardown, one reader and one monitor per engine ----------------------
        for i in range(N):
            def kill(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if w[CLOSING] and not w[EXITED[i]]:
                    s = _Step(self, w)
                    s.w[EXITED[i]] = 1
                    yield f"shutdown_kill_{i}", s.freeze()

            add("client", f"shutdown_kill_{i}", kill)

        def finish(w: World) -> Iterator[tuple[str, World]]:
            if w[CLOSING] and w[C] != C_SHUTDOWN and all(w[EXITED[i]] for i in range(N)):
                s = _Step(self, w)
                s.fire(C, self.t_client, CE.SHUTDOWN)
                for r in range(REQS):
                    if s.w[CREQ[r]] in Q_LIVE:
                        s.fire(CREQ[r], self.t_creq, QE.FINISH_ERROR)
                if s.w[UTIL] == U_PENDING:
                    s.fire(UTIL, self.t_util, UE.CLIENT_SHUTDOWN)
                self._power_call_over(s)
                yield "shutdown_finish", s.freeze()

        add("client", "shutdown_finish", finish)

        for i in range(N):
            def drain_ends(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                """A leaver's drain ends: it finished its work, or its deadline fired (with
                drain=False, at once) and what is still its own ends now: requests with ABORT,
                the call with EngineDeadError. Either way the client kills and reaps it."""
                if w[MEM[i]] != M_DRAINING:
                    return
                live = [r for r in range(REQS) if w[CREQ[r]] in Q_LIVE and owns(w, r, i)]
                call = w[UTIL] == U_PENDING and w[UOWN] == i and w[UGEN] == w[GEN[i]]
                s = _Step(self, w)
                if live or call:
                    if bug != "deadline_forgets_live":
                        for r in live:
                            s.fire(CREQ[r], self.t_creq, QE.FINISH_ABORT)
                        if call:
                            s.fire(UTIL, self.t_util, UE.ENGINE_DIED)
                s.fire(MEM[i], self.t_mem, ME.DRAINED)
                self._removed(s, i)
                yield (f"drain_deadline_{i}" if live or call else f"leaver_drained_{i}"), s.freeze()

            add("client", f"drain_ends_{i}", drain_ends)

        for i in range(N):
            def reader(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if not (w[OUTQ[i]] and w[MEM[i]] in M_LEFT and w[C] not in (C_DEAD, C_SHUTDOWN)):
                    return
                if bug == "reader_forgets_replacement" and w[GEN[i]] > 0:
                    return
                s = _Step(self, w)
                msg, s.w[OUTQ[i]] = s.w[OUTQ[i]][0], s.w[OUTQ[i]][1:]
                kind, r = msg & 7, (msg >> 3) & 1
                if gen_of(msg) != s.w[GEN[i]]:
                    s.flag("dp_fresh_channel")  # a frame of the predecessor's
                elif msg & FROM_REMOVED:
                    s.flag("dp_removed_engine_silent")  # taken as the current tenure's
                elif kind == O_HS:
                    s.fire(MEM[i], self.t_mem, ME.HANDSHAKE_OK)
                    self._wake_waiter(s, i)
                    ready = all(s.w[MEM[j]] in M_ROUTABLE for j in range(N))
                    if (s.w[C] == C_CONSTRUCTING and ready) or (
                            bug == "every_handshake_readies_client"):
                        s.fire(C, self.t_client, CE.HANDSHAKE_OK)
                    if bug == "replay_on_restart":
                        self._replay(s, i)
                    self._derive_power(s)
                elif kind == O_FIN:
                    if s.w[CREQ[r]] in Q_LIVE and owns(s.w, r, i):
                        s.fire(CREQ[r], self.t_creq, QE.FINISH_STOP)
                    else:
                        s.flag("dp_request_ends_once")
                elif kind == O_UREPLY:
                    if s.w[UTIL] == U_PENDING and s.w[UOWN] == i:
                        s.fire(UTIL, self.t_util, UE.REPLY_OK)
                    else:
                        s.flag("dp_request_ends_once")
                elif kind in (O_SLEPT, O_WOKE):
                    # The member's client follows its engine, in time or late; then the group.
                    full = kind == O_WOKE and r == 1
                    s.w[MSLP[i]] = 0 if full else 1
                    self._power_settled(s, i, partial=kind == O_WOKE and not full)
                    self._derive_power(s)
                else:  # O_DEAD, the sentinel
                    self._notice(s, i)
                yield f"receive_output_{i}", s.freeze()

            def monitor(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if not (w[EXITED[i]] and not w[SEEN[i]]):
                    return
                if bug == "replacement_unmonitored" and w[GEN[i]] > 0:
                    return
                s = _Step(self, w)
                s.w[SEEN[i]] = 1
                self._notice(s, i)
                yield f"process_exit_noticed_{i}", s.freeze()

            add("client", f"receive_output_{i}", reader)
            add("monitor", f"process_exit_noticed_{i}", monitor)

        # -- the engines -------------------------------------------------------------------
        for i in range(N):
            def start(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if w[STARTED] and not w[EXITED[i]] and w[ENG[i]] == E_CONSTRUCTING:
                    s = _Step(self, w)
                    s.fire(ENG[i], self.t_engine, EE.BUILT, "subprocess")
                    s.fire(ENG[i], self.t_engine, EE.HANDSHAKE_SENT)
                    s.fire(ENG[i], self.t_engine, EE.LOOP_STARTED)
                    s.w[OUTQ[i]] = (*s.w[OUTQ[i]], frame(O_HS, 0, s.w[GEN[i]]))
                    yield f"engine_start_{i}", s.freeze()

            def receive(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if not (not w[EXITED[i]] and w[INQ[i]] and w[ENG[i]] in E_LOOP
                        and len(w[OUTQ[i]]) < OUT_CAP):
                    return
                msg = w[INQ[i]][0]
                kind, r = msg & 7, (msg >> 3) & 1
                # A wake-up of a sleeping engine may leave some memory asleep (a partial one).
                for partial in ((False, True) if kind == I_WAKE and w[ASLEEP[i]] else (False,)):
                    s = _Step(self, w)
                    s.w[INQ[i]] = s.w[INQ[i]][1:]
                    if gen_of(msg) != s.w[GEN[i]]:
                        s.flag("dp_fresh_channel")  # a frame sent to the predecessor
                    elif kind == I_ADD:
                        s.fire(EREQ[r], self.t_ereq, RE.ADD)
                        if s.w[ENG[i]] == E_IDLE:
                            s.fire(ENG[i], self.t_engine, EE.WORK_ARRIVED)
                    elif kind == I_UTIL:
                        s.w[OUTQ[i]] = (*s.w[OUTQ[i]], frame(O_UREPLY, 0, s.w[GEN[i]]))
                    elif kind == I_SLEEP:
                        s.w[ASLEEP[i]] = 1
                        s.w[OUTQ[i]] = (*s.w[OUTQ[i]], frame(O_SLEPT, 0, s.w[GEN[i]]))
                    else:  # I_WAKE
                        s.w[ASLEEP[i]] = int(partial)
                        s.w[OUTQ[i]] = (*s.w[OUTQ[i]],
                                        frame(O_WOKE, int(not partial), s.w[GEN[i]]))
                    yield (f"engine_receive_{i}" if not partial
                           else f"engine_wakes_partly_{i}"), s.freeze()

            def step(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                if not (not w[EXITED[i]] and w[ENG[i]] == E_RUNNING
                        and len(w[OUTQ[i]]) < OUT_CAP):
                    return
                mine = [r for r in range(REQS) if owns(w, r, i) and w[EREQ[r]] == R_WAITING]
                if not mine:
                    return
                r = mine[0]  # first come, first served
                s = _Step(self, w)
                s.fire(EREQ[r], self.t_ereq, RE.SCHEDULE)
                s.fire(EREQ[r], self.t_ereq, RE.STOP)
                s.w[OUTQ[i]] = (*s.w[OUTQ[i]], frame(O_FIN, r, s.w[GEN[i]]))
                if not any(owns(s.w, q, i) and s.w[EREQ[q]] in R_LIVE for q in range(REQS)):
                    s.fire(ENG[i], self.t_engine, EE.ALL_FINISHED)
                yield f"engine_finish_{i}", s.freeze()

            add("engine", f"engine_start_{i}", start)
            add("engine", f"engine_receive_{i}", receive)
            add("engine", f"engine_finish_{i}", step)

        # -- faults --------------------------------------------------------------------------
        def faults(w: World) -> Iterator[tuple[str, World]]:
            if not (w[STARTED] and w[FAULTS_LEFT] and not w[CLOSING]):
                return
            s = _Step(self, w)
            s.w[FAULTS_LEFT] = 0  # the run may stay fault-free from here on
            yield "no_more_faults", s.freeze()
            for i in range(N):
                if w[EXITED[i]]:
                    continue
                s = _Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                self._engine_exits(s, i)
                yield f"crash_silently_{i}", s.freeze()
                if w[ENG[i]] in E_LOOP:
                    s = _Step(self, w)
                    s.w[FAULTS_LEFT] -= 1
                    s.fire(ENG[i], self.t_engine, EE.FATAL_ERROR)
                    s.w[OUTQ[i]] = (*s.w[OUTQ[i]], frame(O_DEAD, 0, s.w[GEN[i]]))  # past the cap
                    self._engine_exits(s, i)
                    yield f"crash_with_sentinel_{i}", s.freeze()

        add("fault", "faults", faults)

        if bug == "removed_identity_reused":
            for i in range(N):
                def removed_sends(w: World, i: int = i) -> Iterator[tuple[str, World]]:
                    # The removed process, still running, announces itself under its identity
                    # on the index's channel, which a joiner now reads.
                    if w[ZOMBIE[i]] and w[MEM[i]] in M_LEFT and len(w[OUTQ[i]]) < OUT_CAP:
                        s = _Step(self, w)
                        s.w[OUTQ[i]] = (*s.w[OUTQ[i]],
                                        frame(O_HS, 0, s.w[ZOMBIE[i]] - 1) | FROM_REMOVED)
                        s.w[ZOMBIE[i]] = 0
                        yield f"removed_engine_sends_{i}", s.freeze()

                add("fault", f"removed_engine_sends_{i}", removed_sends)
        return tuple(acts)


def describe_world(world: World) -> dict[str, object]:
    """A readable view of a world (enum names instead of ints) for counterexamples."""
    enums: dict[str, type[Enum]] = {
        "client": ClientState, "creq": ClientRequestState, "ereq": EngineRequestState,
        "mem": MembershipState, "eng": EngineState, "scale": ScaleState,
    }
    out: dict[str, object] = {}
    for i, name in enumerate(FIELDS):
        v = world[i]
        base = name.rstrip("0123456789")
        if base in enums:
            v = list(enums[base])[v].name
        elif name == "util":
            v = "none" if v == NO_UTIL else list(UtilityState)[v].name
        elif name == "pcall":
            v = ("none", "sleep", "wake_up")[v]
        elif base in ("inq", "outq"):
            names = IN_MSGS if base == "inq" else OUT_MSGS
            v = [f"{names[(m & 7) - 1]}(slot {(m >> 3) & 1}, gen {gen_of(m)}"
                 f"{', from a removed process' if m & FROM_REMOVED else ''})" for m in v]
        out[name] = v
    return out
