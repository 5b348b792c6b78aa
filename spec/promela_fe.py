"""The Promela model of the front-end composition (``compose_fe.py``); pure text, no I/O.

Theory of operation
-------------------
Rule 1: the protocol part is ``promela.py``'s: the same ``#define`` per state, event and
guard, and one ``fire_<var>`` inline per machine reading a constant array filled from the
table rows; a machine held once per front end, engine or channel is an array and its inline
takes the index first (``fire_sess(c, ev, g)``, channel ``c = f * N + i``).
Rule 2: the environment mirrors ``compose_fe.py`` action for action, one ``atomic`` arm per
action: the owners and the fault injector are one proctype each, every channel has its
client-side reader (``Reader(f, i)``: outputs, and the engine's death as that front end sees
it) and every engine its process (``Engine(i)``: input from both channels, finishes, the
front ends' losses), so SPIN's weak fairness is fairness between them. A frame is a byte on
a Promela channel one frame above its cap (the restart's ATTACH, a notice or an abort's
finish go past it, as in the Python model). Negative controls are ``#ifdef BUG_<NAME>``.
"""

from __future__ import annotations

from string import Template

from . import MACHINES
from . import compose_fe as fe
from .client import CLIENT
from .engine import ENGINE
from .promela import defines, finish_promela, fire_inline, ltl_blocks, table_init
from .properties import FE_PROPERTIES
from .request import CLIENT_REQUEST, ENGINE_REQUEST
from .session import SESSION
from .utility import UTILITY

__all__ = ["NFAIR", "render_promela_fe"]

# pan's fairness bound: nine processes (four readers, two engines, the owners, the fault
# injector and init) and the claim.
NFAIR = 4

# (machine, Promela variable, held per index?)
_VARS = (
    (CLIENT, "client", True),
    (ENGINE, "eng", True),
    (SESSION, "sess", True),
    (ENGINE_REQUEST, "ereq", True),
    (CLIENT_REQUEST, "creq", True),
    (UTILITY, "util", False),
)
_FLAG = "v_fe_spec_conformance"


def _indexed_macro(name: str, var: str, ixs: frozenset[int]) -> str:
    return f"#define {name}(x) (" + " || ".join(
        f"{var}[x] == {k}" for k in sorted(ixs)) + ")"


def _constants() -> list[str]:
    out = [
        f"#define F {fe.F}",
        f"#define N {fe.N}",
        f"#define NCH {fe.F * fe.N}",
        f"#define BUDGET {fe.BUDGET}",
        f"#define FAULTS {fe.FAULTS}",
        f"#define IN_CAP {fe.IN_CAP}",
        f"#define OUT_CAP {fe.OUT_CAP}",
        f"#define NO_UTIL {fe.NO_UTIL}",
        f"#define UTIL_GONE {fe.UTIL_GONE}",
        f"#define P_NONE {fe.P_NONE}",
        f"#define P_SLEEP {fe.P_SLEEP}",
        f"#define P_WAKE {fe.P_WAKE}",
        f"#define POWER_FE {fe.POWER_FE}",
    ]
    out += [f"#define I_{name} {k + 1}" for k, name in enumerate(fe.IN_MSGS)]
    out += [f"#define O_{name} {k + 1}" for k, name in enumerate(fe.OUT_MSGS)]
    out += [
        "#define FRAME(k, f, g, x) ((k) | ((f) << 4) | ((g) << 5) | ((x) << 6))",
        "#define CH(f, i) ((f) * N + (i))",
        _indexed_macro("client_live_fe", "client", fe.C_LIVE),
        _indexed_macro("client_asleep_fe", "client", fe.C_ASLEEP),
        _indexed_macro("creq_live", "creq", fe.Q_LIVE),
        _indexed_macro("creq_free", "creq", fe.Q_FREE),
        _indexed_macro("creq_abortable", "creq", fe.Q_ABORTABLE),
        _indexed_macro("ereq_live", "ereq", fe.R_LIVE),
        _indexed_macro("engine_in_loop", "eng", fe.E_LOOP),
        _indexed_macro("served", "sess", fe.S_SERVED),
        _indexed_macro("session_drops", "sess", fe.S_DROPS),
        "#define attending(f) (!fdead[f] && client[f] != CLIENT_S_DEAD"
        " && client[f] != CLIENT_S_SHUTDOWN)",
        "#define MAY_CALL(f) (budget > 0 && !fdead[f] && client_live_fe(f))",
        "#define ROOM(f, i) (!knows[CH(f, i)] && len(inq[CH(f, i)]) < IN_CAP)",
        "#define asleep_view(f) (" + " || ".join(
            f"(view[CH(f, {i})] && !knows[CH(f, {i})])" for i in range(fe.N)) + ")",
        "#define any_live_at(i) (" + " || ".join(
            f"ereq_live(CH({g}, i))" for g in range(fe.F)) + ")",
    ]
    return out


_TEMPLATE = Template(r"""
/* ---- the composed world (compose_fe.FIELDS) ------------------------------------------- */
byte budget; byte faults; short util = NO_UTIL; byte ucall; byte pcall; byte pmask;
byte client[F]; bit fgen[F]; bit fdead[F]; byte creq[F]; byte own[F];
chan inq[NCH] = [IN_CAP + 1] of { byte };  /* a restart's ATTACH goes past the cap */
chan outq[NCH] = [OUT_CAP + 1] of { byte }; /* a notice or an abort's finish too */
byte sess[NCH]; bit sgen[NCH]; byte signs[NCH]; byte ereq[NCH]; bit egen[NCH];
bit marked[NCH]; bit view[NCH]; bit knows[NCH];
byte eng[N]; bit exited[N]; bit asleep[N];
/* safety flags set by the model where a property is a statement about one step */
bit v_fe_spec_conformance; bit v_fe_no_cross_delivery; bit v_fe_death_ends_own;
bit v_fe_request_ends_once;
/* scratch, reset to 0 after every use so it does not split states */
byte msg; byte kind; byte mfe; byte minc; byte mx; byte tt; byte before; byte nxt; bit live;
hidden short ti;

$fire_inlines

/* where engine i sends session f's replies, and its request's outputs */
#if defined(BUG_OUTPUTS_TO_FRONT_END_0)
#define TGT(i, f) 0
#define TGT_REQ(i, f) 0
#elif defined(BUG_IDS_NOT_SCOPED)
#define TGT(i, f) (f)
#define TGT_REQ(i, f) (((f) == 0 || ereq_live(CH(0, i))) -> 0 : 1)
#else
#define TGT(i, f) (f)
#define TGT_REQ(i, f) (f)
#endif
#ifdef BUG_DEATH_ENDS_EVERY_FRONT_END
#define EVERY 1
#else
#define EVERY 0
#endif
#ifdef BUG_DEAD_CHANNEL_READ
#define READS_DEAD 1
#else
#define READS_DEAD 0
#endif
#ifdef BUG_DEATH_SEEN_BY_ONE
#define SEES(f) ((f) == 0)
#else
#define SEES(f) 1
#endif

inline settle(i) {
  if :: eng[i] == ENGINE_S_RUNNING && !any_live_at(i) -> fire_eng(i, ENGINE_E_ALL_FINISHED, G_NONE)
     :: else -> skip fi
}

/* session f's work in engine i ends: its request aborted, no output */
inline end_work(i, f) {
#ifndef BUG_DEAD_WORK_LEFT_RUNNING
$end_work
  settle(i);
#endif
  skip
}

/* engine i sends session f's output or reply: only to a served session */
inline send(i, f, k, g, x, req) {
  if :: req -> tt = TGT_REQ(i, f) :: else -> tt = TGT(i, f) fi;
  if :: served(CH(tt, i)) -> outq[CH(tt, i)]!FRAME(k, f, g, x) :: else -> skip fi;
  tt = 0
}

/* a sleep or wake-up: the reply to the caller, a notice to every other served session */
inline power(i, f, k, g) {
  asleep[i] = (k == O_SLEPT);
  send(i, f, k, g, 0, 0);
#ifndef BUG_POWER_NOTICE_NOT_SENT
$notices
#endif
  skip
}

/* the client's state from its engines' views: asleep while any is; constructed only */
inline derive_power(f) {
  if :: client_live_fe(f) ->
        if :: asleep_view(f) && !client_asleep_fe(f) -> fire_client(f, CLIENT_E_SLEEP_ACKED, G_NONE)
           :: !asleep_view(f) && client_asleep_fe(f) ->
              fire_client(f, CLIENT_E_WAKE_ACKED, G_FULLY_AWAKE)
           :: else -> skip fi
     :: else -> skip fi
}

inline power_settled(f, i) {
  if :: f == POWER_FE && (pmask & (1 << i)) != 0 ->
        pmask = pmask & (~(1 << i));
        if :: pmask == 0 -> pcall = P_NONE :: else -> skip fi
     :: else -> skip fi
}

inline drain(ch) { do :: ch?msg :: empty(ch) -> break od; msg = 0 }

/* front end f reads msg (decoded into kind, mfe, minc, mx) from engine i */
inline read_msg(f, i) {
  live = (mfe == f && minc == fgen[f]);
  if
  :: !marked[CH(f, i)] -> /* before its marker: everything but its own answer is dropped */
     if :: live && kind == O_MARKER ->
           marked[CH(f, i)] = 1; view[CH(f, i)] = mx;
           if :: client[f] == CLIENT_S_CONSTRUCTING && $all_marked ->
                 fire_client(f, CLIENT_E_HANDSHAKE_OK, G_NONE)
              :: else -> skip fi;
           derive_power(f)
        :: live && kind == O_REFUSAL && client[f] == CLIENT_S_CONSTRUCTING ->
           fire_client(f, CLIENT_E_CONSTRUCTION_FAILED, G_NONE)
        :: else -> skip fi
  :: else ->
     if :: !live -> v_fe_no_cross_delivery = 1
        :: live && kind == O_FIN ->
           if :: creq_live(f) && own[f] == i ->
                 if :: mx -> fire_creq(f, CLIENT_REQUEST_E_FINISH_ABORT, G_NONE)
                    :: else -> fire_creq(f, CLIENT_REQUEST_E_FINISH_STOP, G_NONE) fi
              :: else -> v_fe_request_ends_once = 1 fi
        :: live && kind == O_UREPLY ->
           if :: util == UTILITY_S_PENDING && ucall == f -> fire_util(UTILITY_E_REPLY_OK, G_NONE)
              :: else -> v_fe_request_ends_once = 1 fi
        :: live && (kind == O_SLEPT || kind == O_WOKE) -> /* a reply, or a notice */
           view[CH(f, i)] = (kind == O_SLEPT);
           power_settled(f, i);
#ifdef BUG_NOTICE_BEFORE_READY
           if :: kind == O_SLEPT -> fire_client(f, CLIENT_E_SLEEP_ACKED, G_NONE)
              :: else -> fire_client(f, CLIENT_E_WAKE_ACKED, G_FULLY_AWAKE) fi;
#endif
           derive_power(f)
        :: else -> skip
     fi
  fi;
  live = 0
}

inline decode() {
  kind = msg & 15; mfe = (msg >> 4) & 1; minc = (msg >> 5) & 1; mx = (msg >> 6) & 1
}
inline clear() { msg = 0; kind = 0; mfe = 0; minc = 0; mx = 0 }

proctype User() {
end: do
$user
  od
}

proctype Reader(byte f; byte i) {
end: do
  :: atomic { nempty(outq[CH(f, i)]) && attending(f) && (!knows[CH(f, i)] || READS_DEAD) ->
       outq[CH(f, i)]?msg; decode(); read_msg(f, i); clear() }
  :: atomic { exited[i] && !knows[CH(f, i)] && attending(f) && SEES(f) ->
       knows[CH(f, i)] = 1;
       if :: client[f] == CLIENT_S_CONSTRUCTING ->
             fire_client(f, CLIENT_E_CONSTRUCTION_FAILED, G_NONE)
          :: else ->
             if :: creq_live(f) && own[f] == i -> fire_creq(f, CLIENT_REQUEST_E_ENGINE_DIED, G_NONE)
                :: else -> skip fi;
             if :: util == UTILITY_S_PENDING && ucall == f && i == 0 ->
                   fire_util(UTILITY_E_ENGINE_DIED, G_NONE)
                :: else -> skip fi;
             power_settled(f, i)
       fi;
#ifndef BUG_DEAD_CHANNEL_READ
       drain(outq[CH(f, i)]);
#endif
       view[CH(f, i)] = 0;
       derive_power(f) }
  od
}

proctype Engine(byte i) {
end: do
$engine
  od
}

proctype Fault() {
end: do
  :: atomic { faults > 0 -> faults = 0 }
$fault
  od
}

init {
  d_step {
$table_init
    ti = 0;
$initial
  };
  atomic {
    run User(); run Fault();
$run
  }
}

/* ---- properties (properties.py, FE_PROPERTIES) ---------------------------------------- */
$ltl
""")

_ADD = r"""  :: atomic {{ MAY_CALL({f}) && creq_free({f}) && ROOM({f}, {i}) ->
       budget--; fire_client({f}, CLIENT_E_ADD_REQUEST, G_NONE);
       fire_creq({f}, CLIENT_REQUEST_E_SEND, G_NONE); own[{f}] = {i};
       inq[CH({f}, {i})]!FRAME(I_ADD, {f}, fgen[{f}], 0) }}"""

_PER_FE = r"""  :: atomic {{ MAY_CALL({f}) && creq_abortable({f}) && ROOM({f}, own[{f}]) ->
       budget--; fire_creq({f}, CLIENT_REQUEST_E_ABORT_SENT, G_NONE);
       inq[CH({f}, own[{f}])]!FRAME(I_ABORT, {f}, fgen[{f}], 0) }}
  :: atomic {{ MAY_CALL({f}) && util == NO_UTIL && ROOM({f}, 0) ->
       budget--; util = UTILITY_S_PENDING; ucall = {f};
       inq[CH({f}, 0)]!FRAME(I_UTIL, {f}, fgen[{f}], 0) }}"""

_RECEIVE = r"""  :: atomic {{ nempty(inq[{c}]) && !exited[i] && engine_in_loop(i)
              && len(outq[{c}]) < OUT_CAP ->
       inq[{c}]?msg; decode();
       if
       :: kind == I_ATTACH && mx != {f} -> /* not its index: nobody disturbed */
          fire_sess({c}, SESSION_E_ATTACH_MISPLACED, G_NONE);
          outq[{c}]!FRAME(O_REFUSAL, {f}, minc, 0)
       :: kind == I_ATTACH && mx == {f} ->
          if :: sess[{c}] == SESSION_S_ATTACHED -> end_work(i, {f}) :: else -> skip fi;
          sgen[{c}] = minc; signs[{c}] = 0;
          fire_sess({c}, SESSION_E_ATTACH_ACCEPTED, G_NONE);
          outq[{c}]!FRAME(O_MARKER, {f}, minc, asleep[i])
       :: kind != I_ATTACH && (session_drops({c}) || sess[{c}] == SESSION_S_NO_FRONT_END) ->
          skip /* dropped unread */
       :: kind == I_ADD && sess[{c}] == SESSION_S_ATTACHED ->
          fire_ereq({c}, ENGINE_REQUEST_E_ADD, G_NONE); egen[{c}] = sgen[{c}];
          if :: eng[i] == ENGINE_S_IDLE -> fire_eng(i, ENGINE_E_WORK_ARRIVED, G_NONE)
             :: else -> skip fi
       :: kind == I_ABORT && sess[{c}] == SESSION_S_ATTACHED ->
          live = ereq_live({c});
          fire_ereq({c}, ENGINE_REQUEST_E_ABORT, G_NONE); /* unknown or finished: a no-op */
          if :: live -> send(i, {f}, O_FIN, egen[{c}], 1, 1); settle(i) :: else -> skip fi;
          live = 0
       :: kind == I_UTIL && sess[{c}] == SESSION_S_ATTACHED ->
          send(i, {f}, O_UREPLY, sgen[{c}], 0, 0)
       :: kind == I_SLEEP && sess[{c}] == SESSION_S_ATTACHED -> power(i, {f}, O_SLEPT, sgen[{c}])
       :: kind == I_WAKE && sess[{c}] == SESSION_S_ATTACHED -> power(i, {f}, O_WOKE, sgen[{c}])
       fi;
       clear() }}
  :: atomic {{ ereq[{c}] == ENGINE_REQUEST_S_WAITING && eng[i] == ENGINE_S_RUNNING && !exited[i]
              && !asleep[i]
              && (!served(CH(TGT_REQ(i, {f}), i)) || len(outq[CH(TGT_REQ(i, {f}), i)]) < OUT_CAP) ->
       tt = TGT_REQ(i, {f});
       fire_ereq({c}, ENGINE_REQUEST_E_SCHEDULE, G_NONE);
       fire_ereq({c}, ENGINE_REQUEST_E_STOP, G_NONE);
       if :: served(CH(tt, i)) -> outq[CH(tt, i)]!FRAME(O_FIN, {f}, egen[{c}], 0)
          :: else -> skip fi;
       tt = 0; settle(i) }}
  :: atomic {{ (fdead[{f}] || sgen[{c}] != fgen[{f}]) && !exited[i] && engine_in_loop(i)
              && ((sess[{c}] == SESSION_S_ATTACHED && signs[{c}] == 0)
                  || (sess[{c}] == SESSION_S_GONE && signs[{c}] == 1)) ->
       before = sess[{c}]; fire_sess({c}, SESSION_E_FRONT_END_GONE, G_NONE); signs[{c}]++;
       if :: before == SESSION_S_ATTACHED -> end_work(i, {f}) :: else -> skip fi;
       before = 0 }}"""

_FE_DIES = r"""  :: atomic {{ faults > 0 && !fdead[{f}] && client[{f}] != CLIENT_S_SHUTDOWN ->
       faults--; fdead[{f}] = 1;
{drain_out}
       if :: {f} == POWER_FE -> pcall = 0; pmask = 0 :: else -> skip fi;
       if :: util == UTILITY_S_PENDING && ucall == {f} -> util = UTIL_GONE :: else -> skip fi }}"""

_ENGINE_DIES = r"""  :: atomic {{ faults > 0 && !exited[{i}] && engine_in_loop({i}) ->
       faults--; fire_eng({i}, ENGINE_E_FATAL_ERROR, G_NONE); exited[{i}] = 1; asleep[{i}] = 0;
{gone}
       skip }}"""

_RESTART = r"""  :: atomic {{ fdead[{f}] ->
       fdead[{f}] = 0; fgen[{f}] = 1; client[{f}] = CLIENT_S_CONSTRUCTING;
       creq[{f}] = CLIENT_REQUEST_S_UNKNOWN; own[{f}] = 0;
{attach} }}"""


def render_promela_fe() -> str:
    """The whole ``enginewire_fe.pml`` text, deterministic, with its AUTOGENERATED header."""
    fire: list[str] = []
    init: list[str] = []
    for mach, var, indexed in _VARS:
        fire += fire_inline(mach, var, indexed=indexed, flag=_FLAG)
        fire.append("")
        init += table_init(mach, var)
    F, N = fe.F, fe.N
    chans = [(f, i, fe.ch(f, i)) for f in range(F) for i in range(N)]
    user = [_ADD.format(f=f, i=i) for f, i, _c in chans]
    user += [_PER_FE.format(f=f) for f in range(F)]
    p = fe.POWER_FE
    power_targets = " || ".join(f"!knows[CH({p}, {i})]" for i in range(N))
    power_room = " && ".join(f"(knows[CH({p}, {i})] || ROOM({p}, {i}))" for i in range(N))
    power_route = ";\n".join(
        f"       if :: !knows[CH({p}, {i})] -> pmask = pmask | {1 << i};\n"
        f"             inq[CH({p}, {i})]!FRAME((pcall == P_WAKE -> I_WAKE : I_SLEEP), {p},"
        f" fgen[{p}], 0)\n"
        "          :: else -> skip fi" for i in range(N))
    user.append(
        f"  :: atomic {{ MAY_CALL({p}) && pcall == P_NONE && ({power_targets})"
        f" && {power_room} ->\n"
        f"       budget--;\n"
        f"       if :: client_asleep_fe({p}) -> pcall = P_WAKE :: else -> pcall = P_SLEEP fi;\n"
        f"{power_route} }}")
    fault = [_FE_DIES.format(f=f, drain_out="\n".join(
        f"       drain(outq[{fe.ch(f, i)}]);" for i in range(N))) for f in range(F)]
    fault += [_ENGINE_DIES.format(i=i, gone="\n".join(
        f"       ereq[{fe.ch(g, i)}] = ENGINE_REQUEST_S_UNKNOWN; drain(inq[{fe.ch(g, i)}]);"
        for g in range(F))) for i in range(N)]
    for f in range(F):
        for index in (f, 1 - f):  # its own index, or a misconfigured one
            fault.append(_RESTART.format(f=f, attach=";\n".join(
                f"       marked[{fe.ch(f, i)}] = 0; view[{fe.ch(f, i)}] = 0;"
                f" knows[{fe.ch(f, i)}] = 0;\n"
                f"       inq[{fe.ch(f, i)}]!FRAME(I_ATTACH, {f}, 1, {index})" for i in range(N))))
    engine_arms: list[str] = []
    for f in range(F):
        c = f"CH({f}, i)"
        engine_arms.append(_RECEIVE.format(f=f, c=c))
    # Engine(i) is one proctype for both engines; each arm's channel is CH(f, i).
    initial = ["    budget = BUDGET; faults = FAULTS; util = NO_UTIL;"]
    for i in range(N):
        initial.append(
            f"    eng[{i}] = ENGINE_S_CONSTRUCTING;"
            f" fire_eng({i}, ENGINE_E_BUILT, G_SUBPROCESS);"
            f" fire_eng({i}, ENGINE_E_HANDSHAKE_SENT, G_NONE);"
            f" fire_eng({i}, ENGINE_E_LOOP_STARTED, G_NONE);")
    for _f, _i, k in chans:
        initial.append(f"    fire_sess({k}, SESSION_E_ATTACH_ACCEPTED, G_NONE); marked[{k}] = 1;")
    for f in range(F):
        initial.append(f"    fire_client({f}, CLIENT_E_HANDSHAKE_OK, G_NONE);")
    end_work = "\n".join(
        f"  if :: ({g} == f || EVERY) && ereq_live(CH({g}, i)) ->\n"
        f"        if :: {g} != f -> v_fe_death_ends_own = 1 :: else -> skip fi;\n"
        f"        fire_ereq(CH({g}, i), ENGINE_REQUEST_E_ABORT, G_NONE)\n"
        "     :: else -> skip fi;" for g in range(F))
    notices = "\n".join(
        f"  if :: {g} != f && served(CH({g}, i)) ->"
        f" outq[CH({g}, i)]!FRAME(k, {g}, sgen[CH({g}, i)], 0)\n"
        "     :: else -> skip fi;" for g in range(F))
    subst = {
        "fire_inlines": "\n".join(fire),
        "table_init": "\n".join(init),
        "initial": "\n".join(initial) + "\n    nxt = 0",
        "end_work": end_work,
        "notices": notices,
        "all_marked": "(" + " && ".join(f"marked[CH(f, {i})]" for i in range(N)) + ")",
        "user": "\n".join(user),
        "engine": "\n".join(engine_arms),
        "fault": "\n".join(fault),
        "run": "\n".join(
            [f"    run Engine({i});" for i in range(N)]
            + [f"    run Reader({f}, {i});" for f, i, _c in chans]),
        "ltl": ltl_blocks(FE_PROPERTIES),
    }
    body = "\n".join([*defines(), "", *_constants()]) + _TEMPLATE.substitute(subst)
    machines = [mach for mach in MACHINES if any(mach is v[0] for v in _VARS)]
    return finish_promela(body, machines, "enginewire_fe.pml",
                          "enginewire.spec.compose_fe.BUGS", NFAIR)
