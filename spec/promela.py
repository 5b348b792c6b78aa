"""The Promela model, generated from the machine tables; pure text, no I/O.

Theory of operation
-------------------
Rule 1: the *protocol* part (every state, event and guard as a ``#define``, and one
``fire_<machine>`` inline reading a constant array filled with one assignment per table row)
is generated from the same ``Transition`` tuples the runtime reads; an event outside the table sets
``v_spec_conformance`` exactly as the Python composition flags it.
Rule 2: the *environment* (owner, client threads, engine loop, monitor, watchdog, faults) is a
template that mirrors ``compose.py`` action for action, one ``atomic`` arm per action, one
proctype per actor so that SPIN's weak fairness (``pan -f``) is fairness between actors.
Negative controls are ``#ifdef BUG_<NAME>`` blocks; ``spin -DBUG_<NAME>`` selects one.

The properties come from ``properties.py`` as named ``ltl`` blocks (``pan -N <name>``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from string import Template
from typing import Any

from . import MACHINES
from . import _compose_world as m
from .machine import Machine
from .properties import PROPERTIES, Property

__all__ = ["GUARDS", "NFAIR", "finish_promela", "ltl_blocks", "promela_name", "render_promela"]

# Every guard name of every machine, sorted; 0 means "no guard".
GUARDS: tuple[str, ...] = tuple(
    sorted({t.guard for mach in MACHINES for t in mach.transitions if t.guard is not None})
)
# pan's fairness bound: NFAIR=3 holds up to 7 processes (the actors, init and the claim).
NFAIR = 3
# Promela variable holding each machine's state in the one-engine composition (the machines
# it composes; ``promela_dp.py`` has its own map for the two-engine one).
_VAR = {
    "client": "client",
    "engine": "engine",
    "engine_request": "ereq",
    "client_request": "creq",
    "utility": "util",
    "attach": "attach",
    "session": "session",
}


def promela_name(machine: Machine[Any, Any]) -> str:
    return machine.name.upper()


def _guard_id(guard: str | None) -> str:
    return "G_NONE" if guard is None else f"G_{guard.upper()}"


def defines() -> list[str]:
    out = ["#define G_NONE 0"]
    out += [f"#define G_{g.upper()} {i + 1}" for i, g in enumerate(GUARDS)]
    for mach in MACHINES:
        p = promela_name(mach)
        out += [f"#define {p}_S_{s.name} {i}" for i, s in enumerate(mach.state_members())]
        out += [f"#define {p}_E_{e.name} {i}" for i, e in enumerate(mach.event_members())]
    return out


def fire_inline(mach: Machine[Any, Any], var: str | None = None, *,
                indexed: bool = False, flag: str = "v_spec_conformance") -> list[str]:
    """A constant ``hidden`` lookup array (outside the state vector) and the inline reading it.

    Inline if-chains per row made ``pan.c`` take minutes to compile; a table does not.
    ``indexed``: the machine's state is an array (one per engine or request slot), and the
    inline takes the index first: ``fire_<var>(ix, ev, g)``.
    """
    var = var or _VAR[mach.name]
    n_ev, n_g = len(mach.event_members()), len(GUARDS) + 1
    size = len(mach.state_members()) * n_ev * n_g
    cur = f"{var}[ix]" if indexed else var
    params = "ix, ev, g" if indexed else "ev, g"
    return [
        f"hidden byte {var}_next[{size}];",
        f"inline fire_{var}({params}) {{",
        f"  nxt = {var}_next[({cur} * {n_ev} + ev) * {n_g} + g];",
        f"  if :: nxt == 255 -> {flag} = 1 :: else -> {cur} = nxt fi;",
        "  nxt = 0",
        "}",
    ]


def table_init(mach: Machine[Any, Any], var: str | None = None) -> list[str]:
    """One assignment per table row, run once by ``init`` before any actor starts."""
    p, var = promela_name(mach), var or _VAR[mach.name]
    n_ev, n_g = len(mach.event_members()), len(GUARDS) + 1
    size = len(mach.state_members()) * n_ev * n_g
    lines = [f"  ti = 0; do :: ti < {size} -> {var}_next[ti] = 255; ti++ :: else -> break od;"]
    rows = sorted(
        mach.transitions,
        key=lambda t: (mach.state_members().index(t.source),
                       mach.event_members().index(t.event), t.guard or ""),
    )
    # Machine.forgets: a forgotten state reads the initial state's rows (a new instance).
    sources = {mach.initial: [mach.initial, *sorted(mach.forgets, key=lambda st: st.name)]}
    for t in rows:
        for src in sources.get(t.source, (t.source,)):
            cell = f"{p}_S_{src.name} * {n_ev} + {p}_E_{t.event.name}"
            ix = f"({cell}) * {n_g} + {_guard_id(t.guard)}"
            lines.append(f"  {var}_next[{ix}] = {p}_S_{t.target.name};")
    return lines


def set_macro(name: str, var: str, ixs: frozenset[int]) -> str:
    return f"#define {name} (" + " || ".join(f"{var} == {i}" for i in sorted(ixs)) + ")"


def _queue_inlines() -> list[str]:
    n_out = m.OUT_CAP + 2  # headroom for the dead sentinel pushed past the cap
    n_in = m.IN_CAP + 1  # headroom for the abort a client leaving a standalone engine sends
    shift_left = "; ".join(f"outq[{i}] = outq[{i + 1}]" for i in range(n_out - 1))
    shift_right = "; ".join(f"outq[{i}] = outq[{i - 1}]" for i in range(n_out - 1, 0, -1))
    return [
        f"#define OUTQ_SIZE {n_out}",
        f"byte inq[{n_in}]; byte inq_len; byte outq[OUTQ_SIZE]; byte outq_len;",
        "inline push_in(x) { inq[inq_len] = x; inq_len++ }",
        "inline pop_in_head(x) { x = inq[0]; "
        + "; ".join(f"inq[{i}] = inq[{i + 1}]" for i in range(n_in - 1))
        + f"; inq[{n_in - 1}] = 0; inq_len-- }}",
        "inline pop_in_tail(x) { x = inq[inq_len - 1]; inq[inq_len - 1] = 0; inq_len-- }",
        "inline push_out(x) { assert(outq_len < OUTQ_SIZE); outq[outq_len] = x; outq_len++ }",
        f"inline push_out_front(x) {{ assert(outq_len < OUTQ_SIZE); {shift_right}; "
        "outq[0] = x; outq_len++ }",
        f"inline pop_out(x) {{ x = outq[0]; {shift_left}; outq[OUTQ_SIZE - 1] = 0; outq_len-- }}",
    ]


def _constants() -> list[str]:
    out = [
        f"#define BUDGET {m.BUDGET}",
        f"#define FAULTS {m.FAULTS}",
        f"#define IN_CAP {m.IN_CAP}",
        f"#define OUT_CAP {m.OUT_CAP}",
        f"#define TOKENS {m.TOKENS}",
        f"#define NO_UTIL {m.NO_UTIL}",
    ]
    out += [f"#define I_{name} {i + 1}" for i, name in enumerate(m.IN_MSGS)]
    out += [f"#define O_{name} {i + 1}" for i, name in enumerate(m.OUT_MSGS)]
    out += [
        set_macro("creq_live", "creq", m.Q_LIVE),
        set_macro("creq_free", "creq", m.Q_FREE),
        set_macro("creq_abortable", "creq", m.Q_ABORTABLE),
        set_macro("ereq_live", "ereq", m.R_LIVE),
        set_macro("ereq_queued", "ereq", m.R_QUEUED),
        set_macro("engine_in_loop", "engine", m.E_LOOP),
        set_macro("client_live", "client", m.C_LIVE),
        set_macro("attach_drops", "attach", m.A_DROPS),
        set_macro("session_drops", "session", m.S_DROPS),
        "#define attach_queued (" + " || ".join(
            f"inq[{i}] == I_ATTACH" for i in range(m.IN_CAP + 1)) + ")",
        "#define marker_queued (" + " || ".join(
            f"outq[{i}] == O_MARKER" for i in range(m.OUT_CAP + 2)) + ")",
    ]
    return out


_TEMPLATE = Template(r"""
/* ---- the composed world (compose.FIELDS) ---------------------------------------------- */
byte client = CLIENT_S_CONSTRUCTING;
byte engine = ENGINE_S_CONSTRUCTING;
bit proc_exited; bit hung; bit parent_dead;
byte creq = CLIENT_REQUEST_S_UNKNOWN;
byte ereq = ENGINE_REQUEST_S_UNKNOWN;
byte toks; bit preempted; byte sent; byte applied;
short util = NO_UTIL; byte util_ends;
bit weights_asleep; bit kv_asleep; bit sleep_flag; byte drain_waiters; bit closing;
byte budget = BUDGET; byte faults = FAULTS; bit monitor_seen;
byte power_pending; bit asked_awake; bit standalone; bit stale; bit left_work;
byte attach = ATTACH_S_DETACHED; byte session = SESSION_S_NO_FRONT_END;
/* safety flags set by the model where a property is a statement about one step */
bit v_spec_conformance; bit v_no_output_after_finish; bit v_sleep_reply_when_idle;
bit v_frames_in_order; bit v_no_foreign_output; bit v_session_starts_fresh;
/* scratch, reset to 0 after every use so it does not split states */
byte msg; byte kind; byte e0; bit partial; byte nxt;
hidden short ti;

$fire_inlines

#ifdef BUG_ADD_BEFORE_READY
#define ADD_OK (client_live || client == CLIENT_S_CONSTRUCTING)
#else
#define ADD_OK client_live
#endif
#define OWNER_MAY_CALL (!parent_dead && !closing && budget > 0)
#ifdef BUG_READER_KEEPS_STALE
#define DROPS_STALE 0
#else
#define DROPS_STALE 1
#endif
#define ENGINE_RUNS (!proc_exited && !hung)

inline on_death() {
  fire_client(CLIENT_E_ENGINE_DIED, G_NONE);
#ifndef BUG_FORGET_PENDING_ON_DEATH
  if :: util == UTILITY_S_PENDING -> fire_util(UTILITY_E_ENGINE_DIED, G_NONE); util_ends++
     :: else -> skip fi;
#endif
  if :: creq_live -> fire_creq(CLIENT_REQUEST_E_ENGINE_DIED, G_NONE) :: else -> skip fi;
  power_pending = 0
}

inline reply_slept() {
  if :: (engine != ENGINE_S_PAUSED && engine != ENGINE_S_SLEEPING)
        || ereq == ENGINE_REQUEST_S_RUNNING -> v_sleep_reply_when_idle = 1
     :: else -> skip fi;
  push_out(O_SLEPT)
}

inline release() {
  fire_engine(ENGINE_E_RELEASE_MEMORY, G_NONE);
  weights_asleep = 1; kv_asleep = 1; sleep_flag = 1
}

inline abort_live() {
  if :: ereq_live ->
        fire_ereq(ENGINE_REQUEST_E_ABORT, G_NONE);
#if defined(BUG_ABORT_ACK_BEFORE_FLUSH)
        push_out_front(O_FIN_ABORT)
#elif defined(BUG_ABORT_UNANSWERED)
        skip
#else
        push_out(O_FIN_ABORT)
#endif
     :: else -> skip fi
}

/* each deferred sleep(wait) releases memory and is answered */
inline complete_waiters() {
  do :: drain_waiters > 0 -> release(); reply_slept(); drain_waiters--
     :: else -> break od
}

inline settle() {
  if :: engine == ENGINE_S_RUNNING && !ereq_live -> fire_engine(ENGINE_E_ALL_FINISHED, G_NONE)
     :: engine == ENGINE_S_DRAINING && !ereq_live ->
        fire_engine(ENGINE_E_DRAINED, G_NONE); complete_waiters()
     :: else -> skip fi
}

inline wake(wake_all) {
  e0 = engine; partial = 0;
  if :: e0 == ENGINE_S_SLEEPING ->
        weights_asleep = 0;
        if :: wake_all -> kv_asleep = 0 :: else -> skip fi;
        if :: kv_asleep ->
              fire_engine(ENGINE_E_WAKE_UP, G_PARTIAL);
#ifdef BUG_PARTIAL_WAKE_CLEARS_FLAG
              sleep_flag = 0;
#endif
              push_out(O_WOKE_PART); partial = 1
           :: else -> skip fi
     :: else -> skip fi;
  if :: !partial ->
        if :: e0 == ENGINE_S_SLEEPING || e0 == ENGINE_S_PAUSED ->
              if :: ereq_live -> fire_engine(ENGINE_E_WAKE_UP, G_HAS_WORK)
                 :: else -> fire_engine(ENGINE_E_WAKE_UP, G_NO_WORK) fi;
              sleep_flag = 0
           :: e0 == ENGINE_S_DRAINING ->
#ifdef BUG_WAKE_IGNORED_WHILE_DRAINING
              skip
#else
              /* ends the pending sleep(wait)s: each reply is an error */
              if :: ereq_live -> fire_engine(ENGINE_E_WAKE_UP, G_HAS_WORK)
                 :: else -> fire_engine(ENGINE_E_WAKE_UP, G_NO_WORK) fi;
              sleep_flag = 0;
#ifndef BUG_CANCELLED_WAIT_UNANSWERED
              do :: drain_waiters > 0 -> push_out(O_POWER_ERR); drain_waiters--
                 :: else -> break od;
#endif
              drain_waiters = 0
#endif
           :: else -> fire_engine(ENGINE_E_WAKE_UP, G_NONE) fi;
        push_out(O_WOKE_FULL)
     :: else -> skip fi;
  e0 = 0; partial = 0
}

/* the client reads a successful resume like a full wake-up */
inline resume() {
  if :: engine == ENGINE_S_PAUSED ->
        if :: ereq_live -> fire_engine(ENGINE_E_RESUME, G_HAS_WORK)
           :: else -> fire_engine(ENGINE_E_RESUME, G_NO_WORK) fi;
        sleep_flag = 0; push_out(O_WOKE_FULL)
     :: engine == ENGINE_S_IDLE || engine == ENGINE_S_RUNNING ->
        fire_engine(ENGINE_E_RESUME, G_NONE); push_out(O_WOKE_FULL)
     :: else -> push_out(O_POWER_ERR) /* draining or asleep: the call fails, nothing changes */
  fi
}

inline check_seq(x) {
  if :: (x >> 4) != applied -> v_frames_in_order = 1 :: else -> skip fi;
  applied = (x >> 4) + 1
}

inline user_send(x) { budget--; push_in(x) }
inline user_power(x) { budget--; power_pending++; push_in(x) }

proctype User() {
end: do
  :: atomic { OWNER_MAY_CALL && ADD_OK && creq_free && inq_len < IN_CAP ->
       budget--; fire_client(CLIENT_E_ADD_REQUEST, G_NONE);
       fire_creq(CLIENT_REQUEST_E_SEND, G_NONE); push_in(I_ADD | (sent << 4)); sent++ }
  :: atomic { creq_abortable && OWNER_MAY_CALL && client_live && inq_len < IN_CAP ->
       user_send(I_ABORT | (sent << 4)); sent++;
       fire_creq(CLIENT_REQUEST_E_ABORT_SENT, G_NONE) }
  :: atomic { OWNER_MAY_CALL && util == NO_UTIL && client == CLIENT_S_DEAD ->
       budget--; util = UTILITY_S_PENDING; fire_util(UTILITY_E_ENGINE_DIED, G_NONE); util_ends++ }
  :: atomic { OWNER_MAY_CALL && util == NO_UTIL && client_live && inq_len < IN_CAP ->
       user_send(I_UTIL); util = UTILITY_S_PENDING }
  :: atomic { OWNER_MAY_CALL && util == UTILITY_S_PENDING ->
       budget--; fire_util(UTILITY_E_CANCEL, G_NONE); util_ends++ }
  :: atomic { OWNER_MAY_CALL && util == UTILITY_S_PENDING ->
       budget--; fire_util(UTILITY_E_TIMEOUT, G_NONE); util_ends++ }
  :: atomic { OWNER_MAY_CALL && client_live && inq_len < IN_CAP ->
       user_power(I_SLEEP_ABORT); asked_awake = 0 }
  :: atomic { OWNER_MAY_CALL && client_live && inq_len < IN_CAP ->
       user_power(I_SLEEP_WAIT); asked_awake = 0 }
  :: atomic { OWNER_MAY_CALL && client_live && inq_len < IN_CAP ->
       user_power(I_PAUSE_KEEP); asked_awake = 0 }
  :: atomic { OWNER_MAY_CALL && client_live && inq_len < IN_CAP -> user_power(I_WAKE_WEIGHTS) }
  :: atomic { OWNER_MAY_CALL && client_live && inq_len < IN_CAP ->
       user_power(I_WAKE_ALL); asked_awake = 1 }
  :: atomic { OWNER_MAY_CALL && client_live && inq_len < IN_CAP -> user_power(I_RESUME) }
  :: atomic { OWNER_MAY_CALL && (client_live || client == CLIENT_S_DEAD) ->
       budget--; closing = 1;
       if :: standalone ->
             /* the engine outlives this client: abort what it still runs for it */
             if :: client_live && creq_live ->
                   left_work = 1
#ifndef BUG_SHUTDOWN_LEAVES_WORK
                   ; push_in(I_ABORT | (sent << 4)); sent++;
                   fire_creq(CLIENT_REQUEST_E_ABORT_SENT, G_NONE)
#endif
                :: else -> skip fi
          :: !standalone && !proc_exited && inq_len < IN_CAP -> push_in(I_SHUTDOWN)
          :: else -> skip fi }
  od
}

proctype Client() {
end: do
#ifndef BUG_SHUTDOWN_NO_KILL
  :: atomic { closing && !proc_exited && !parent_dead && !standalone -> proc_exited = 1 }
#endif
#ifdef BUG_SHUTDOWN_SKIPS_JOIN
  :: atomic { closing && client != CLIENT_S_SHUTDOWN && !parent_dead ->
#else
  :: atomic { closing && (proc_exited || standalone) && client != CLIENT_S_SHUTDOWN
              && !parent_dead ->
#endif
       fire_client(CLIENT_E_SHUTDOWN, G_NONE);
       if :: util == UTILITY_S_PENDING -> fire_util(UTILITY_E_CLIENT_SHUTDOWN, G_NONE); util_ends++
          :: else -> skip fi;
       if :: creq_live -> fire_creq(CLIENT_REQUEST_E_FINISH_ERROR, G_NONE) :: else -> skip fi;
       power_pending = 0 }
#ifndef BUG_NO_STARTUP_DEADLINE
  /* ready_timeout_s: a timer, not a fault, so it also ends a hung construction */
  :: atomic { client == CLIENT_S_CONSTRUCTING && !parent_dead ->
       fire_client(CLIENT_E_CONSTRUCTION_FAILED, G_NONE);
       if :: !standalone -> proc_exited = 1 :: else -> skip fi }
#endif
#ifndef BUG_NO_ATTACH_DEADLINE
  /* the attach marker is overdue: a timer, modelled as firing when it is not on its way */
  :: atomic { client_live && attach_drops && (hung || !(attach_queued || marker_queued))
              && !closing && !parent_dead -> fire_attach(ATTACH_E_DEADLINE, G_NONE); on_death() }
#endif
  /* no front end connected to a standalone engine: its outputs are dropped */
  :: atomic { outq_len > 0 && !parent_dead && client == CLIENT_S_SHUTDOWN && standalone ->
       pop_out(msg); msg = 0 }
  :: atomic { outq_len > 0 && !parent_dead && client != CLIENT_S_DEAD
              && client != CLIENT_S_SHUTDOWN ->
       pop_out(msg);
       if
       :: msg == O_HS -> fire_client(CLIENT_E_HANDSHAKE_OK, G_NONE); push_in(I_ATTACH);
          fire_attach(ATTACH_E_SEND_ATTACH, G_NONE)
       :: msg != O_HS && attach_drops && msg != O_DEAD && (msg == O_MARKER || DROPS_STALE) ->
          /* before its marker only the marker and the dead sentinel count */
          if :: msg == O_MARKER -> fire_attach(ATTACH_E_MARKER, G_NONE)
             :: else -> fire_attach(ATTACH_E_FOREIGN_MESSAGE, G_NONE) fi
       :: else ->
       if
       :: msg == O_STALE -> v_no_foreign_output = 1
       :: msg == O_MARKER -> v_spec_conformance = 1 /* one marker per session */
       :: msg >= O_TOK && msg <= O_FIN_ERROR ->
          if
          :: !creq_live -> v_no_output_after_finish = 1
          :: else ->
             if
             :: msg == O_TOK -> fire_creq(CLIENT_REQUEST_E_OUTPUT, G_NONE)
             :: msg == O_FIN_STOP -> fire_creq(CLIENT_REQUEST_E_FINISH_STOP, G_NONE)
             :: msg == O_FIN_LENGTH -> fire_creq(CLIENT_REQUEST_E_FINISH_LENGTH, G_NONE)
             :: msg == O_FIN_ABORT -> fire_creq(CLIENT_REQUEST_E_FINISH_ABORT, G_NONE)
             :: msg == O_FIN_ERROR -> fire_creq(CLIENT_REQUEST_E_FINISH_ERROR, G_NONE)
             fi
          fi
       :: msg == O_UREPLY_OK || msg == O_UREPLY_ERR ->
          if :: msg == O_UREPLY_OK -> kind = UTILITY_E_REPLY_OK
             :: else -> kind = UTILITY_E_REPLY_ERROR fi;
          if
          :: util == UTILITY_S_PENDING -> fire_util(kind, G_NONE); util_ends++
          :: util == UTILITY_S_CANCELLED || util == UTILITY_S_TIMED_OUT ->
             fire_util(kind, G_NONE);
#ifdef BUG_LATE_REPLY_RESOLVES
             util_ends++;
#endif
             skip
          :: else -> v_spec_conformance = 1
          fi
       :: msg == O_SLEPT || msg == O_WOKE_FULL || msg == O_WOKE_PART || msg == O_POWER_ERR ->
          if :: power_pending == 0 -> v_spec_conformance = 1 /* a reply nobody asked for */
             :: else -> power_pending-- fi;
          if :: msg == O_SLEPT -> fire_client(CLIENT_E_SLEEP_ACKED, G_NONE)
             :: msg == O_WOKE_FULL -> fire_client(CLIENT_E_WAKE_ACKED, G_FULLY_AWAKE)
             :: msg == O_WOKE_PART -> fire_client(CLIENT_E_WAKE_ACKED, G_PARTIALLY_AWAKE)
             :: else -> skip /* O_POWER_ERR: the call raises; the client's state stays */
          fi
       :: msg == O_DEAD -> on_death()
       :: msg == O_SESSION_END -> fire_attach(ATTACH_E_SESSION_ENDED, G_NONE); on_death()
       :: msg == O_CORRUPT -> on_death();
          if :: !standalone -> proc_exited = 1 :: else -> skip fi
       fi
       fi;
       msg = 0; kind = 0 }
  od
}

proctype Monitor() {
end: do
#ifndef BUG_NO_MONITOR
  :: atomic { proc_exited && !monitor_seen && !parent_dead
              && !(closing && client != CLIENT_S_SHUTDOWN) ->
       monitor_seen = 1;
       if :: client == CLIENT_S_DEAD || client == CLIENT_S_SHUTDOWN ->
             fire_client(CLIENT_E_ENGINE_DIED, G_NONE)
          :: else -> on_death() fi }
#endif
  :: false
  od
}

proctype Engine() {
end: do
  :: atomic { ENGINE_RUNS && engine == ENGINE_S_CONSTRUCTING ->
       fire_engine(ENGINE_E_BUILT, G_SUBPROCESS); fire_engine(ENGINE_E_HANDSHAKE_SENT, G_NONE);
       fire_engine(ENGINE_E_LOOP_STARTED, G_NONE);
       if :: true -> skip /* launched by this client */
          :: client == CLIENT_S_CONSTRUCTING ->
             /* started on its own, a previous front end's request of the same id running,
                or parked by a sleep(level=1, mode="keep") */
             standalone = 1; stale = 1; toks = TOKENS;
             fire_session(SESSION_E_ATTACH_ACCEPTED, G_NONE); /* the previous front end's */
             fire_ereq(ENGINE_REQUEST_E_ADD, G_NONE); fire_engine(ENGINE_E_WORK_ARRIVED, G_NONE);
             fire_ereq(ENGINE_REQUEST_E_SCHEDULE, G_NONE);
             if :: true -> skip
                :: true -> fire_ereq(ENGINE_REQUEST_E_PREEMPT, G_NONE); preempted = 1;
                   fire_engine(ENGINE_E_PAUSE_KEEP, G_NONE); release()
             fi
       fi;
       push_out(O_HS) }
  :: atomic { ENGINE_RUNS && inq_len > 0 && engine_in_loop && outq_len <= 1 ->
#ifdef BUG_INPUT_REORDERS
       if :: inq_len > 1 -> pop_in_tail(msg) :: else -> pop_in_head(msg) fi;
#else
       pop_in_head(msg);
#endif
       kind = msg & 15;
       if
       :: session_drops && kind != I_ATTACH -> skip /* the ended session's front end is ignored */
       :: else ->
       if
       :: kind == I_ADD ->
          check_seq(msg); fire_ereq(ENGINE_REQUEST_E_ADD, G_NONE); toks = TOKENS;
          if :: engine != ENGINE_S_RUNNING -> fire_engine(ENGINE_E_WORK_ARRIVED, G_NONE)
             :: else -> skip fi
       :: kind == I_ABORT ->
          check_seq(msg);
          if :: ereq_live -> abort_live()
             :: else -> fire_ereq(ENGINE_REQUEST_E_ABORT, G_NONE) fi
       :: kind == I_UTIL ->
          if :: true -> push_out(O_UREPLY_OK)
#ifdef BUG_DROP_FAILED_REPLY
             :: true -> skip
#else
             :: true -> push_out(O_UREPLY_ERR)
#endif
          fi
       :: kind == I_SLEEP_ABORT ->
          abort_live(); fire_engine(ENGINE_E_PAUSE_ABORT, G_NONE);
          complete_waiters(); /* the abort ended their wait */
          release(); reply_slept()
       :: kind == I_SLEEP_WAIT ->
          fire_engine(ENGINE_E_PAUSE_WAIT, G_NONE);
          if :: engine == ENGINE_S_DRAINING ->
                sleep_flag = 1;
#ifdef BUG_REPLY_BEFORE_DRAIN
                reply_slept()
#else
                drain_waiters++
#endif
             :: else -> release(); reply_slept() fi
       :: kind == I_PAUSE_KEEP ->
          if :: ereq == ENGINE_REQUEST_S_RUNNING -> fire_ereq(ENGINE_REQUEST_E_PREEMPT, G_NONE)
             :: else -> skip fi;
          fire_engine(ENGINE_E_PAUSE_KEEP, G_NONE); sleep_flag = 1;
          complete_waiters(); /* earlier sleep(wait)s stop waiting: answered first */
          reply_slept()
       :: kind == I_WAKE_WEIGHTS -> wake(0)
       :: kind == I_WAKE_ALL -> wake(1)
       :: kind == I_RESUME -> resume()
       :: kind == I_SHUTDOWN -> fire_engine(ENGINE_E_SHUTDOWN, G_NONE); proc_exited = 1
       :: kind == I_ATTACH ->
          fire_session(SESSION_E_ATTACH_ACCEPTED, G_NONE);
#ifndef BUG_ATTACH_KEEPS_WORK
          /* EngineCore.start_session() */
          if :: stale ->
                if :: ereq_live -> fire_ereq(ENGINE_REQUEST_E_ABORT, G_NONE) :: else -> skip fi;
                stale = 0
             :: else -> skip fi;
          if :: engine == ENGINE_S_PAUSED || engine == ENGINE_S_SLEEPING
                || engine == ENGINE_S_DRAINING ->
                weights_asleep = 0; kv_asleep = 0;
                if :: ereq_live -> fire_engine(ENGINE_E_WAKE_UP, G_HAS_WORK)
                   :: else -> fire_engine(ENGINE_E_WAKE_UP, G_NO_WORK) fi;
                sleep_flag = 0
             :: else -> skip fi;
          settle();
#endif
          if :: engine != ENGINE_S_IDLE || ereq_live || stale || weights_asleep || kv_asleep
                || sleep_flag -> v_session_starts_fresh = 1
             :: else -> skip fi;
          push_out(O_MARKER)
       :: kind == I_CORRUPT ->
          /* rejected by the integrity check: the session ends, not the engine */
          if :: ereq_live -> fire_ereq(ENGINE_REQUEST_E_ABORT, G_NONE) :: else -> skip fi;
          stale = 0; drain_waiters = 0;
          if :: engine == ENGINE_S_PAUSED || engine == ENGINE_S_SLEEPING
                || engine == ENGINE_S_DRAINING ->
                weights_asleep = 0; kv_asleep = 0;
                fire_engine(ENGINE_E_WAKE_UP, G_NO_WORK); sleep_flag = 0
             :: else -> skip fi;
          settle(); fire_session(SESSION_E_INTEGRITY_FAILED, G_NONE)
#ifndef BUG_SESSION_END_UNANNOUNCED
          ; push_out(O_SESSION_END)
#endif
       fi
       fi;
       settle(); msg = 0; kind = 0 }
  :: atomic { ENGINE_RUNS && (engine == ENGINE_S_RUNNING || engine == ENGINE_S_DRAINING)
              && outq_len < OUT_CAP && ereq_queued ->
       fire_ereq(ENGINE_REQUEST_E_SCHEDULE, G_NONE) }
  :: atomic { ENGINE_RUNS && (engine == ENGINE_S_RUNNING || engine == ENGINE_S_DRAINING)
              && outq_len < OUT_CAP && ereq == ENGINE_REQUEST_S_RUNNING ->
       if
       :: stale -> /* a previous front end's request: how it ends is nobody's business */
          fire_ereq(ENGINE_REQUEST_E_STOP, G_NONE); stale = 0; push_out(O_STALE)
       :: !stale && toks > 0 -> toks--; push_out(O_TOK)
       :: !stale && toks == 0 ->
          fire_ereq(ENGINE_REQUEST_E_LENGTH, G_NONE); push_out(O_FIN_LENGTH)
       :: !stale -> fire_ereq(ENGINE_REQUEST_E_STOP, G_NONE); push_out(O_FIN_STOP)
       :: !stale -> fire_ereq(ENGINE_REQUEST_E_ERROR, G_NONE); push_out(O_FIN_ERROR)
       :: !stale && !preempted -> fire_ereq(ENGINE_REQUEST_E_PREEMPT, G_NONE); preempted = 1
       fi;
       settle() }
  od
}

proctype Watchdog() {
end: do
#ifndef BUG_IGNORE_PARENT_DEATH
  :: atomic { parent_dead && !proc_exited && !standalone ->
       if :: engine != ENGINE_S_SHUTDOWN -> fire_engine(ENGINE_E_SHUTDOWN, G_NONE)
          :: else -> skip fi;
       proc_exited = 1 }
#endif
  :: false
  od
}

proctype Fault() {
end: do
  :: atomic { faults > 0 -> faults = 0 }
  :: atomic { faults > 0 && !proc_exited && engine != ENGINE_S_DEAD
              && engine != ENGINE_S_SHUTDOWN && !hung ->
       faults--; fire_engine(ENGINE_E_FATAL_ERROR, G_NONE); push_out(O_DEAD); proc_exited = 1 }
  :: atomic { faults > 0 && !proc_exited -> faults--; proc_exited = 1 }
  :: atomic { faults > 0 && !proc_exited && !hung -> faults--; hung = 1 }
  :: atomic { faults > 0 && !proc_exited && inq_len < IN_CAP && !parent_dead ->
       faults--; push_in(I_CORRUPT) }
  :: atomic { faults > 0 && client != CLIENT_S_DEAD && client != CLIENT_S_SHUTDOWN
              && !proc_exited && !parent_dead -> faults--; push_out(O_CORRUPT) }
  :: atomic { faults > 0 && !parent_dead -> faults--; parent_dead = 1 }
  /* a link drop loses the ATTACH (not over a previous front end's live request) */
  :: atomic { faults > 0 && inq_len > 0 && inq[0] == I_ATTACH && !stale ->
       faults--; pop_in_head(msg); msg = 0 }
  od
}

init {
  d_step {
$table_init
    ti = 0
  };
  atomic { run User(); run Client(); run Monitor(); run Engine(); run Watchdog(); run Fault() }
}

/* ---- properties (properties.py) ------------------------------------------------------- */
$ltl
""")


def render_promela() -> str:
    """The whole ``enginewire.pml`` text, deterministic, with its AUTOGENERATED header."""
    fire: list[str] = []
    init: list[str] = []
    composed = [mach for mach in MACHINES if mach.name in _VAR]
    for mach in composed:
        fire += fire_inline(mach)
        fire.append("")
        init += table_init(mach)
    body = "\n".join(
        [*defines(), "", *_constants(), "", *_queue_inlines()]
    ) + _TEMPLATE.substitute(
        fire_inlines="\n".join(fire), ltl=ltl_blocks(PROPERTIES), table_init="\n".join(init)
    )
    return finish_promela(body, composed, "enginewire.pml", "enginewire.spec.compose.BUGS",
                          NFAIR)


def ltl_blocks(props: Sequence[Property]) -> str:
    """One named claim per property; -DLTL_ONLY -DLTL_<name> keeps only the named ones."""
    return "\n".join(
        f"#if !defined(LTL_ONLY) || defined(LTL_{p.name})\nltl {p.name} {{ {p.promela} }}\n#endif"
        for p in props
    )


def finish_promela(body: str, machines: Sequence[Machine[Any, Any]], file: str,
                   bugs: str, nfair: int = 3) -> str:
    """Join wrapped guards, stamp the text and put the AUTOGENERATED header on it."""
    # SPIN's parser ends a guard at a newline; the template wraps long ones for reading.
    body = re.sub(r"\n\s+(&&|\|\|)", r" \1", body)
    stamp = hashlib.sha256(body.encode()).hexdigest()[:16]
    sources = ", ".join(f"{mach.name}={mach.fingerprint()}" for mach in machines)
    header = (
        "/* AUTOGENERATED by `python -m enginewire._tools.generate`; ALL EDITS WILL BE LOST.\n"
        f" * stamp {stamp}; tables {sources}\n"
        f" * Check one property: spin -a {file} && gcc -O2 -DNFAIR={nfair} -o pan pan.c"
        " && ./pan -a -f -E -m50000 -N <name>\n"
        f" * Replay its trail (only that claim): spin -DLTL_ONLY -DLTL_<name> -t -p {file}\n"
        f" * Negative control: add -DBUG_<NAME> to spin (see {bugs}). */\n"
    )
    return header + body
