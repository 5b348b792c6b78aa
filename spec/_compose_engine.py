"""The composed model's engine-side actions: the engine process (``engine``), its
parent-death watchdog (``watchdog``) and the fault injector (``fault``), with the busy loop's
shared effects (settling, waking, replying to power calls).

Methods of a mixin of ``compose.Composition``; ``compose.py`` orders them into the model's
action table. Each takes a world and yields ``(label, next world)`` for every move it allows.
"""

from __future__ import annotations

from collections.abc import Iterator

from ._compose_world import (
    APPLIED,
    C_CONSTRUCTING,
    C_DEAD,
    C_SHUTDOWN,
    DRAIN_WAITERS,
    E_AWAKE,
    E_CONSTRUCTING,
    E_DEAD,
    E_DRAINING,
    E_IDLE,
    E_LOOP,
    E_PAUSED,
    E_RUNNING,
    E_SHUTDOWN,
    E_SLEEPING,
    EE,
    EREQ,
    FAULTS_LEFT,
    HUNG,
    I_ABORT,
    I_ADD,
    I_ATTACH,
    I_CORRUPT,
    I_PAUSE_KEEP,
    I_RESUME,
    I_SHUTDOWN,
    I_SLEEP_ABORT,
    I_SLEEP_WAIT,
    I_UTIL,
    I_WAKE_ALL,
    I_WAKE_WEIGHTS,
    IN_CAP,
    INQ,
    KVA,
    O_CORRUPT,
    O_DEAD,
    O_FIN_ABORT,
    O_FIN_ERROR,
    O_FIN_LENGTH,
    O_FIN_STOP,
    O_HS,
    O_MARKER,
    O_POWER_ERR,
    O_SESSION_END,
    O_SLEPT,
    O_STALE,
    O_TOK,
    O_UREPLY_ERR,
    O_UREPLY_OK,
    O_WOKE_FULL,
    O_WOKE_PART,
    OUT_CAP,
    OUTQ,
    PARENT_DEAD,
    PREEMPTED,
    PROC_EXITED,
    R_LIVE,
    R_QUEUED,
    R_RUNNING,
    RE,
    S_DROPS,
    SE,
    SESS,
    SLEEP_FLAG,
    STALE,
    STANDALONE,
    STANDALONE_STARTS,
    TOKENS,
    TOKS,
    TRIGGERED,
    WA,
    C,
    E,
    Model,
    Step,
    World,
)
from .request import EngineRequestEvent


class EngineActions(Model):
    def _has_work(self, s: Step) -> bool:
        return s.w[EREQ] in R_LIVE

    def _reply_slept(self, s: Step) -> None:
        # "sleep/pause replies only once the engine is idle": paused or asleep, nothing running.
        if s.w[E] not in (E_PAUSED, E_SLEEPING) or s.w[EREQ] == R_RUNNING:
            s.flag("sleep_reply_when_idle")
        s.push_out(O_SLEPT)

    def _release(self, s: Step) -> None:
        s.fire(E, self.t_engine, EE.RELEASE_MEMORY)
        s.w[WA] = s.w[KVA] = 1
        s.w[SLEEP_FLAG] = 1

    def _abort_live(self, s: Step) -> None:
        if s.w[EREQ] in R_LIVE:
            s.fire(EREQ, self.t_ereq, RE.ABORT)
            if self.bug != "abort_unanswered":
                s.push_out(O_FIN_ABORT, front=self.bug == "abort_ack_before_flush")

    def _complete_waiters(self, s: Step) -> None:
        """Each deferred sleep(wait) releases memory and is answered (``_complete_deferred``)."""
        for _ in range(s.w[DRAIN_WAITERS]):
            self._release(s)
            self._reply_slept(s)
        s.w[DRAIN_WAITERS] = 0

    def _settle(self, s: Step) -> None:
        """The busy loop's bookkeeping after each step: the state-triggered table (idle when
        done, pause when drained). With one request, both of its conditions (no live request,
        none draining) read as "the request is not live"."""
        event = TRIGGERED.get(s.w[E])
        if event is None or s.w[EREQ] in R_LIVE:
            return
        s.fire(E, self.t_engine, event)
        if event is EE.DRAINED:
            self._complete_waiters(s)

    def _wake(self, s: Step, full: bool) -> None:
        e = s.w[E]
        if e == E_SLEEPING:
            s.w[WA] = 0
            if full:
                s.w[KVA] = 0
            if s.w[KVA]:
                s.fire(E, self.t_engine, EE.WAKE_UP, "partial")
                if self.bug == "partial_wake_clears_flag":
                    s.w[SLEEP_FLAG] = 0
                s.push_out(O_WOKE_PART)
                return
        if e in (E_SLEEPING, E_PAUSED):
            s.fire(E, self.t_engine, EE.WAKE_UP, "has_work" if self._has_work(s) else "no_work")
            s.w[SLEEP_FLAG] = 0
        elif e in (E_IDLE, E_RUNNING):
            s.fire(E, self.t_engine, EE.WAKE_UP)
        elif self.bug == "wake_ignored_while_draining":
            pass  # the old no-op: the deferred sleep completes after this "fully awake"
        else:  # draining: the wake-up ends the pending sleep(wait)s, each answered an error
            s.fire(E, self.t_engine, EE.WAKE_UP, "has_work" if self._has_work(s) else "no_work")
            s.w[SLEEP_FLAG] = 0
            if self.bug != "cancelled_wait_unanswered":
                for _ in range(s.w[DRAIN_WAITERS]):
                    s.push_out(O_POWER_ERR)
            s.w[DRAIN_WAITERS] = 0
        s.push_out(O_WOKE_FULL)

    def _resume(self, s: Step) -> None:
        e = s.w[E]
        if e == E_PAUSED:
            s.fire(E, self.t_engine, EE.RESUME, "has_work" if self._has_work(s) else "no_work")
            s.w[SLEEP_FLAG] = 0
        elif e in E_AWAKE:
            s.fire(E, self.t_engine, EE.RESUME)
        else:  # draining or asleep: the table forbids it, so the call fails, nothing changes
            s.push_out(O_POWER_ERR)
            return
        s.push_out(O_WOKE_FULL)  # the client reads a resume like a full wake-up

    def _check_seq(self, s: Step, msg: int) -> None:
        seq = msg >> 4
        if seq != s.w[APPLIED]:
            s.flag("frames_in_order")
        s.w[APPLIED] = seq + 1

    # -- the engine process ------------------------------------------------------------
    def _engine_runs(self, w: World) -> bool:
        return not w[PROC_EXITED] and not w[HUNG]

    def _start(self, w: World) -> Iterator[tuple[str, World]]:
        if self._engine_runs(w) and w[E] == E_CONSTRUCTING:
            s = Step(self, w)
            s.fire(E, self.t_engine, EE.BUILT, "subprocess")
            s.fire(E, self.t_engine, EE.HANDSHAKE_SENT)
            s.push_out(O_HS)
            s.fire(E, self.t_engine, EE.LOOP_STARTED)
            yield "engine_start", s.freeze()
            if w[C] != C_CONSTRUCTING:
                return
            # Or the engine was started on its own and a previous front end used it: it
            # answers this client's connection with its ready, in one of these states.
            for label in STANDALONE_STARTS:
                s = Step(self, w)
                s.w[STANDALONE] = 1
                s.fire(E, self.t_engine, EE.BUILT, "subprocess")
                s.fire(E, self.t_engine, EE.HANDSHAKE_SENT)
                s.fire(E, self.t_engine, EE.LOOP_STARTED)
                # A request of the same id as this client's; a running one outputs more,
                # maybe before this client reads the ready.
                s.fire(EREQ, self.t_ereq, RE.ADD)
                s.fire(E, self.t_engine, EE.WORK_ARRIVED)
                s.fire(EREQ, self.t_ereq, RE.SCHEDULE)
                s.w[TOKS] = TOKENS
                s.w[STALE] = 1
                s.fire(SESS, self.t_session, SE.ATTACH_ACCEPTED)  # the previous front end's
                if label == "parked":  # sleep(level=1, mode="keep")
                    s.fire(EREQ, self.t_ereq, RE.PREEMPT)
                    s.w[PREEMPTED] = 1
                    s.fire(E, self.t_engine, EE.PAUSE_KEEP)
                    self._release(s)
                s.push_out(O_HS)
                yield f"engine_standalone_{label}", s.freeze()

    def _recv(self, w: World) -> Iterator[tuple[str, World]]:
        if not (self._engine_runs(w) and w[INQ] and w[E] in E_LOOP and len(w[OUTQ]) <= 1):
            return
        s = Step(self, w)
        q = s.w[INQ]
        if self.bug == "input_reorders" and len(q) > 1:
            msg, s.w[INQ] = q[-1], q[:-1]
        else:
            msg, s.w[INQ] = q[0], q[1:]
        kind = msg & 15
        if s.w[SESS] in S_DROPS and kind != I_ATTACH:
            # the ended session's front end is not listened to
            self._settle(s)
            yield "engine_ignores_refused", s.freeze()
            return
        if kind == I_ADD:
            self._check_seq(s, msg)
            s.fire(EREQ, self.t_ereq, RE.ADD)
            s.w[TOKS] = TOKENS
            if s.w[E] != E_RUNNING:
                s.fire(E, self.t_engine, EE.WORK_ARRIVED)
        elif kind == I_ABORT:
            self._check_seq(s, msg)
            if s.w[EREQ] in R_LIVE:
                self._abort_live(s)
            else:
                s.fire(EREQ, self.t_ereq, RE.ABORT)  # unknown or finished id: no-op
        elif kind == I_UTIL:
            s0 = Step(self, s.freeze())
            s0.push_out(O_UREPLY_OK)
            self._settle(s0)
            yield "engine_utility_ok", s0.freeze()
            if self.bug != "drop_failed_reply":
                s.push_out(O_UREPLY_ERR)
            self._settle(s)
            yield "engine_utility_error", s.freeze()
            return
        elif kind == I_SLEEP_ABORT:
            self._abort_live(s)
            s.fire(E, self.t_engine, EE.PAUSE_ABORT)
            self._complete_waiters(s)  # the abort ended their wait
            self._release(s)
            self._reply_slept(s)
        elif kind == I_SLEEP_WAIT:
            s.fire(E, self.t_engine, EE.PAUSE_WAIT)
            if s.w[E] == E_DRAINING:
                s.w[SLEEP_FLAG] = 1
                if self.bug == "reply_before_drain":
                    self._reply_slept(s)
                else:
                    s.w[DRAIN_WAITERS] += 1
            else:
                self._release(s)
                self._reply_slept(s)
        elif kind == I_PAUSE_KEEP:
            if s.w[EREQ] == R_RUNNING:
                s.fire(EREQ, self.t_ereq, RE.PREEMPT)  # parked, resumes after wake-up
            s.fire(E, self.t_engine, EE.PAUSE_KEEP)
            s.w[SLEEP_FLAG] = 1
            self._complete_waiters(s)  # earlier sleep(wait)s stop waiting: answered first
            self._reply_slept(s)
        elif kind in (I_WAKE_WEIGHTS, I_WAKE_ALL):
            self._wake(s, full=kind == I_WAKE_ALL)
        elif kind == I_RESUME:
            self._resume(s)
        elif kind == I_SHUTDOWN:
            s.fire(E, self.t_engine, EE.SHUTDOWN)
            s.w[PROC_EXITED] = 1
        elif kind == I_ATTACH:
            s.fire(SESS, self.t_session, SE.ATTACH_ACCEPTED)
            if self.bug != "attach_keeps_work":  # EngineCore.start_session()
                if s.w[STALE]:
                    if s.w[EREQ] in R_LIVE:
                        s.fire(EREQ, self.t_ereq, RE.ABORT)  # dropped: nobody listens
                    s.w[STALE] = 0
                if s.w[E] in (E_PAUSED, E_SLEEPING, E_DRAINING):
                    s.w[WA] = s.w[KVA] = 0
                    s.fire(E, self.t_engine, EE.WAKE_UP,
                           "has_work" if self._has_work(s) else "no_work")
                    s.w[SLEEP_FLAG] = 0
                self._settle(s)
            if (s.w[E] != E_IDLE or s.w[EREQ] in R_LIVE or s.w[STALE] or s.w[WA]
                    or s.w[KVA] or s.w[SLEEP_FLAG]):
                s.flag("session_starts_fresh")
            s.push_out(O_MARKER)
        else:  # I_CORRUPT: a frame the integrity check rejects ends the session, not the
            # engine: its work is dropped (as by an attach), its front end told, then
            # ignored until it attaches again.
            if s.w[EREQ] in R_LIVE:
                s.fire(EREQ, self.t_ereq, RE.ABORT)  # no output: the notice says it all
            s.w[STALE] = s.w[DRAIN_WAITERS] = 0
            if s.w[E] in (E_PAUSED, E_SLEEPING, E_DRAINING):
                s.w[WA] = s.w[KVA] = 0
                s.fire(E, self.t_engine, EE.WAKE_UP, "no_work")
                s.w[SLEEP_FLAG] = 0
            self._settle(s)
            s.fire(SESS, self.t_session, SE.INTEGRITY_FAILED)
            if self.bug != "session_end_unannounced":
                s.push_out(O_SESSION_END)
        self._settle(s)
        yield "engine_receive", s.freeze()

    def _step(self, w: World) -> Iterator[tuple[str, World]]:
        if not (self._engine_runs(w) and w[E] in (E_RUNNING, E_DRAINING)
                and len(w[OUTQ]) < OUT_CAP):
            return
        r = w[EREQ]
        if r in R_QUEUED:
            s = Step(self, w)
            s.fire(EREQ, self.t_ereq, RE.SCHEDULE)
            yield "engine_schedule", s.freeze()
            return
        if r != R_RUNNING:
            return
        if w[STALE]:  # a previous front end's request: how it ends is nobody's business
            s = Step(self, w)
            s.fire(EREQ, self.t_ereq, RE.STOP)
            s.w[STALE] = 0
            s.push_out(O_STALE)
            self._settle(s)
            yield "engine_stale_finish", s.freeze()
            return
        choices: list[tuple[str, EngineRequestEvent | None, int]] = []
        if w[TOKS] > 0:
            choices.append(("engine_token", None, O_TOK))
        else:
            choices.append(("engine_length", RE.LENGTH, O_FIN_LENGTH))
        choices.append(("engine_stop", RE.STOP, O_FIN_STOP))
        choices.append(("engine_request_error", RE.ERROR, O_FIN_ERROR))
        if not w[PREEMPTED]:
            choices.append(("engine_preempt", RE.PREEMPT, 0))
        for label, ev, out in choices:
            s = Step(self, w)
            if ev is None:
                s.w[TOKS] -= 1
            else:
                s.fire(EREQ, self.t_ereq, ev)
            if ev is RE.PREEMPT:
                s.w[PREEMPTED] = 1
            if out:
                s.push_out(out)
            self._settle(s)
            yield label, s.freeze()

    def _watchdog(self, w: World) -> Iterator[tuple[str, World]]:
        if (self.bug != "ignore_parent_death" and w[PARENT_DEAD] and not w[PROC_EXITED]
                and not w[STANDALONE]):
            s = Step(self, w)
            if s.w[E] != E_SHUTDOWN:
                s.fire(E, self.t_engine, EE.SHUTDOWN)
            s.w[PROC_EXITED] = 1
            yield "engine_exits_orphaned", s.freeze()

    # -- faults ------------------------------------------------------------------------------
    def _faults(self, w: World) -> Iterator[tuple[str, World]]:
        if not w[FAULTS_LEFT]:
            return
        # A run may also be fault-free; without this choice every quiescent world would
        # have seen a fault, and fault-excused obligations would hide liveness bugs.
        s = Step(self, w)
        s.w[FAULTS_LEFT] = 0
        yield "no_fault", s.freeze()
        alive = not w[PROC_EXITED]
        if alive and w[E] not in (E_DEAD, E_SHUTDOWN) and not w[HUNG]:
            s = Step(self, w)
            s.w[FAULTS_LEFT] -= 1
            s.fire(E, self.t_engine, EE.FATAL_ERROR)
            s.push_out(O_DEAD)
            s.w[PROC_EXITED] = 1
            yield "crash_with_sentinel", s.freeze()
        if alive:
            s = Step(self, w)
            s.w[FAULTS_LEFT] -= 1
            s.w[PROC_EXITED] = 1
            yield "crash_silently", s.freeze()
            if not w[HUNG]:
                s = Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                s.w[HUNG] = 1
                yield "engine_hangs", s.freeze()
        if alive and len(w[INQ]) < IN_CAP and not w[PARENT_DEAD]:
            s = Step(self, w)
            s.w[FAULTS_LEFT] -= 1
            s.push_in(I_CORRUPT)
            yield "corrupt_input_frame", s.freeze()
        if w[C] not in (C_DEAD, C_SHUTDOWN) and alive and not w[PARENT_DEAD]:
            s = Step(self, w)
            s.w[FAULTS_LEFT] -= 1
            s.push_out(O_CORRUPT)
            yield "corrupt_output_frame", s.freeze()
        # A link that drops just as the client attaches loses its ATTACH: the engine goes
        # on serving, with no marker. (Not over a previous front end's live request: the
        # model's single id would collide; the runtime refuses such an add, tested apart.)
        if w[INQ] and w[INQ][0] == I_ATTACH and not w[STALE]:
            s = Step(self, w)
            s.w[FAULTS_LEFT] -= 1
            s.w[INQ] = s.w[INQ][1:]
            yield "attach_lost", s.freeze()
        if not w[PARENT_DEAD]:
            s = Step(self, w)
            s.w[FAULTS_LEFT] -= 1
            s.w[PARENT_DEAD] = 1
            yield "parent_dies", s.freeze()
