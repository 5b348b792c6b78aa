"""The front-end model: two front ends over two engines, each engine serving both at once.

Theory of operation
-------------------
Rule 1: as in the other composed models, every component fires its events through the machine
tables of this package, and an event the tables forbid is a violation
(``fe_spec_conformance``); each engine runs one ``session`` lifecycle per channel
(``session.py``: the i-th channel is front end i's) and reads its named sets
(``SESSION_DROPS_INPUT``, ``SESSION_SERVED``) as the runtime does.
Rule 2: this model is about what several front ends add (issue 47), so everything one front
end already does is left to the other models: no hangs, corrupt frames, partial wake-ups,
cancels or timeouts, engine restarts or scaling here, and a first attach neither (both front
ends start attached to both engines, READY). It is bounded: ``F`` front ends x ``N`` engines,
one request id per front end (``"r1"``: the same id from both front ends is two requests),
one utility call in all, ``BUDGET`` owner calls in all, ``FAULTS`` fault per run (a front
end's death, with the one restart it allows, or an engine's death), channels of ``IN_CAP``
and ``OUT_CAP`` frames. These bounds are cut from "everything at once" (four owner calls and
one fault of each kind made well over two million worlds): with two owner calls and one
fault a run still holds a request from each front end, or a request and its abort, or a
request and the utility call, or a sleep and its wake-up, against a death or a restart,
and the explorer takes seconds. Only front end 0 makes power calls.

Each front end is a client (``CLIENT``) attached to both engines with its ``client_index``: it
starts with an ATTACH queued on each of its two channels, drops every frame on a channel
until that engine's marker for its own ATTACH (``ATTACH_DROPS_MESSAGES``), and is READY once
both markers are in. The marker carries the engine's power state, so a front end that
attaches to a sleeping engine knows it sleeps. An owner's request goes to either engine, its
abort follows it there; the one utility call goes to engine 0. Front end 0's owner may put
both engines to sleep and wake them up: each engine replies to the caller and sends the
same frame as a *notice* to every other session in ``SESSION_SERVED``, in its order; a
client follows every reply and notice per engine (``view``) and derives its own state from
the engines it has not seen die, as the data-parallel client does: in ``CLIENT_ASLEEP`` while
any is asleep (``SLEEP_ACKED``), awake once none is (``WAKE_ACKED``, fully), and only once
constructed (a notice to a constructing client is kept in its view).

An engine routes every output and reply to the session whose request or call it is, and
keeps request ids per session. A front end's process may die (its channels' queues go with
its connections); each engine then sees the loss (the heartbeat deadline, then the
connection lost: two signs, the second a loop in GONE) and makes that session GONE: its live
request ends in the engine (ABORT, no output) and its owed replies are dropped, nobody else's.
The dead front end may come back under the same index (a new *incarnation*): it attaches
again, before or after the engines saw the loss; the new ATTACH ends what the old session
still held, and the new client sees nothing of the old one's work. A misconfigured restart
claims the other index and is REFUSED at both engines (its constructor fails), disturbing
nobody. An engine may die (after its loop started); every front end sees it (its heartbeat or
monitor) and fails exactly its own request and call there; a front end constructing then
fails its construction.

Every frame carries ground truth no client reads: the front end and incarnation it is meant
for (bits 4 and 5), so the model can tell a frame that reached another front end, or a
predecessor's frame read by its successor (``fe_no_cross_delivery``). Negative controls
(``BUGS``) are one-line deviations, carried by the generated ``spec/enginewire_fe.pml`` under
``#ifdef BUG_<NAME>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

from ._compose_world import Action, ComposedModel, StepBase, Table, ix
from .client import (
    CLIENT,
    CLIENT_ASLEEP,
    CLIENT_LIVE,
    FULLY_AWAKE,
    ClientEvent,
    ClientState,
)
from .engine import ENGINE, IN_LOOP, EngineEvent, EngineState
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
from .session import (
    SESSION,
    SESSION_DROPS_INPUT,
    SESSION_SERVED,
    SessionEvent,
    SessionState,
)
from .utility import UTILITY, UtilityEvent, UtilityState

__all__ = [
    "BUGS",
    "COVERS",
    "FIELDS",
    "UNEXERCISED",
    "FEComposition",
    "World",
    "describe_world",
]

# ---- bounds --------------------------------------------------------------------------------
F = 2  # front ends
N = 2  # engines
BUDGET = 2  # owner calls, all front ends together
FAULTS = 1  # a front end's death (and the restart it allows) or an engine's death
IN_CAP = 2
OUT_CAP = 2
POWER_FE = 0  # the front end whose owner makes power calls

# ---- frames: kind in the low 4 bits; ground truth: front end (bit 4), incarnation (bit 5);
# bit 6: a marker's "engine asleep", an ATTACH's claimed index, a finish's "aborted" ---------
IN_MSGS = ("ATTACH", "ADD", "ABORT", "UTIL", "SLEEP", "WAKE")
OUT_MSGS = ("MARKER", "REFUSAL", "FIN", "UREPLY", "SLEPT", "WOKE")
I_ATTACH, I_ADD, I_ABORT, I_UTIL, I_SLEEP, I_WAKE = range(1, len(IN_MSGS) + 1)
O_MARKER, O_REFUSAL, O_FIN, O_UREPLY, O_SLEPT, O_WOKE = range(1, len(OUT_MSGS) + 1)
P_NONE, P_SLEEP, P_WAKE = 0, 1, 2


def frame(kind: int, fe: int, inc: int, x: int = 0) -> int:
    return kind | fe << 4 | inc << 5 | x << 6


def unframe(msg: int) -> tuple[int, int, int, int]:
    """``(kind, front end, incarnation, extra bit)``."""
    return msg & 15, (msg >> 4) & 1, (msg >> 5) & 1, (msg >> 6) & 1


# ---- world layout (a channel c = f * N + i joins front end f and engine i) -------------------
_GLOBAL = ("budget", "faults", "util", "ucall", "pcall", "pmask")
_PER_FE = ("client", "fgen", "fdead", "creq", "own")
_PER_CH = ("inq", "outq", "sess", "sgen", "signs", "ereq", "egen", "marked", "view", "knows")
_PER_ENGINE = ("eng", "exited", "asleep")
FIELDS: tuple[str, ...] = (
    *_GLOBAL,
    *(f"{name}{f}" for name in _PER_FE for f in range(F)),
    *(f"{name}{f}{i}" for name in _PER_CH for f in range(F) for i in range(N)),
    *(f"{name}{i}" for name in _PER_ENGINE for i in range(N)),
    "bad",
)
_AT = {name: k for k, name in enumerate(FIELDS)}
BUDGET_LEFT, FAULTS_LEFT, UTIL, UCALL, PCALL, PMASK = (_AT[n] for n in _GLOBAL)
C, FGEN, FDEAD, CREQ, OWN = (tuple(_AT[f"{n}{f}"] for f in range(F)) for n in _PER_FE)
INQ, OUTQ, SESS, SGEN, SIGNS, EREQ, EGEN, MARKED, VIEW, KNOWS = (
    tuple(_AT[f"{n}{f}{i}"] for f in range(F) for i in range(N)) for n in _PER_CH)
ENG, EXITED, ASLEEP = (tuple(_AT[f"{n}{i}"] for i in range(N)) for n in _PER_ENGINE)
BAD = _AT["bad"]
# fgen: the front end's incarnation (1 after its restart); fdead: its process is dead (not yet
# restarted); creq/own: its request and the engine it went to. Per channel, engine side: sess
# (the session), sgen (the incarnation whose ATTACH it took), signs (signs of a loss seen),
# ereq/egen (the session's request in that engine and the incarnation that sent it); client
# side: marked (its marker read), view (the engine sleeps, as the client knows), knows (the
# client saw that engine die). util/ucall: the one utility call and its caller; pcall/pmask:
# front end 0's power call and the engines still owing its reply (a bit each).
NO_UTIL, UTIL_GONE = -1, -2  # no call made yet; its caller died with it pending
World = tuple[Any, ...]


def ch(f: int, i: int) -> int:
    return f * N + i


BUGS = (
    "outputs_to_front_end_0",
    "ids_not_scoped",
    "dead_work_left_running",
    "death_ends_every_front_end",
    "power_notice_not_sent",
    "notice_before_ready",
    "dead_channel_read",
    "death_seen_by_one",
)

# Every SESSION row involving a front end's loss is this model's to exercise; the rest are the
# one-engine model's (compose.py), which covers SESSION too.
COVERS = (SESSION,)
_ONE_ENGINE = ("the one-engine model's (compose.py): frame integrity and a first attach"
               " refused are not modelled here")
_MISPLACED_BY_TESTS = ("not reached here (every channel starts attached, no integrity failure):"
                       " tested in tests/runtime/test_front_ends.py")
UNEXERCISED: dict[tuple[str, str], str] = {
    **{("session", row): _MISPLACED_BY_TESTS for row in (
        "NO_FRONT_END --ATTACH_MISPLACED--> REFUSED",
        "REFUSED --ATTACH_MISPLACED--> REFUSED",
        "ENDED --ATTACH_MISPLACED--> ENDED",
    )},
    ("session", "GONE --ATTACH_REFUSED--> REFUSED"):
        "frame integrity is not modelled here: tested in tests/runtime/test_front_ends.py",
    ("session", "ATTACHED --ATTACH_REFUSED--> REFUSED"): _ONE_ENGINE,
    **{("session", row): _ONE_ENGINE for row in (
        "NO_FRONT_END --ATTACH_REFUSED--> REFUSED",
        "REFUSED --ATTACH_ACCEPTED--> ATTACHED",
        "REFUSED --ATTACH_REFUSED--> REFUSED",
        "ENDED --ATTACH_ACCEPTED--> ATTACHED",
        "ENDED --ATTACH_REFUSED--> REFUSED",
        "ATTACHED --INTEGRITY_FAILED--> ENDED",
        "NO_FRONT_END --INTEGRITY_FAILED--> ENDED",
    )},
}

CS, CE = ClientState, ClientEvent
ES, EE = EngineState, EngineEvent
SS, SE = SessionState, SessionEvent
RS, RE = EngineRequestState, EngineRequestEvent
QS, QE = ClientRequestState, ClientRequestEvent
US, UE = UtilityState, UtilityEvent

C_CONSTRUCTING, C_DEAD, C_SHUTDOWN = ix(CS.CONSTRUCTING), ix(CS.DEAD), ix(CS.SHUTDOWN)
C_LIVE = frozenset(ix(s) for s in CLIENT_LIVE)
C_ASLEEP = frozenset(ix(s) for s in CLIENT_ASLEEP)
E_CONSTRUCTING, E_IDLE, E_RUNNING = ix(ES.CONSTRUCTING), ix(ES.IDLE), ix(ES.RUNNING)
E_LOOP = frozenset(ix(s) for s in IN_LOOP)
S_NONE, S_ATTACHED, S_REFUSED, S_GONE = (
    ix(SS.NO_FRONT_END), ix(SS.ATTACHED), ix(SS.REFUSED), ix(SS.GONE))
S_DROPS = frozenset(ix(s) for s in SESSION_DROPS_INPUT)
S_SERVED = frozenset(ix(s) for s in SESSION_SERVED)
R_WAITING = ix(RS.WAITING)
R_UNKNOWN = ix(RS.UNKNOWN)
R_LIVE = frozenset(ix(s) for s in ENGINE_REQUEST_LIVE)
Q_LIVE = frozenset(ix(s) for s in CLIENT_REQUEST_LIVE)
Q_FREE = frozenset(ix(s) for s in QS) - Q_LIVE
Q_ABORTABLE = frozenset({ix(QS.SENT), ix(QS.STREAMING)})
U_PENDING = ix(US.PENDING)


class _Step(StepBase):
    """A step of the front-end model (``StepBase``: the one-engine model's, shared)."""

    __slots__ = ()
    BAD_FIELD = BAD
    CONFORMANCE = "fe_spec_conformance"

    def push(self, q: int, msg: int) -> None:
        self.w[q] = (*self.w[q], msg)


def ereq_live(w: World | list[Any], f: int, i: int) -> bool:
    return w[EREQ[ch(f, i)]] in R_LIVE


def stale_work(w: World | list[Any], f: int, i: int) -> bool:
    """Engine ``i`` still holds a live request of a session of channel ``f`` that is over: the
    session is GONE, or another ATTACH (accepted or refused) replaced the one that sent it."""
    c = ch(f, i)
    if w[EREQ[c]] not in R_LIVE:
        return False
    return bool(w[SESS[c]] == S_GONE or w[SGEN[c]] != w[EGEN[c]])


class FEComposition(ComposedModel):
    """The front-end model; ``bug`` selects one negative control (``None``: the protocol)."""

    BUGS = BUGS
    BAD_FIELD = BAD
    TABLES = (("t_client", CLIENT), ("t_engine", ENGINE), ("t_session", SESSION),
              ("t_ereq", ENGINE_REQUEST), ("t_creq", CLIENT_REQUEST), ("t_util", UTILITY))
    t_client: Table
    t_engine: Table
    t_session: Table
    t_ereq: Table
    t_creq: Table
    t_util: Table

    def initial(self) -> World:
        """Both engines serving and both front ends attached (READY): a first attach is the
        one-engine model's; what this model adds starts from here."""
        w: list[Any] = [0] * len(FIELDS)
        w[BUDGET_LEFT], w[FAULTS_LEFT] = BUDGET, FAULTS
        w[UTIL] = NO_UTIL
        for f in range(F):
            w[C[f]] = C_CONSTRUCTING
            w[CREQ[f]] = ix(QS.UNKNOWN)
            for i in range(N):
                c = ch(f, i)
                w[INQ[c]] = w[OUTQ[c]] = ()
                w[SESS[c]] = S_NONE
                w[EREQ[c]] = R_UNKNOWN
                w[MARKED[c]] = 1
        for i in range(N):
            w[ENG[i]] = E_CONSTRUCTING
        w[BAD] = ""
        s = _Step(self, tuple(w))
        for i in range(N):
            s.fire(ENG[i], self.t_engine, EE.BUILT, "subprocess")
            s.fire(ENG[i], self.t_engine, EE.HANDSHAKE_SENT)
            s.fire(ENG[i], self.t_engine, EE.LOOP_STARTED)
            for f in range(F):
                s.fire(SESS[ch(f, i)], self.t_session, SE.ATTACH_ACCEPTED)
        for f in range(F):
            s.fire(C[f], self.t_client, CE.HANDSHAKE_OK)
        return s.freeze()

    # ---- the engine side ---------------------------------------------------------------------
    def _route(self, w: World | list[Any], i: int, f: int, *, request: bool = False) -> int:
        """The channel engine ``i`` sends session ``f``'s outputs (``request``) and replies
        on."""
        if self.bug == "outputs_to_front_end_0":
            return 0  # vLLM #27711's shape: the client_index is not read
        if self.bug == "ids_not_scoped" and request:  # "r1" names the first session that sent it
            return next(g for g in range(F) if g == f or w[EREQ[ch(g, i)]] in R_LIVE)
        return f

    def _send(self, s: _Step, i: int, f: int, kind: int, inc: int, x: int = 0) -> None:
        """Engine ``i`` sends session ``f``'s output or reply: only to a served session."""
        t = ch(self._route(s.w, i, f, request=kind == O_FIN), i)
        if s.w[SESS[t]] in S_SERVED:
            s.push(OUTQ[t], frame(kind, f, inc, x))

    def _settle(self, s: _Step, i: int) -> None:
        if s.w[ENG[i]] == E_RUNNING and not any(ereq_live(s.w, g, i) for g in range(F)):
            s.fire(ENG[i], self.t_engine, EE.ALL_FINISHED)

    def _end_work(self, s: _Step, i: int, f: int) -> None:
        """Session ``f``'s work in engine ``i`` ends: its request aborted, no output (and its
        owed replies dropped: here every reply is sent when its call is read)."""
        if self.bug == "dead_work_left_running":
            return
        for g in range(F):
            if g != f and self.bug != "death_ends_every_front_end":
                continue
            if ereq_live(s.w, g, i):
                if g != f:
                    s.flag("fe_death_ends_own")  # another front end's request ended by this loss
                s.fire(EREQ[ch(g, i)], self.t_ereq, RE.ABORT)
        self._settle(s, i)

    def _power(self, s: _Step, i: int, f: int, kind: int, inc: int) -> None:
        """A sleep or wake-up: the reply to the caller, a notice to every other served
        session."""
        s.w[ASLEEP[i]] = int(kind == O_SLEPT)
        self._send(s, i, f, kind, inc)
        if self.bug == "power_notice_not_sent":
            return
        for g in range(F):
            c = ch(g, i)
            if g != f and s.w[SESS[c]] in S_SERVED:
                s.push(OUTQ[c], frame(kind, g, s.w[SGEN[c]]))

    # ---- the client side ---------------------------------------------------------------------
    def _derive_power(self, s: _Step, f: int) -> None:
        """The client's state from its engines' (those it has not seen die): asleep while
        any is, awake once none is; only a constructed client moves."""
        if s.w[C[f]] not in C_LIVE:
            return
        asleep = any(s.w[VIEW[ch(f, i)]] and not s.w[KNOWS[ch(f, i)]] for i in range(N))
        if asleep and s.w[C[f]] not in C_ASLEEP:
            s.fire(C[f], self.t_client, CE.SLEEP_ACKED)
        elif not asleep and s.w[C[f]] in C_ASLEEP:
            s.fire(C[f], self.t_client, CE.WAKE_ACKED, FULLY_AWAKE)

    def _power_settled(self, s: _Step, f: int, i: int) -> None:
        if f == POWER_FE and s.w[PMASK] & (1 << i):
            s.w[PMASK] &= ~(1 << i)
            if not s.w[PMASK]:
                s.w[PCALL] = P_NONE

    def _read(self, s: _Step, f: int, i: int, msg: int) -> None:
        c = ch(f, i)
        kind, fe, inc, x = unframe(msg)
        mine = fe == f and inc == s.w[FGEN[f]]
        if not s.w[MARKED[c]]:  # before its marker: everything but its own answer is dropped
            if mine and kind == O_MARKER:
                s.w[MARKED[c]], s.w[VIEW[c]] = 1, x
                if s.w[C[f]] == C_CONSTRUCTING and all(s.w[MARKED[ch(f, j)]] for j in range(N)):
                    s.fire(C[f], self.t_client, CE.HANDSHAKE_OK)
                self._derive_power(s, f)
            elif mine and kind == O_REFUSAL and s.w[C[f]] == C_CONSTRUCTING:
                s.fire(C[f], self.t_client, CE.CONSTRUCTION_FAILED)  # refused: a clear error
            return
        if not mine:
            s.flag("fe_no_cross_delivery")
        elif kind == O_FIN:
            if s.w[CREQ[f]] in Q_LIVE and s.w[OWN[f]] == i:
                s.fire(CREQ[f], self.t_creq, QE.FINISH_ABORT if x else QE.FINISH_STOP)
            else:
                s.flag("fe_request_ends_once")
        elif kind == O_UREPLY:
            if s.w[UTIL] == U_PENDING and s.w[UCALL] == f:
                s.fire(UTIL, self.t_util, UE.REPLY_OK)
            else:
                s.flag("fe_request_ends_once")
        elif kind in (O_SLEPT, O_WOKE):  # a reply to its own call, or a notice
            s.w[VIEW[c]] = int(kind == O_SLEPT)
            self._power_settled(s, f, i)
            if self.bug == "notice_before_ready":  # the notice fires its event at once
                if kind == O_SLEPT:
                    s.fire(C[f], self.t_client, CE.SLEEP_ACKED)
                else:
                    s.fire(C[f], self.t_client, CE.WAKE_ACKED, FULLY_AWAKE)
            self._derive_power(s, f)

    # ---- actions -----------------------------------------------------------------------------
    def _actions(self) -> tuple[Action, ...]:
        bug = self.bug
        acts: list[Action] = []

        def add(actor: str, name: str, fn: Callable[[World], Iterator[tuple[str, World]]]
                ) -> None:
            acts.append(Action(actor, name, fn))

        def may_call(w: World, f: int) -> bool:
            return bool(w[BUDGET_LEFT] > 0 and not w[FDEAD[f]] and w[C[f]] in C_LIVE)

        def room(w: World, f: int, i: int) -> bool:
            return not w[KNOWS[ch(f, i)]] and len(w[INQ[ch(f, i)]]) < IN_CAP

        # -- each front end's owner ------------------------------------------------------------
        for f in range(F):
            for i in range(N):
                def add_request(w: World, f: int = f, i: int = i) -> Iterator[tuple[str, World]]:
                    if may_call(w, f) and w[CREQ[f]] in Q_FREE and room(w, f, i):
                        s = _Step(self, w)
                        s.w[BUDGET_LEFT] -= 1
                        s.fire(C[f], self.t_client, CE.ADD_REQUEST)
                        s.fire(CREQ[f], self.t_creq, QE.SEND)
                        s.w[OWN[f]] = i
                        s.push(INQ[ch(f, i)], frame(I_ADD, f, s.w[FGEN[f]]))
                        yield f"add_request_{f}{i}", s.freeze()

                add("user", f"add_request_{f}{i}", add_request)

            def abort(w: World, f: int = f) -> Iterator[tuple[str, World]]:
                if may_call(w, f) and w[CREQ[f]] in Q_ABORTABLE and room(w, f, w[OWN[f]]):
                    s = _Step(self, w)
                    s.w[BUDGET_LEFT] -= 1
                    s.fire(CREQ[f], self.t_creq, QE.ABORT_SENT)
                    s.push(INQ[ch(f, w[OWN[f]])], frame(I_ABORT, f, s.w[FGEN[f]]))
                    yield f"abort_request_{f}", s.freeze()

            def call_utility(w: World, f: int = f) -> Iterator[tuple[str, World]]:
                if may_call(w, f) and w[UTIL] == NO_UTIL and room(w, f, 0):
                    s = _Step(self, w)
                    s.w[BUDGET_LEFT] -= 1
                    s.w[UTIL], s.w[UCALL] = U_PENDING, f
                    s.push(INQ[ch(f, 0)], frame(I_UTIL, f, s.w[FGEN[f]]))
                    yield f"call_utility_{f}", s.freeze()

            add("user", f"abort_request_{f}", abort)
            add("user", f"call_utility_{f}", call_utility)

        def power_call(w: World, f: int = POWER_FE) -> Iterator[tuple[str, World]]:
            if not (may_call(w, f) and w[PCALL] == P_NONE):
                return
            targets = [i for i in range(N) if not w[KNOWS[ch(f, i)]]]
            if not targets or not all(room(w, f, i) for i in targets):
                return
            asleep = w[C[f]] in C_ASLEEP
            s = _Step(self, w)
            s.w[BUDGET_LEFT] -= 1
            s.w[PCALL] = P_WAKE if asleep else P_SLEEP
            for i in targets:
                s.w[PMASK] |= 1 << i
                s.push(INQ[ch(f, i)], frame(I_WAKE if asleep else I_SLEEP, f, s.w[FGEN[f]]))
            yield ("wake_up" if asleep else "sleep"), s.freeze()

        add("user", "power_call", power_call)

        # -- each front end's readers and its view of the engines' deaths ---------------------
        for f in range(F):
            for i in range(N):
                c = ch(f, i)

                def reader(w: World, f: int = f, i: int = i, c: int = c
                           ) -> Iterator[tuple[str, World]]:
                    if not (w[OUTQ[c]] and not w[FDEAD[f]]
                            and w[C[f]] not in (C_DEAD, C_SHUTDOWN)
                            and (not w[KNOWS[c]] or bug == "dead_channel_read")):
                        return
                    s = _Step(self, w)
                    msg, s.w[OUTQ[c]] = s.w[OUTQ[c]][0], s.w[OUTQ[c]][1:]
                    self._read(s, f, i, msg)
                    yield f"receive_output_{f}{i}", s.freeze()

                def death_noticed(w: World, f: int = f, i: int = i, c: int = c
                                  ) -> Iterator[tuple[str, World]]:
                    if not (w[EXITED[i]] and not w[KNOWS[c]] and not w[FDEAD[f]]
                            and w[C[f]] not in (C_DEAD, C_SHUTDOWN)):
                        return
                    if bug == "death_seen_by_one" and f != 0:
                        return
                    s = _Step(self, w)
                    s.w[KNOWS[c]] = 1
                    if s.w[C[f]] == C_CONSTRUCTING:  # an engine it attaches to is gone
                        s.fire(C[f], self.t_client, CE.CONSTRUCTION_FAILED)
                    else:  # exactly its own request and call on that engine fail
                        if s.w[CREQ[f]] in Q_LIVE and s.w[OWN[f]] == i:
                            s.fire(CREQ[f], self.t_creq, QE.ENGINE_DIED)
                        if s.w[UTIL] == U_PENDING and s.w[UCALL] == f and i == 0:
                            s.fire(UTIL, self.t_util, UE.ENGINE_DIED)
                        self._power_settled(s, f, i)
                    if bug != "dead_channel_read":
                        s.w[OUTQ[c]] = ()  # the channel is closed
                    s.w[VIEW[c]] = 0
                    self._derive_power(s, f)
                    yield f"engine_death_noticed_{f}{i}", s.freeze()

                add("client", f"receive_output_{f}{i}", reader)
                add("monitor", f"engine_death_noticed_{f}{i}", death_noticed)

        # -- the engines -----------------------------------------------------------------------
        for i in range(N):
            for f in range(F):
                c = ch(f, i)

                def receive(w: World, f: int = f, i: int = i, c: int = c
                            ) -> Iterator[tuple[str, World]]:
                    if not (w[INQ[c]] and not w[EXITED[i]] and w[ENG[i]] in E_LOOP
                            and len(w[OUTQ[c]]) < OUT_CAP):
                        return
                    s = _Step(self, w)
                    msg, s.w[INQ[c]] = s.w[INQ[c]][0], s.w[INQ[c]][1:]
                    kind, _fe, inc, x = unframe(msg)
                    if kind == I_ATTACH and x != f:
                        # A client_index that is not this channel's: refused, and the
                        # served session (if any) keeps its work and its deadline.
                        s.fire(SESS[c], self.t_session, SE.ATTACH_MISPLACED)
                        s.push(OUTQ[c], frame(O_REFUSAL, f, inc))
                    elif kind == I_ATTACH:
                        if s.w[SESS[c]] == S_ATTACHED:  # the previous session's work ends
                            self._end_work(s, i, f)
                        s.w[SGEN[c]], s.w[SIGNS[c]] = inc, 0
                        s.fire(SESS[c], self.t_session, SE.ATTACH_ACCEPTED)
                        s.push(OUTQ[c], frame(O_MARKER, f, inc, s.w[ASLEEP[i]]))
                    elif s.w[SESS[c]] in S_DROPS or s.w[SESS[c]] == S_NONE:
                        pass  # dropped unread
                    elif kind == I_ADD:
                        s.fire(EREQ[c], self.t_ereq, RE.ADD)
                        s.w[EGEN[c]] = s.w[SGEN[c]]
                        if s.w[ENG[i]] == E_IDLE:
                            s.fire(ENG[i], self.t_engine, EE.WORK_ARRIVED)
                    elif kind == I_ABORT:
                        live = ereq_live(s.w, f, i)
                        s.fire(EREQ[c], self.t_ereq, RE.ABORT)  # unknown or finished: a no-op
                        if live:
                            self._send(s, i, f, O_FIN, s.w[EGEN[c]], 1)
                            self._settle(s, i)
                    elif kind == I_UTIL:
                        self._send(s, i, f, O_UREPLY, s.w[SGEN[c]])
                    else:  # I_SLEEP, I_WAKE: engine-wide
                        self._power(s, i, f, O_SLEPT if kind == I_SLEEP else O_WOKE,
                                    s.w[SGEN[c]])
                    yield f"engine_receive_{f}{i}", s.freeze()

                def finish(w: World, f: int = f, i: int = i, c: int = c
                           ) -> Iterator[tuple[str, World]]:
                    if not (w[EREQ[c]] == R_WAITING and w[ENG[i]] == E_RUNNING
                            and not w[EXITED[i]] and not w[ASLEEP[i]]):
                        return
                    # The output goes to a served session (room on its channel) or is dropped:
                    # a front end that is gone or refused never holds the engine up.
                    t = self._route(w, i, f, request=True)  # looked up while the request is live
                    if w[SESS[ch(t, i)]] in S_SERVED and len(w[OUTQ[ch(t, i)]]) >= OUT_CAP:
                        return
                    s = _Step(self, w)
                    s.fire(EREQ[c], self.t_ereq, RE.SCHEDULE)
                    s.fire(EREQ[c], self.t_ereq, RE.STOP)
                    if s.w[SESS[ch(t, i)]] in S_SERVED:
                        s.push(OUTQ[ch(t, i)], frame(O_FIN, f, s.w[EGEN[c]]))
                    self._settle(s, i)
                    yield f"engine_finish_{f}{i}", s.freeze()

                def lost(w: World, f: int = f, i: int = i, c: int = c
                         ) -> Iterator[tuple[str, World]]:
                    # The heartbeat deadline (ATTACHED -> GONE), then the connection lost
                    # past its bound (GONE -> GONE): two signs of one loss. The session's
                    # front end is lost when its process is dead or was restarted since
                    # (its successor's ATTACH not read yet, or refused as misplaced).
                    if not ((w[FDEAD[f]] or w[SGEN[c]] != w[FGEN[f]])
                            and not w[EXITED[i]] and w[ENG[i]] in E_LOOP and (
                            (w[SESS[c]] == S_ATTACHED and w[SIGNS[c]] == 0)
                            or (w[SESS[c]] == S_GONE and w[SIGNS[c]] == 1))):
                        return
                    s = _Step(self, w)
                    before = s.w[SESS[c]]
                    s.fire(SESS[c], self.t_session, SE.FRONT_END_GONE)
                    s.w[SIGNS[c]] += 1
                    if before == S_ATTACHED:
                        self._end_work(s, i, f)
                    yield f"front_end_lost_{f}{i}", s.freeze()

                add("engine", f"engine_receive_{f}{i}", receive)
                add("engine", f"engine_finish_{f}{i}", finish)
                add("engine", f"front_end_lost_{f}{i}", lost)

        # -- faults: a front end's death (and its restart), an engine's death ------------------
        def faults(w: World) -> Iterator[tuple[str, World]]:
            if not w[FAULTS_LEFT]:
                return
            s = _Step(self, w)
            s.w[FAULTS_LEFT] = 0  # the run may stay fault-free from here on
            yield "no_more_faults", s.freeze()
            for f in range(F):
                if not w[FDEAD[f]] and w[C[f]] != C_SHUTDOWN:
                    s = _Step(self, w)
                    s.w[FAULTS_LEFT] -= 1
                    s.w[FDEAD[f]] = 1
                    for i in range(N):
                        s.w[OUTQ[ch(f, i)]] = ()  # its connections go with it
                    if f == POWER_FE:
                        s.w[PCALL] = s.w[PMASK] = 0
                    if s.w[UTIL] == U_PENDING and s.w[UCALL] == f:
                        s.w[UTIL] = UTIL_GONE
                    yield f"front_end_dies_{f}", s.freeze()
            for i in range(N):
                if not w[EXITED[i]] and w[ENG[i]] in E_LOOP:
                    s = _Step(self, w)
                    s.w[FAULTS_LEFT] -= 1
                    s.fire(ENG[i], self.t_engine, EE.FATAL_ERROR)
                    s.w[EXITED[i]] = 1
                    s.w[ASLEEP[i]] = 0
                    for g in range(F):
                        s.w[EREQ[ch(g, i)]] = R_UNKNOWN  # gone with the process
                        s.w[INQ[ch(g, i)]] = ()
                    yield f"engine_dies_{i}", s.freeze()

        add("fault", "faults", faults)

        for f in range(F):
            def restart(w: World, f: int = f) -> Iterator[tuple[str, World]]:
                if not w[FDEAD[f]]:
                    return
                for index, label in ((f, f"front_end_restarts_{f}"),
                                     (1 - f, f"front_end_restarts_misindexed_{f}")):
                    s = _Step(self, w)
                    s.w[FDEAD[f]] = 0
                    s.w[FGEN[f]] = 1
                    s.w[C[f]] = C_CONSTRUCTING  # a new process: a new client lifecycle
                    s.w[CREQ[f]] = ix(QS.UNKNOWN)
                    s.w[OWN[f]] = 0
                    for i in range(N):
                        c = ch(f, i)
                        s.w[MARKED[c]] = s.w[VIEW[c]] = s.w[KNOWS[c]] = 0
                        s.push(INQ[c], frame(I_ATTACH, f, 1, index))
                    yield label, s.freeze()

            add("fault", f"front_end_restarts_{f}", restart)
        return tuple(acts)


def describe_world(world: World) -> dict[str, object]:
    """A readable view of a world (enum names instead of ints) for counterexamples."""
    enums: dict[str, type[Enum]] = {
        "client": ClientState, "creq": ClientRequestState, "ereq": EngineRequestState,
        "eng": EngineState, "sess": SessionState,
    }
    out: dict[str, object] = {}
    for k, name in enumerate(FIELDS):
        v = world[k]
        base = name.rstrip("0123456789")
        if base in enums:
            v = list(enums[base])[v].name
        elif name == "util":
            v = {NO_UTIL: "none", UTIL_GONE: "gone with its caller"}.get(v) or (
                list(UtilityState)[v].name)
        elif name == "pcall":
            v = ("none", "sleep", "wake_up")[v]
        elif base in ("inq", "outq"):
            names = IN_MSGS if base == "inq" else OUT_MSGS
            v = [f"{names[unframe(m)[0] - 1]}(front end {unframe(m)[1]},"
                 f" incarnation {unframe(m)[2]}{', x' if unframe(m)[3] else ''})" for m in v]
        out[name] = v
    return out
