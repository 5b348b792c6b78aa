"""The Promela model of the two-engine composition (``compose_dp.py``); pure text, no I/O.

Theory of operation
-------------------
Rule 1: the protocol part is ``promela.py``'s: the same ``#define`` per state, event and
guard, and one ``fire_<var>`` inline per machine reading a constant array filled from the
table rows; a machine held once per engine or per request slot is an array and its inline
takes the index first (``fire_mem(i, ev, g)``).
Rule 2: the environment mirrors ``compose_dp.py`` action for action, one ``atomic`` arm per
action; the owner, the client's teardown and the fault injector are one proctype each, and
every engine has its own engine, reader and monitor process (``Engine(i)``, ``Reader(i)``,
``Monitor(i)``), so SPIN's weak fairness is fairness between them. A per-index step of the
Python model is written once per index here (``N`` and ``REQS`` are small), and a frame is a
byte on a Promela channel of the same capacity. Negative controls are ``#ifdef BUG_<NAME>``.
"""

from __future__ import annotations

from string import Template

from . import MACHINES
from . import compose_dp as dp
from .client import CLIENT
from .engine import ENGINE
from .membership import MEMBERSHIP, SCALE
from .promela import (
    defines,
    finish_promela,
    fire_inline,
    ltl_blocks,
    set_macro,
    table_init,
)
from .properties import DP_PROPERTIES
from .request import CLIENT_REQUEST, ENGINE_REQUEST
from .utility import UTILITY

__all__ = ["NFAIR", "render_promela_dp"]

# pan's fairness bound: ten processes (three per engine, the owner, the client's teardown, the
# fault injector and init) and the claim need NFAIR=4 (NFAIR=3 holds ten in all).
NFAIR = 4

# (machine, Promela variable, held per index?)
_VARS = (
    (CLIENT, "client", False),
    (MEMBERSHIP, "mem", True),
    (ENGINE, "eng", True),
    (ENGINE_REQUEST, "ereq", True),
    (CLIENT_REQUEST, "creq", True),
    (UTILITY, "util", False),
    (SCALE, "scale", False),
)
_FLAG = "v_dp_spec_conformance"


def _indexed_macro(name: str, var: str, ixs: frozenset[int]) -> str:
    return f"#define {name}(x) (" + " || ".join(
        f"{var}[x] == {i}" for i in sorted(ixs)) + ")"


def _constants() -> list[str]:
    out = [
        f"#define N {dp.N}",
        f"#define REQS {dp.REQS}",
        f"#define BUDGET {dp.BUDGET}",
        f"#define FAULTS {dp.FAULTS}",
        f"#define IN_CAP {dp.IN_CAP}",
        f"#define OUT_CAP {dp.OUT_CAP}",
        f"#define NO_UTIL {dp.NO_UTIL}",
        f"#define P_NONE {dp.P_NONE}",
        f"#define P_SLEEP {dp.P_SLEEP}",
        f"#define P_WAKE {dp.P_WAKE}",
        f"#define FROM_REMOVED {dp.FROM_REMOVED}",
    ]
    out += [f"#define I_{name} {i + 1}" for i, name in enumerate(dp.IN_MSGS)]
    out += [f"#define O_{name} {i + 1}" for i, name in enumerate(dp.OUT_MSGS)]
    out += [
        "#define FRAME(k, s, g) ((k) | ((s) << 3) | ((g) << 4))",
        "#define GEN_OF(m) (((m) >> 4) & 7)",
        _indexed_macro("creq_live", "creq", dp.Q_LIVE),
        _indexed_macro("creq_free", "creq", dp.Q_FREE),
        _indexed_macro("ereq_live", "ereq", dp.R_LIVE),
        _indexed_macro("member_left", "mem", dp.M_LEFT),
        _indexed_macro("member_routable", "mem", dp.M_ROUTABLE),
        _indexed_macro("member_in_set", "mem", dp.M_IN_SET),
        _indexed_macro("engine_in_loop", "eng", dp.E_LOOP),
        "#define left_state(x) (" + " || ".join(
            f"x == {i}" for i in sorted(dp.M_LEFT)) + ")",
        set_macro("client_live", "client", dp.C_LIVE),
        set_macro("client_asleep", "client", dp.C_ASLEEP),
        set_macro("client_scale_refused", "client", dp.C_SCALE_REFUSED),
        "#define owns(r, i) (own[r] == i && ogen[r] == gen[i])",
        "#define calls(i) (uown == i && ugen == gen[i])",
        "#define all_routable (" + " && ".join(
            f"member_routable({i})" for i in range(dp.N)) + ")",
        "#define any_left (" + " || ".join(f"counted({i})" for i in range(dp.N)) + ")",
        "#define any_free (" + " || ".join(f"creq_free({r})" for r in range(dp.REQS)) + ")",
        "#define any_live (" + " || ".join(f"creq_live({r})" for r in range(dp.REQS)) + ")",
        "#define any_serving (" + " || ".join(
            f"member_routable({i})" for i in range(dp.N)) + ")",
        "#define any_serving_asleep (" + " || ".join(
            f"(member_routable({i}) && mslp[{i}])" for i in range(dp.N)) + ")",
        "#define mine(r, i) (owns(r, i) && ereq[r] == ENGINE_REQUEST_S_WAITING)",
        "#define any_mine(i) (" + " || ".join(f"mine({r}, i)" for r in range(dp.REQS)) + ")",
        "#define busy(i) (" + " || ".join(
            f"(owns({r}, i) && ereq_live({r}))" for r in range(dp.REQS)) + ")",
    ]
    return out


def _first(cond: str, target: str, n: int) -> str:
    """``if`` choosing the lowest index ``k`` for which ``cond`` holds (the Python model's
    ``[...][0]``); the caller's guard says one does."""
    arms = []
    for k in range(n):
        earlier = "".join(f"!{cond.format(k=j)} && " for j in range(k))
        arms.append(f":: {earlier}{cond.format(k=k)} -> {target} = {k}")
    return "if " + " ".join(arms) + " fi"


def _per_req(fmt: str) -> str:
    return ";\n".join(fmt.format(r=r) for r in range(dp.REQS))


def _per_engine(fmt: str) -> str:
    return ";\n".join(fmt.format(i=i) for i in range(dp.N))


_TEMPLATE = Template(r"""
/* ---- the composed world (compose_dp.FIELDS) ------------------------------------------- */
byte client = CLIENT_S_CONSTRUCTING;
bit started; bit restart_on;
short util = NO_UTIL; byte uown; byte ugen;
bit closing; byte budget = BUDGET; byte faults = FAULTS;
byte pcall = P_NONE; byte pmask; bit ppart; bit pfail;
byte scale = SCALE_S_IDLE; byte sjoin; byte sleave; bit swait;
byte creq[REQS]; byte own[REQS]; byte ogen[REQS]; byte ereq[REQS];
byte mem[N]; byte eng[N]; byte gen[N];
chan inq[N] = [IN_CAP] of { byte };
chan outq[N] = [OUT_CAP + 2] of { byte }; /* the sentinel, and a replacement's handshake
                                              behind a reused channel, go past the cap */
bit exited[N]; bit seen[N]; bit asleep[N]; bit mslp[N]; byte zombie[N];
/* safety flags set by the model where a property is a statement about one step */
bit v_dp_spec_conformance; bit v_dp_death_fails_its_own; bit v_dp_routes_to_serving;
bit v_dp_request_ends_once; bit v_dp_fresh_channel; bit v_dp_removed_engine_silent;
/* scratch, reset to 0 after every use so it does not split states */
byte msg; byte kind; byte slot; byte rr; byte before; byte nxt;
hidden short ti;

$fire_inlines

#if defined(BUG_ROUTE_TO_RESTARTING)
#define ROUTABLE(i) (member_routable(i) || mem[i] == MEMBERSHIP_S_RESTARTING)
#elif !defined(BUG_ROUTE_TO_LEAVER)
#define ROUTABLE(i) member_routable(i)
#endif
#ifdef BUG_DEATH_FAILS_EVERY_ENGINE
#define EVERYONE 1
#else
#define EVERYONE 0
#endif
#ifdef BUG_CLIENT_DIES_WITH_FIRST_MEMBER
#define DIES_EARLY (client != CLIENT_S_DEAD)
#else
#define DIES_EARLY 0
#endif
#ifdef BUG_EVERY_HANDSHAKE_READIES_CLIENT
#define EVERY_HS 1
#else
#define EVERY_HS 0
#endif
#ifdef BUG_READER_FORGETS_REPLACEMENT
#define READS(i) (gen[i] == 0)
#else
#define READS(i) 1
#endif
#ifdef BUG_REPLACEMENT_UNMONITORED
#define WATCHES(i) (gen[i] == 0)
#else
#define WATCHES(i) 1
#endif
#ifdef BUG_ROUTE_TO_LEAVER
#define ROUTABLE(i) (member_routable(i) || mem[i] == MEMBERSHIP_S_DRAINING)
#endif
#ifdef BUG_DRAINING_NOT_COUNTED
#define counted(x) (member_left(x) && mem[x] != MEMBERSHIP_S_DRAINING)
#else
#define counted(x) member_left(x)
#endif
#ifdef BUG_REMOVED_IDENTITY_REUSED
#define NEW_IDENTITY(x) skip
#else
#define NEW_IDENTITY(x) gen[x]++
#endif
#ifdef BUG_JOIN_WAITER_AFTER_EVENT
#define ARMED_AT_START 0
#else
#define ARMED_AT_START 1
#endif
#define OWNER_MAY_CALL (started && !closing && budget > 0)
/* a running scale refuses a power call (BUG power_beside_scale: sent anyway) */
#ifdef BUG_POWER_BESIDE_SCALE
#define POWER_MAY_BEGIN 1
#else
#define POWER_MAY_BEGIN (scale == SCALE_S_IDLE)
#endif
#define MAY_SCALE (OWNER_MAY_CALL && client_live && !client_scale_refused && pcall == P_NONE
                   && scale == SCALE_S_IDLE)

inline fail_owned(dead) {
  /* exactly the dead engine's live requests and pending call end (or, under a bug, all) */
$fail_owned
  if :: util == UTILITY_S_PENDING && (EVERYONE || calls(dead)) ->
        if :: !calls(dead) -> v_dp_death_fails_its_own = 1 :: else -> skip fi;
        fire_util(UTILITY_E_ENGINE_DIED, G_NONE)
     :: else -> skip fi
}

/* the group's client state from its serving members' (dp_client._follow_members_power) */
inline derive_power() {
#ifndef BUG_POWER_FOLLOWS_COMBINED_REPLY
  if :: client_live && any_serving ->
        if :: any_serving_asleep && !client_asleep -> fire_client(CLIENT_E_SLEEP_ACKED, G_NONE)
           :: !any_serving_asleep && client_asleep ->
              fire_client(CLIENT_E_WAKE_ACKED, G_FULLY_AWAKE)
           :: else -> skip fi
     :: else -> skip fi;
#endif
  skip
}

/* the owner's power call is over (answered, given up, or failed by shutdown()) */
inline power_call_over() {
  if :: scale == SCALE_S_POWERING -> fire_scale(SCALE_E_POWER_END, G_LAST_POWER_CALL)
     :: else -> skip fi;
  pcall = P_NONE; pmask = 0; ppart = 0; pfail = 0
}

/* the owner's power call returns; under the bug only a call all answered moves the client */
inline power_ends() {
#ifdef BUG_POWER_FOLLOWS_COMBINED_REPLY
  if :: !pfail && client_live ->
        if :: pcall == P_SLEEP -> fire_client(CLIENT_E_SLEEP_ACKED, G_NONE)
           :: pcall == P_WAKE && ppart -> fire_client(CLIENT_E_WAKE_ACKED, G_PARTIALLY_AWAKE)
           :: pcall == P_WAKE && !ppart -> fire_client(CLIENT_E_WAKE_ACKED, G_FULLY_AWAKE)
        fi
     :: else -> skip fi;
#endif
  power_call_over()
}

/* engine x answered the owner's power call (part: only partly awake), or died first */
inline power_settled(x, part, died) {
  if :: (pmask & (1 << x)) != 0 ->
        pmask = pmask & (~(1 << x));
#ifdef BUG_POWER_FOLLOWS_COMBINED_REPLY
        if :: part -> ppart = 1 :: else -> skip fi;
        if :: died -> pfail = 1 :: else -> skip fi;
#endif
        if :: pmask == 0 -> power_ends() :: else -> skip fi
     :: else -> skip fi
}

inline drain(ch) { do :: ch?msg :: empty(ch) -> break od; msg = 0 }

/* the running scale returns (done, failed, or failed by shutdown()) */
inline end_scale() { fire_scale(SCALE_E_END, G_NONE); sjoin = 0; sleave = 0; swait = 0 }

/* joiner x handshook or failed: its scale's waiter wakes (an event with no waiter is lost) */
inline wake_waiter(x) {
  if :: sjoin == x + 1 && swait -> end_scale() :: else -> skip fi
}

inline close_channel(i) {
#ifndef BUG_RESTART_REUSES_CHANNEL
  drain(inq[i]); drain(outq[i])
#else
  skip
#endif
}

/* the client learns that engine i's current incarnation is gone */
inline notice(i) {
  before = mem[i];
  fire_mem(i, MEMBERSHIP_E_DIED, G_NONE);
  if
  :: !left_state(before) -> skip /* DEAD and SHUT_DOWN loop: a later notice */
  :: else ->
     if
     :: client == CLIENT_S_CONSTRUCTING -> /* lost before every handshake: start-up fails */
        fire_client(CLIENT_E_CONSTRUCTION_FAILED, G_NONE);
$construction_failed
     :: else ->
#ifndef BUG_FAIL_ONLY_WHEN_CLIENT_DIES
        fail_owned(i);
#endif
        power_settled(i, 0, 1);
        close_channel(i);
        if :: before == MEMBERSHIP_S_SERVING && restart_on ->
              fire_mem(i, MEMBERSHIP_E_RESTART, G_NONE); gen[i]++;
              eng[i] = ENGINE_S_CONSTRUCTING; exited[i] = 0; seen[i] = 0;
              asleep[i] = 0; mslp[i] = 0
           :: before == MEMBERSHIP_S_DRAINING -> /* a dead leaver is gone, never restarted */
              asleep[i] = 0; mslp[i] = 0;
              if :: sleave == i + 1 -> end_scale() :: else -> skip fi
           :: before == MEMBERSHIP_S_STARTING -> /* a joiner failed to start: so does its scale */
              fire_mem(i, MEMBERSHIP_E_REMOVE, G_NONE);
#ifndef BUG_JOINER_DEATH_UNWAITED
              wake_waiter(i);
#endif
              skip
           :: else -> skip fi;
        if :: !any_left || DIES_EARLY ->
              fire_client(CLIENT_E_ENGINE_DIED, G_NONE);
#ifdef BUG_FAIL_ONLY_WHEN_CLIENT_DIES
$fail_everyone
#endif
              skip
           :: else -> skip fi;
        derive_power()
     fi
  fi;
  before = 0
}

/* the process is gone, and every request it held with it */
inline engine_exits(i) {
  exited[i] = 1;
$reset_ereq
}

/* the client made member x REMOVED itself: it kills and reaps the process, closes its
   channel; a scale waiting for x returns; the client is DEAD if no member is left */
inline removed(x) {
#ifdef BUG_REMOVED_IDENTITY_REUSED
  if :: !exited[x] -> zombie[x] = gen[x] + 1 :: else -> skip fi;
  engine_exits(x); seen[x] = 1;
#else
  engine_exits(x); drain(inq[x]); drain(outq[x]);
#endif
  asleep[x] = 0; mslp[x] = 0;
  if :: sleave == x + 1 || sjoin == x + 1 -> end_scale() :: else -> skip fi;
  if :: client_live && !any_left -> fire_client(CLIENT_E_ENGINE_DIED, G_NONE) :: else -> skip fi;
  derive_power()
}

inline route(i, k, s) {
  if :: !member_routable(i) -> v_dp_routes_to_serving = 1 :: else -> skip fi;
  inq[i]!FRAME(k, s, gen[i])
}

proctype User() {
end: do
  :: atomic { !started -> started = 1 }
  :: atomic { !started -> started = 1; restart_on = 1 }
$user_per_engine
  :: atomic { OWNER_MAY_CALL && pcall == P_NONE && util == NO_UTIL && POWER_MAY_BEGIN
              && client_live && !any_live
              && $any_target && $targets_have_room ->
       budget--;
       if :: scale == SCALE_S_IDLE -> fire_scale(SCALE_E_POWER_BEGIN, G_NONE)
          :: else -> skip fi;
       if :: client_asleep -> pcall = P_WAKE :: else -> pcall = P_SLEEP fi;
$power_route }
#ifdef BUG_POWER_FOLLOWS_COMBINED_REPLY
  :: atomic { pcall != P_NONE && pmask != 0 -> pfail = 1; power_ends() } /* its timeout */
#else
  :: atomic { pcall != P_NONE && pmask != 0 -> power_ends() } /* its timeout */
#endif
$user_scale
#ifdef BUG_JOIN_WAITER_AFTER_EVENT
  :: atomic { scale == SCALE_S_SCALING && sjoin != 0 && !swait -> swait = 1 }
#endif
  :: atomic { OWNER_MAY_CALL && (client_live || client == CLIENT_S_DEAD) ->
       budget--; closing = 1;
$members_shutdown;
       if :: scale == SCALE_S_SCALING -> end_scale() :: else -> skip fi }
  :: atomic { closing && budget > 0 && client == CLIENT_S_SHUTDOWN -> /* again: idempotent */
       budget--; fire_client(CLIENT_E_SHUTDOWN, G_NONE);
$members_shutdown }
  od
}

proctype Client() {
end: do
$kills
  :: atomic { closing && client != CLIENT_S_SHUTDOWN && $all_exited ->
       fire_client(CLIENT_E_SHUTDOWN, G_NONE);
$finish_requests;
       if :: util == UTILITY_S_PENDING -> fire_util(UTILITY_E_CLIENT_SHUTDOWN, G_NONE)
          :: else -> skip fi;
       power_call_over() }
$drain_ends
  od
}

proctype Reader(byte i) {
end: do
  :: atomic { nempty(outq[i]) && member_left(i) && client != CLIENT_S_DEAD
              && client != CLIENT_S_SHUTDOWN && READS(i) ->
       outq[i]?msg; kind = msg & 7; slot = (msg >> 3) & 1;
       if
       :: GEN_OF(msg) != gen[i] -> v_dp_fresh_channel = 1 /* a frame of the predecessor's */
       :: GEN_OF(msg) == gen[i] && (msg & FROM_REMOVED) != 0 ->
          v_dp_removed_engine_silent = 1 /* a removed process's, taken as this tenure's */
       :: else ->
          if
          :: kind == O_HS ->
             fire_mem(i, MEMBERSHIP_E_HANDSHAKE_OK, G_NONE); wake_waiter(i);
             if :: (client == CLIENT_S_CONSTRUCTING && all_routable) || EVERY_HS ->
                   fire_client(CLIENT_E_HANDSHAKE_OK, G_NONE)
                :: else -> skip fi;
#ifdef BUG_REPLAY_ON_RESTART
$replay
#endif
             derive_power()
          :: kind == O_FIN ->
             if :: creq_live(slot) && owns(slot, i) ->
                   fire_creq(slot, CLIENT_REQUEST_E_FINISH_STOP, G_NONE)
                :: else -> v_dp_request_ends_once = 1 fi
          :: kind == O_UREPLY ->
             if :: util == UTILITY_S_PENDING && uown == i -> fire_util(UTILITY_E_REPLY_OK, G_NONE)
                :: else -> v_dp_request_ends_once = 1 fi
          :: kind == O_SLEPT || kind == O_WOKE ->
             /* the member's client follows its engine, in time or late; then the group */
             if :: kind == O_WOKE && slot == 1 -> mslp[i] = 0 :: else -> mslp[i] = 1 fi;
             power_settled(i, (kind == O_WOKE && slot == 0), 0);
             derive_power()
          :: kind == O_DEAD -> notice(i)
          fi
       fi;
       msg = 0; kind = 0; slot = 0 }
  od
}

proctype Monitor(byte i) {
end: do
  :: atomic { exited[i] && !seen[i] && WATCHES(i) -> seen[i] = 1; notice(i) }
  od
}

proctype Engine(byte i) {
end: do
  :: atomic { started && !exited[i] && eng[i] == ENGINE_S_CONSTRUCTING ->
       fire_eng(i, ENGINE_E_BUILT, G_SUBPROCESS); fire_eng(i, ENGINE_E_HANDSHAKE_SENT, G_NONE);
       fire_eng(i, ENGINE_E_LOOP_STARTED, G_NONE); outq[i]!FRAME(O_HS, 0, gen[i]) }
  :: atomic { !exited[i] && nempty(inq[i]) && engine_in_loop(i) && len(outq[i]) < OUT_CAP ->
       inq[i]?msg; kind = msg & 7; slot = (msg >> 3) & 1;
       if
       :: GEN_OF(msg) != gen[i] -> v_dp_fresh_channel = 1 /* a frame sent to the predecessor */
       :: else ->
          if :: kind == I_ADD ->
                fire_ereq(slot, ENGINE_REQUEST_E_ADD, G_NONE);
                if :: eng[i] == ENGINE_S_IDLE -> fire_eng(i, ENGINE_E_WORK_ARRIVED, G_NONE)
                   :: else -> skip fi
             :: kind == I_UTIL -> outq[i]!FRAME(O_UREPLY, 0, gen[i])
             :: kind == I_SLEEP -> asleep[i] = 1; outq[i]!FRAME(O_SLEPT, 0, gen[i])
             :: kind == I_WAKE ->
                if :: asleep[i] -> outq[i]!FRAME(O_WOKE, 0, gen[i]) /* partly: some still asleep */
                   :: true -> asleep[i] = 0; outq[i]!FRAME(O_WOKE, 1, gen[i])
                fi
             fi
       fi;
       msg = 0; kind = 0; slot = 0 }
  :: atomic { !exited[i] && eng[i] == ENGINE_S_RUNNING && len(outq[i]) < OUT_CAP && any_mine(i) ->
       $first_mine;
       fire_ereq(rr, ENGINE_REQUEST_E_SCHEDULE, G_NONE);
       fire_ereq(rr, ENGINE_REQUEST_E_STOP, G_NONE);
       outq[i]!FRAME(O_FIN, rr, gen[i]);
       if :: !busy(i) -> fire_eng(i, ENGINE_E_ALL_FINISHED, G_NONE) :: else -> skip fi;
       rr = 0 }
  od
}

proctype Fault() {
end: do
  :: atomic { started && faults > 0 && !closing -> faults = 0 }
$fault_per_engine
#ifdef BUG_REMOVED_IDENTITY_REUSED
$zombie_per_engine
#endif
  od
}

init {
  d_step {
$table_init
    ti = 0
  };
  atomic {
    run User(); run Client(); run Fault();
$run_per_engine
  }
}

/* ---- properties (properties.py, DP_PROPERTIES) ---------------------------------------- */
$ltl
""")

_USER = r"""  :: atomic { OWNER_MAY_CALL && client_live && ROUTABLE({i}) && len(inq[{i}]) < IN_CAP
              && any_free && pcall == P_NONE ->
       {first_free};
       budget--; fire_client(CLIENT_E_ADD_REQUEST, G_NONE);
       fire_creq(rr, CLIENT_REQUEST_E_SEND, G_NONE); own[rr] = {i}; ogen[rr] = gen[{i}];
       route({i}, I_ADD, rr); rr = 0 }
  :: atomic { OWNER_MAY_CALL && util == NO_UTIL && pcall == P_NONE && client_live
              && ROUTABLE({i}) && len(inq[{i}]) < IN_CAP ->
       budget--; util = UTILITY_S_PENDING; uown = {i}; ugen = gen[{i}]; route({i}, I_UTIL, 0) }"""

_SCALE = r"""  :: atomic {{ MAY_SCALE && member_in_set({i}) && member_in_set({j}) ->
       budget--; fire_scale(SCALE_E_BEGIN, G_NONE); sleave = {i} + 1;
       if :: mem[{i}] == MEMBERSHIP_S_SERVING -> fire_mem({i}, MEMBERSHIP_E_LEAVE, G_NONE);
             derive_power()
          :: else -> fire_mem({i}, MEMBERSHIP_E_REMOVE, G_NONE); removed({i})
       fi }}
  :: atomic {{ MAY_SCALE && mem[{i}] == MEMBERSHIP_S_REMOVED ->
       budget--; fire_scale(SCALE_E_BEGIN, G_NONE); mem[{i}] = MEMBERSHIP_S_STARTING;
       NEW_IDENTITY({i}); eng[{i}] = ENGINE_S_CONSTRUCTING; exited[{i}] = 0; seen[{i}] = 0;
       sjoin = {i} + 1; swait = ARMED_AT_START }}
  :: atomic {{ sjoin == {i} + 1 && swait && mem[{i}] == MEMBERSHIP_S_STARTING ->
       fire_mem({i}, MEMBERSHIP_E_REMOVE, G_NONE); removed({i}) }}"""

_DRAIN = r"""  :: atomic {{ mem[{i}] == MEMBERSHIP_S_DRAINING ->
#ifndef BUG_DEADLINE_FORGETS_LIVE
{abort_live}
       if :: util == UTILITY_S_PENDING && calls({i}) -> fire_util(UTILITY_E_ENGINE_DIED, G_NONE)
          :: else -> skip fi;
#endif
       fire_mem({i}, MEMBERSHIP_E_DRAINED, G_NONE); removed({i}) }}"""

_ZOMBIE = r"""  :: atomic {{ zombie[{i}] != 0 && member_left({i}) && len(outq[{i}]) < OUT_CAP ->
       outq[{i}]!(FRAME(O_HS, 0, zombie[{i}] - 1) | FROM_REMOVED); zombie[{i}] = 0 }}"""

_FAULT = r"""  :: atomic {{ started && faults > 0 && !closing && !exited[{i}] ->
       faults--; engine_exits({i}) }}
  :: atomic {{ started && faults > 0 && !closing && !exited[{i}] && engine_in_loop({i}) ->
       faults--; fire_eng({i}, ENGINE_E_FATAL_ERROR, G_NONE); outq[{i}]!FRAME(O_DEAD, 0, gen[{i}]);
       engine_exits({i}) }}"""


def render_promela_dp() -> str:
    """The whole ``enginewire_dp.pml`` text, deterministic, with its AUTOGENERATED header."""
    fire: list[str] = []
    init: list[str] = []
    for mach, var, indexed in _VARS:
        fire += fire_inline(mach, var, indexed=indexed, flag=_FLAG)
        fire.append("")
        init += table_init(mach, var)
    # The zero-initialised arrays start in each machine's initial state.
    for mach, var, indexed in _VARS:
        if indexed and mach.state_members().index(mach.initial) != 0:
            raise ValueError(f"{var}[] starts at 0, but {mach.name} starts elsewhere")
    first_free = _first("creq_free({k})", "rr", dp.REQS)
    user = "\n".join(
        _USER.replace("{first_free}", first_free).replace("{i}", str(i)) for i in range(dp.N))
    subst = {
        "fire_inlines": "\n".join(fire),
        "table_init": "\n".join(init),
        "fail_owned": "\n".join(
            f"  if :: creq_live({r}) && (EVERYONE || owns({r}, dead)) ->\n"
            f"        if :: !owns({r}, dead) -> v_dp_death_fails_its_own = 1 :: else -> skip fi;\n"
            f"        fire_creq({r}, CLIENT_REQUEST_E_ENGINE_DIED, G_NONE)\n"
            "     :: else -> skip fi;" for r in range(dp.REQS)),
        "fail_everyone": "\n".join(f"              fail_owned({i});" for i in range(dp.N)),
        "construction_failed": "\n".join(
            f"        fire_mem({i}, MEMBERSHIP_E_SHUTDOWN, G_NONE); exited[{i}] = 1;"
            f" drain(inq[{i}]); drain(outq[{i}]);" for i in range(dp.N)) + "\n        skip",
        "reset_ereq": _per_req(
            "  if :: owns({r}, i) -> ereq[{r}] = ENGINE_REQUEST_S_UNKNOWN :: else -> skip fi"),
        "user_per_engine": user,
        "any_target": "(" + " || ".join(f"ROUTABLE({i})" for i in range(dp.N)) + ")",
        "targets_have_room": "(" + " && ".join(
            f"(!ROUTABLE({i}) || len(inq[{i}]) < IN_CAP)" for i in range(dp.N)) + ")",
        "power_route": ";\n".join(
            f"       if :: ROUTABLE({i}) -> pmask = pmask | {1 << i};"
            f" route({i}, (pcall == P_SLEEP -> I_SLEEP : I_WAKE), 0) :: else -> skip fi"
            for i in range(dp.N)),
        "members_shutdown": _per_engine(
            "       fire_mem({i}, MEMBERSHIP_E_SHUTDOWN, G_NONE)"),
        "kills": "\n".join(
            f"  :: atomic {{ closing && !exited[{i}] -> exited[{i}] = 1 }}" for i in range(dp.N)),
        "all_exited": " && ".join(f"exited[{i}]" for i in range(dp.N)),
        "finish_requests": _per_req(
            "       if :: creq_live({r}) -> fire_creq({r}, CLIENT_REQUEST_E_FINISH_ERROR, G_NONE)"
            " :: else -> skip fi"),
        "replay": "\n".join(
            f"             if :: creq[{r}] == CLIENT_REQUEST_S_FINISHED_ERROR && own[{r}] == i\n"
            f"                   && ogen[{r}] + 1 == gen[i] && len(inq[i]) < IN_CAP ->\n"
            f"                   ogen[{r}] = gen[i]; inq[i]!FRAME(I_ADD, {r}, gen[i])\n"
            "                :: else -> skip fi;" for r in range(dp.REQS)),
        "first_mine": _first("mine({k}, i)", "rr", dp.REQS),
        "fault_per_engine": "\n".join(
            _FAULT.format(i=i) for i in range(dp.N)),
        "user_scale": "\n".join(_SCALE.format(i=i, j=1 - i) for i in range(dp.N)),
        "drain_ends": "\n".join(_DRAIN.format(i=i, abort_live="\n".join(
            f"       if :: creq_live({r}) && owns({r}, {i}) ->"
            f" fire_creq({r}, CLIENT_REQUEST_E_FINISH_ABORT, G_NONE) :: else -> skip fi;"
            for r in range(dp.REQS))) for i in range(dp.N)),
        "zombie_per_engine": "\n".join(_ZOMBIE.format(i=i) for i in range(dp.N)),
        "run_per_engine": "\n".join(
            f"    run Engine({i}); run Reader({i}); run Monitor({i});" for i in range(dp.N)),
        "ltl": ltl_blocks(DP_PROPERTIES),
    }
    body = "\n".join([*defines(), "", *_constants()]) + _TEMPLATE.substitute(subst)
    machines = [mach for mach in MACHINES if any(mach is v[0] for v in _VARS)]
    return finish_promela(body, machines, "enginewire_dp.pml",
                          "enginewire.spec.compose_dp.BUGS", NFAIR)

