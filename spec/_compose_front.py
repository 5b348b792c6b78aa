"""The composed model's front-end actions: the owner (``user``), the client's own threads
(``client``) and its process monitor (``monitor``), with the death notice they share.

Methods of a mixin of ``compose.Composition``; ``compose.py`` orders them into the model's
action table. Each takes a world and yields ``(label, next world)`` for every move it allows.
"""

from __future__ import annotations

from collections.abc import Iterator

from ._compose_world import (
    A_DROPS,
    AE,
    ASKED_AWAKE,
    ATT,
    BUDGET_LEFT,
    C_CONSTRUCTING,
    C_DEAD,
    C_LIVE,
    C_SHUTDOWN,
    CE,
    CLOSING,
    CREQ,
    FIN_EVENT,
    HUNG,
    I_ABORT,
    I_ADD,
    I_ATTACH,
    I_SHUTDOWN,
    I_UTIL,
    I_WAKE_ALL,
    IN_CAP,
    INQ,
    LEFT,
    MONITOR_SEEN,
    NO_UTIL,
    O_DEAD,
    O_HS,
    O_MARKER,
    O_POWER_REPLIES,
    O_SESSION_END,
    O_SLEPT,
    O_STALE,
    O_TOK,
    O_UREPLY_ERR,
    O_UREPLY_OK,
    O_WOKE_FULL,
    O_WOKE_PART,
    OUTQ,
    PARENT_DEAD,
    POWER_CALLS,
    POWER_PENDING,
    PROC_EXITED,
    Q_ABORTABLE,
    Q_FREE,
    Q_LIVE,
    QE,
    SENT,
    SLEEP_CALLS,
    STANDALONE,
    U_LATE_OK,
    U_PENDING,
    UE,
    UTIL,
    UTIL_ENDS,
    C,
    Model,
    Step,
    World,
)
from .utility import UtilityEvent


class FrontEndActions(Model):
    def _on_death(self, s: Step) -> None:
        """The client learns the engine is dead: every pending and live thing fails now."""
        s.fire(C, self.t_client, CE.ENGINE_DIED)
        if s.w[UTIL] == U_PENDING and self.bug != "forget_pending_on_death":
            s.fire(UTIL, self.t_util, UE.ENGINE_DIED)
            s.w[UTIL_ENDS] += 1
        if s.w[CREQ] in Q_LIVE:  # an id that is not live has nothing to fail
            s.fire(CREQ, self.t_creq, QE.ENGINE_DIED)
        s.w[POWER_PENDING] = 0  # pending sleep/wake calls fail with EngineDeadError

    def _owner_may_call(self, w: World) -> bool:
        return bool(not w[PARENT_DEAD] and not w[CLOSING] and w[BUDGET_LEFT] > 0)

    def _user_send(
        self, w: World, msg: int, label: str, *, request_frame: bool = False
    ) -> Iterator[tuple[str, World]]:
        if self._owner_may_call(w) and w[C] in C_LIVE and len(w[INQ]) < IN_CAP:
            s = Step(self, w)
            s.w[BUDGET_LEFT] -= 1
            if request_frame:
                msg |= s.w[SENT] << 4
                s.w[SENT] += 1
            elif msg in POWER_CALLS:
                s.w[POWER_PENDING] += 1
                if msg in SLEEP_CALLS:
                    s.w[ASKED_AWAKE] = 0
                elif msg == I_WAKE_ALL:
                    s.w[ASKED_AWAKE] = 1
            s.push_in(msg)
            yield label, s.freeze()

    # -- the owner (user) ---------------------------------------------------------------
    def _add(self, w: World) -> Iterator[tuple[str, World]]:
        ok_state = w[C] in C_LIVE or (self.bug == "add_before_ready" and w[C] == C_CONSTRUCTING)
        if self._owner_may_call(w) and ok_state and w[CREQ] in Q_FREE and len(w[INQ]) < IN_CAP:
            s = Step(self, w)
            s.w[BUDGET_LEFT] -= 1
            s.fire(C, self.t_client, CE.ADD_REQUEST)
            s.fire(CREQ, self.t_creq, QE.SEND)
            s.push_in(I_ADD | s.w[SENT] << 4)
            s.w[SENT] += 1
            yield "add_request", s.freeze()

    def _abort(self, w: World) -> Iterator[tuple[str, World]]:
        if w[CREQ] in Q_ABORTABLE:
            for label, nw in self._user_send(w, I_ABORT, "abort_request", request_frame=True):
                s = Step(self, nw)
                s.fire(CREQ, self.t_creq, QE.ABORT_SENT)
                yield label, s.freeze()

    def _util(self, w: World) -> Iterator[tuple[str, World]]:
        if not self._owner_may_call(w) or w[UTIL] != NO_UTIL:
            return
        if w[C] == C_DEAD:  # fails at once with EngineDeadError
            s = Step(self, w)
            s.w[BUDGET_LEFT] -= 1
            s.w[UTIL] = U_PENDING
            s.fire(UTIL, self.t_util, UE.ENGINE_DIED)
            s.w[UTIL_ENDS] += 1
            yield "call_utility", s.freeze()
            return
        for label, nw in self._user_send(w, I_UTIL, "call_utility"):
            s = Step(self, nw)
            s.w[UTIL] = U_PENDING
            yield label, s.freeze()

    def _end_call(self, w: World, ev: UtilityEvent, label: str) -> Iterator[tuple[str, World]]:
        """The owner stops waiting on its call: cancelled, or its timeout ran out."""
        if self._owner_may_call(w) and w[UTIL] == U_PENDING:
            s = Step(self, w)
            s.w[BUDGET_LEFT] -= 1
            s.fire(UTIL, self.t_util, ev)
            s.w[UTIL_ENDS] += 1
            yield label, s.freeze()

    def _power_call(self, w: World, msg: int, label: str) -> Iterator[tuple[str, World]]:
        yield from self._user_send(w, msg, label)


    def _shutdown(self, w: World) -> Iterator[tuple[str, World]]:
        if self._owner_may_call(w) and (w[C] in C_LIVE or w[C] == C_DEAD):
            s = Step(self, w)
            s.w[BUDGET_LEFT] -= 1
            s.w[CLOSING] = 1
            if s.w[STANDALONE]:
                # The engine outlives this client: abort what it still runs for it (a
                # dead client sends nothing). Past IN_CAP: the last frame, sent once.
                if w[C] in C_LIVE and s.w[CREQ] in Q_LIVE:
                    s.w[LEFT] = 1
                    if self.bug != "shutdown_leaves_work":
                        s.push_in(I_ABORT | s.w[SENT] << 4)
                        s.w[SENT] += 1
                        s.fire(CREQ, self.t_creq, QE.ABORT_SENT)
            elif not s.w[PROC_EXITED] and len(s.w[INQ]) < IN_CAP:
                s.push_in(I_SHUTDOWN)
            yield "shutdown", s.freeze()

    # -- the client's own threads ----------------------------------------------------------
    def _kill(self, w: World) -> Iterator[tuple[str, World]]:
        # The grace period ran out: terminate, then kill, the engine process.
        if (self.bug != "shutdown_no_kill" and w[CLOSING] and not w[PROC_EXITED]
                and not w[PARENT_DEAD] and not w[STANDALONE]):
            s = Step(self, w)
            s.w[PROC_EXITED] = 1
            yield "shutdown_kill", s.freeze()

    def _finish(self, w: World) -> Iterator[tuple[str, World]]:
        joined = w[PROC_EXITED] or w[STANDALONE] or self.bug == "shutdown_skips_join"
        if w[CLOSING] and joined and w[C] != C_SHUTDOWN and not w[PARENT_DEAD]:
            s = Step(self, w)
            s.fire(C, self.t_client, CE.SHUTDOWN)
            if s.w[UTIL] == U_PENDING:
                s.fire(UTIL, self.t_util, UE.CLIENT_SHUTDOWN)
                s.w[UTIL_ENDS] += 1
            if s.w[CREQ] in Q_LIVE:
                s.fire(CREQ, self.t_creq, QE.FINISH_ERROR)
            s.w[POWER_PENDING] = 0  # pending power calls end with ClientClosedError
            yield "shutdown_finish", s.freeze()

    def _deadline(self, w: World) -> Iterator[tuple[str, World]]:
        # ready_timeout_s: a timer, not a fault, so it also ends a hung construction.
        if w[C] == C_CONSTRUCTING and not w[PARENT_DEAD] and self.bug != "no_startup_deadline":
            s = Step(self, w)
            s.fire(C, self.t_client, CE.CONSTRUCTION_FAILED)
            if not s.w[STANDALONE]:
                s.w[PROC_EXITED] = 1  # the constructor kills and reaps its engine
            yield "handshake_deadline", s.freeze()

    def _attach_deadline(self, w: World) -> Iterator[tuple[str, World]]:
        # The marker is overdue (ready_timeout_s after the ATTACH): a timer, so a hung
        # engine or a lost ATTACH cannot leave the client waiting. Modelled as firing only
        # when the marker is not on its way (ATTACH queued or marker queued, engine not
        # hung): firing while it is in flight is a slow engine, which ends like any death.
        on_way = not w[HUNG] and (I_ATTACH in w[INQ] or O_MARKER in w[OUTQ])
        if (self.bug != "no_attach_deadline" and w[C] in C_LIVE and w[ATT] in A_DROPS
                and not on_way and not w[CLOSING] and not w[PARENT_DEAD]):
            s = Step(self, w)
            s.fire(ATT, self.t_attach, AE.DEADLINE)
            self._on_death(s)
            yield "attach_deadline", s.freeze()

    def _rx(self, w: World) -> Iterator[tuple[str, World]]:
        if not w[OUTQ] or w[PARENT_DEAD] or w[C] == C_DEAD:
            return
        if w[C] == C_SHUTDOWN:
            if w[STANDALONE]:  # no front end connected: the engine's outputs are dropped
                s = Step(self, w)
                s.w[OUTQ] = s.w[OUTQ][1:]
                yield "output_dropped", s.freeze()
            return
        s = Step(self, w)
        msg, s.w[OUTQ] = s.w[OUTQ][0], s.w[OUTQ][1:]
        if msg == O_HS:
            s.fire(C, self.t_client, CE.HANDSHAKE_OK)
            s.push_in(I_ATTACH)  # sent by the constructor, ahead of any owner call
            s.fire(ATT, self.t_attach, AE.SEND_ATTACH)
        elif (s.w[ATT] in A_DROPS and msg != O_DEAD
                and (msg == O_MARKER or self.bug != "reader_keeps_stale")):
            # Before its marker only the marker and the dead sentinel count; the rest
            # (a previous front end's outputs, an undecodable frame) is dropped unread.
            s.fire(ATT, self.t_attach, AE.MARKER if msg == O_MARKER else AE.FOREIGN_MESSAGE)
        elif msg == O_STALE:
            s.flag("no_foreign_output")
        elif msg == O_MARKER:
            s.flag("spec_conformance")  # one marker per session
        elif msg == O_TOK or msg in FIN_EVENT:
            if s.w[CREQ] not in Q_LIVE:
                s.flag("no_output_after_finish")
            elif msg == O_TOK:
                s.fire(CREQ, self.t_creq, QE.OUTPUT)
            else:
                s.fire(CREQ, self.t_creq, FIN_EVENT[msg])
        elif msg in (O_UREPLY_OK, O_UREPLY_ERR):
            ev = UE.REPLY_OK if msg == O_UREPLY_OK else UE.REPLY_ERROR
            if s.w[UTIL] == U_PENDING:
                s.fire(UTIL, self.t_util, ev)
                s.w[UTIL_ENDS] += 1
            elif s.w[UTIL] in U_LATE_OK:
                s.fire(UTIL, self.t_util, ev)  # late reply: dropped, no entry left
                if self.bug == "late_reply_resolves":
                    s.w[UTIL_ENDS] += 1
            else:
                s.flag("spec_conformance")
        elif msg in O_POWER_REPLIES:
            if not s.w[POWER_PENDING]:
                s.flag("spec_conformance")  # a reply nobody asked for
            else:
                s.w[POWER_PENDING] -= 1
            if msg == O_SLEPT:
                s.fire(C, self.t_client, CE.SLEEP_ACKED)
            elif msg == O_WOKE_FULL:
                s.fire(C, self.t_client, CE.WAKE_ACKED, "fully_awake")
            elif msg == O_WOKE_PART:
                s.fire(C, self.t_client, CE.WAKE_ACKED, "partially_awake")
            # O_POWER_ERR: the call raises UtilityError; the client's state stays.
        elif msg in (O_DEAD, O_SESSION_END):  # the sentinel; the session's end: ProtocolError
            if msg == O_SESSION_END:
                s.fire(ATT, self.t_attach, AE.SESSION_ENDED)
            self._on_death(s)
        else:  # O_CORRUPT: undecodable frame -> ProtocolError, engine unusable: kill it
            self._on_death(s)
            if not s.w[STANDALONE]:  # a standalone engine is not this client's to kill
                s.w[PROC_EXITED] = 1
        yield "receive_output", s.freeze()

    def _monitor(self, w: World) -> Iterator[tuple[str, World]]:
        # Reports each exit once. It races the dead sentinel (then the client is already
        # DEAD and the notice loops there) and a finished shutdown (the notice is ignored
        # there); while a shutdown is under way the exit is expected and not reported,
        # so pending calls end in ClientClosedError, not a spurious EngineDeadError.
        if (self.bug == "no_monitor" or not w[PROC_EXITED] or w[MONITOR_SEEN] or w[PARENT_DEAD]
                or (w[CLOSING] and w[C] != C_SHUTDOWN)):
            return
        s = Step(self, w)
        s.w[MONITOR_SEEN] = 1
        if w[C] in (C_DEAD, C_SHUTDOWN):
            s.fire(C, self.t_client, CE.ENGINE_DIED)
        else:
            self._on_death(s)
        yield "process_exit_noticed", s.freeze()
