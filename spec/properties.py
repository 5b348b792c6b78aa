"""The named properties of the composed model, safety apart from liveness.

Theory of operation
-------------------
Rule 1: a *safety* property is an assertion about every reachable world (P's monitors): the
explorer checks it after each step and prints the shortest run that breaks it. A *liveness*
property is a hot obligation ``trigger -> eventually (goal or excuse)``: SPIN checks it as LTL
under weak fairness, and the explorer checks it at every quiescent world (no actor can move),
which is complete here because every action consumes a bounded resource (owner budget, fault
budget, a queued frame, a token) or leaves a state for good (the start-up deadline ends
construction), so the bounded model has no infinite runs.
Rule 2: every property names at least one negative control (``compose.BUGS``) that must break
it, in both checkers; a property that nothing can break is vacuous and fails the check.

Each property carries its Python predicate and its Promela expression side by side, over the
same variables (``compose.FIELDS`` in Python, globals of the same names in Promela).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import _compose_world as m
from . import compose_dp as dp
from . import compose_fe as fe
from .compose import BUGS, World

__all__ = [
    "DP_LIVENESS",
    "DP_PROPERTIES",
    "DP_SAFETY",
    "FE_LIVENESS",
    "FE_PROPERTIES",
    "FE_SAFETY",
    "LIVENESS",
    "PROPERTIES",
    "SAFETY",
    "Property",
    "control_targets",
    "dp_control_targets",
    "fe_control_targets",
]


@dataclass(frozen=True)
class Property:
    name: str
    kind: str  # "safety" | "liveness"
    text: str  # one sentence for reviewers (docs/spec.md)
    controls: tuple[str, ...]  # negative controls that must break it
    promela: str  # the LTL formula (over the Promela globals)
    holds: Callable[[World], bool] | None = None  # safety: the invariant
    trigger: Callable[[World], bool] | None = None  # liveness: the obligation starts
    discharged: Callable[[World], bool] | None = None  # liveness: goal or excuse reached


def _flag(name: str, bad: int = m.BAD) -> Callable[[World], bool]:
    return lambda w: w[bad] != name


def _safety(name: str, text: str, controls: tuple[str, ...], promela: str,
            holds: Callable[[World], bool]) -> Property:
    return Property(name, "safety", text, controls, f"[] ({promela})", holds=holds)


def _live(
    name: str, text: str, controls: tuple[str, ...],
    trigger: tuple[str, Callable[[World], bool]], goal: tuple[str, Callable[[World], bool]],
) -> Property:
    return Property(
        name, "liveness", text, controls, f"[] (({trigger[0]}) -> <> ({goal[0]}))",
        trigger=trigger[1], discharged=goal[1],
    )


_C_DEAD, _C_SHUTDOWN = m.C_DEAD, m.C_SHUTDOWN
_SLEEPY = (m.E_PAUSED, m.E_SLEEPING)
_REPORTS_SLEEPING = " || ".join(f"engine == {e}" for e in sorted(m.E_SLEEPY))
_AWAKE = " || ".join(f"engine == {e}" for e in sorted(m.E_AWAKE))

SAFETY: tuple[Property, ...] = (
    _safety(
        "spec_conformance",
        "Every component only fires events its machine table allows in its current state.",
        ("add_before_ready",),
        "!v_spec_conformance",
        _flag("spec_conformance"),
    ),
    _safety(
        "no_output_after_finish",
        "No output reaches a request after its finishing output (in particular after its "
        "abort was acknowledged).",
        ("abort_ack_before_flush",),
        "!v_no_output_after_finish",
        _flag("no_output_after_finish"),
    ),
    _safety(
        "utility_ends_once",
        "Every utility call ends at most once; a late reply after cancel or timeout is dropped.",
        ("late_reply_resolves",),
        "util_ends <= 1",
        lambda w: w[m.UTIL_ENDS] <= 1,
    ),
    _safety(
        "death_fails_calls",
        "Once the client knows the engine is dead, no utility call is pending and no request "
        "is live: all ended with EngineDeadError, and later calls fail at once.",
        ("forget_pending_on_death",),
        f"client != {_C_DEAD} || (util != {m.U_PENDING} && !creq_live)",
        lambda w: w[m.C] != _C_DEAD or (w[m.UTIL] != m.U_PENDING and w[m.CREQ] not in m.Q_LIVE),
    ),
    _safety(
        "shutdown_reclaims",
        "shutdown() returns only after the engine process it launched has exited and been "
        "reaped (an engine started on its own outlives it).",
        ("shutdown_skips_join",),
        f"client != {_C_SHUTDOWN} || proc_exited || standalone",
        lambda w: w[m.C] != _C_SHUTDOWN or bool(w[m.PROC_EXITED] or w[m.STANDALONE]),
    ),
    _safety(
        "sleep_reply_when_idle",
        "A sleep or pause reply is sent only when the engine is paused or asleep with nothing "
        "running.",
        ("reply_before_drain",),
        "!v_sleep_reply_when_idle",
        _flag("sleep_reply_when_idle"),
    ),
    _safety(
        "is_sleeping_iff",
        "The engine's is_sleeping answer is true exactly when it is draining for a pause, "
        "paused or asleep, or any memory tag is asleep (as in vLLM, a paused scheduler reports "
        "sleeping).",
        ("partial_wake_clears_flag",),
        f"!engine_in_loop || (sleep_flag == ({_REPORTS_SLEEPING} || weights_asleep "
        "|| kv_asleep))",
        lambda w: w[m.E] not in m.E_LOOP
        or bool(w[m.SLEEP_FLAG]) == (w[m.E] in m.E_SLEEPY or bool(w[m.WA]) or bool(w[m.KVA])),
    ),
    _safety(
        "frames_in_order",
        "The engine applies request frames (add, abort) in the order the client sent them.",
        ("input_reorders",),
        "!v_frames_in_order",
        _flag("frames_in_order"),
    ),
    _safety(
        "no_foreign_output",
        "A client never reads an output of a request a previous front end of the same engine "
        "sent, even one with the same id.",
        ("reader_keeps_stale",),
        "!v_no_foreign_output",
        _flag("no_foreign_output"),
    ),
    _safety(
        "session_starts_fresh",
        "When the engine answers an attach, nothing of the previous front end is left: no "
        "request live or parked, nothing asleep, the scheduler idle.",
        ("attach_keeps_work",),
        "!v_session_starts_fresh",
        _flag("session_starts_fresh"),
    ),
)

LIVENESS: tuple[Property, ...] = (
    _live(
        "utility_call_terminates",
        "Every utility call eventually ends (unless the engine hangs or the owner died).",
        ("drop_failed_reply",),
        (f"util == {m.U_PENDING}", lambda w: w[m.UTIL] == m.U_PENDING),
        (f"util != {m.U_PENDING} || hung || parent_dead",
         lambda w: w[m.UTIL] != m.U_PENDING or bool(w[m.HUNG] or w[m.PARENT_DEAD])),
    ),
    _live(
        "request_finishes",
        "Every request eventually gets a finishing output (unless the owner keeps the engine "
        "paused or asleep, the engine hangs, or the owner died).",
        ("abort_unanswered", "session_end_unannounced"),
        ("creq_live", lambda w: w[m.CREQ] in m.Q_LIVE),
        (f"!creq_live || hung || parent_dead || engine == {_SLEEPY[0]} || engine == {_SLEEPY[1]}",
         lambda w: w[m.CREQ] not in m.Q_LIVE or bool(w[m.HUNG] or w[m.PARENT_DEAD])
         or w[m.E] in _SLEEPY),
    ),
    _live(
        "power_call_terminates",
        "Every sleep, pause, wake_up and resume_scheduler call eventually gets its reply, one "
        "per call, a deferred sleep(wait) included (unless the engine hangs or the owner died; "
        "the engine's death and shutdown() fail pending calls).",
        ("cancelled_wait_unanswered",),
        ("power_pending > 0", lambda w: w[m.POWER_PENDING] > 0),
        ("power_pending == 0 || hung || parent_dead",
         lambda w: w[m.POWER_PENDING] == 0 or bool(w[m.HUNG] or w[m.PARENT_DEAD])),
    ),
    _live(
        "awake_when_asked",
        "After the owner asks for a full wake-up (and no sleep or pause since), the engine "
        "eventually schedules again, idle or running, even if a sleep(wait) was still draining "
        "(unless the engine died, exited or hangs, the client declared it dead, or the owner "
        "died).",
        ("wake_ignored_while_draining",),
        ("asked_awake", lambda w: bool(w[m.ASKED_AWAKE])),
        (f"{_AWAKE} || !engine_in_loop || proc_exited || hung || parent_dead "
         f"|| client == {_C_DEAD}",
         lambda w: w[m.E] in m.E_AWAKE or w[m.E] not in m.E_LOOP
         or bool(w[m.PROC_EXITED] or w[m.HUNG] or w[m.PARENT_DEAD]) or w[m.C] == _C_DEAD),
    ),
    _live(
        "construction_ends",
        "The client's constructor always ends, ready or failed, even when the engine hangs "
        "during start-up (the ready deadline fires), unless the owner died.",
        ("no_startup_deadline",),
        (f"client == {m.C_CONSTRUCTING}", lambda w: w[m.C] == m.C_CONSTRUCTING),
        (f"client != {m.C_CONSTRUCTING} || parent_dead",
         lambda w: w[m.C] != m.C_CONSTRUCTING or bool(w[m.PARENT_DEAD])),
    ),
    _live(
        "shutdown_completes",
        "shutdown() always completes and reclaims the engine process it launched, even a hung "
        "one.",
        ("shutdown_no_kill",),
        ("closing", lambda w: bool(w[m.CLOSING])),
        (f"(client == {_C_SHUTDOWN} && (proc_exited || standalone)) || parent_dead",
         lambda w: (w[m.C] == _C_SHUTDOWN and bool(w[m.PROC_EXITED] or w[m.STANDALONE]))
         or bool(w[m.PARENT_DEAD])),
    ),
    _live(
        "death_propagates",
        "If the engine process exits unasked, the client eventually knows it is dead.",
        ("no_monitor",),
        (f"proc_exited && !closing && client != {_C_SHUTDOWN}",
         lambda w: bool(w[m.PROC_EXITED]) and not w[m.CLOSING] and w[m.C] != _C_SHUTDOWN),
        (f"client == {_C_DEAD} || client == {_C_SHUTDOWN} || parent_dead",
         lambda w: w[m.C] in (_C_DEAD, _C_SHUTDOWN) or bool(w[m.PARENT_DEAD])),
    ),
    _live(
        "orphan_reclaimed",
        "If the owner process dies, the engine process it launched eventually exits on its own.",
        ("ignore_parent_death",),
        ("parent_dead && !standalone", lambda w: bool(w[m.PARENT_DEAD]) and not w[m.STANDALONE]),
        # standalone: the engine's first move may come after the owner died
        ("proc_exited || standalone", lambda w: bool(w[m.PROC_EXITED] or w[m.STANDALONE])),
    ),
    _live(
        "attach_completes",
        "After the ready handshake the client eventually reads its attach marker, or knows the "
        "engine is dead (the marker's deadline fires when the engine hangs or the ATTACH was "
        "lost), "
        "or was shut down (unless the owner died).",
        ("no_attach_deadline",),
        ("client_live && attach != ATTACH_S_ATTACHED",
         lambda w: w[m.C] in m.C_LIVE and w[m.ATT] != m.A_ATTACHED),
        (f"attach == ATTACH_S_ATTACHED || client == {_C_DEAD} || client == {_C_SHUTDOWN}"
         " || parent_dead",
         lambda w: w[m.ATT] == m.A_ATTACHED or w[m.C] in (_C_DEAD, _C_SHUTDOWN)
         or bool(w[m.PARENT_DEAD])),
    ),
    _live(
        "left_behind_aborted",
        "A client that shuts down while an engine started on its own still runs one of its "
        "requests has it aborted there: the engine does not go on working for nobody, even "
        "with the request parked by a pause (unless the engine hangs or exits, or the owner "
        "died).",
        ("shutdown_leaves_work",),
        ("left_work && ereq_live", lambda w: bool(w[m.LEFT]) and w[m.EREQ] in m.R_LIVE),
        ("!ereq_live || hung || proc_exited || parent_dead",
         lambda w: w[m.EREQ] not in m.R_LIVE
         or bool(w[m.HUNG] or w[m.PROC_EXITED] or w[m.PARENT_DEAD])),
    ),
)

PROPERTIES: tuple[Property, ...] = SAFETY + LIVENESS



# ---- the two-engine model (compose_dp.py) ----------------------------------------------------
# In Promela the per-engine and per-request fields are arrays (``mem[i]``, ``creq[r]``); the
# macros ``creq_live(r)``, ``member_left(i)`` ... are generated from the same named sets.

_OWNS_LIVE = (dp.M_SERVING, dp.M_DRAINING, dp.M_SHUT_DOWN)


def _settled(w: World, gen: int, owner: int) -> bool:
    """A live request or pending call is its engine's current incarnation's, and that engine
    is serving or draining (or being shut down, which fails it at the end)."""
    return bool(w[dp.GEN[owner]] == gen and w[dp.MEM[owner]] in _OWNS_LIVE)


def _none_left_behind(w: World) -> bool:
    for r in range(dp.REQS):
        if w[dp.CREQ[r]] in dp.Q_LIVE and not _settled(w, w[dp.OGEN[r]], w[dp.OWN[r]]):
            return False
    return w[dp.UTIL] != dp.U_PENDING or _settled(w, w[dp.UGEN], w[dp.UOWN])


def _any_left(w: World) -> bool:
    return any(w[dp.MEM[i]] in dp.M_LEFT for i in range(dp.N))


def _each(fmt: str, n: int, join: str) -> str:
    return "(" + f" {join} ".join(fmt.format(i=i) for i in range(n)) + ")"


_DP_SETTLED = (
    "(gen[{own}] == {gen} && (mem[{own}] == MEMBERSHIP_S_SERVING "
    "|| mem[{own}] == MEMBERSHIP_S_DRAINING || mem[{own}] == MEMBERSHIP_S_SHUT_DOWN))"
)
_DP_NONE_LEFT_BEHIND = " && ".join(
    [f"(!creq_live({r}) || " + _DP_SETTLED.format(own=f"own[{r}]", gen=f"ogen[{r}]") + ")"
     for r in range(dp.REQS)]
    + [f"(util != {dp.U_PENDING} || " + _DP_SETTLED.format(own="uown", gen="ugen") + ")"]
)
_DP_ANY_LEFT = _each("member_left({i})", dp.N, "||")
_DP_ANY_LIVE = _each("creq_live({i})", dp.REQS, "||")
_DP_ANY_RESTARTING = _each("mem[{i}] == MEMBERSHIP_S_RESTARTING", dp.N, "||")


def _removed_owes_nothing(w: World) -> bool:
    """No live request or pending call belongs to an engine whose member is REMOVED."""
    for r in range(dp.REQS):
        if w[dp.CREQ[r]] in dp.Q_LIVE and w[dp.MEM[w[dp.OWN[r]]]] == dp.M_REMOVED:
            return False
    return bool(w[dp.UTIL] != dp.U_PENDING or w[dp.MEM[w[dp.UOWN]]] != dp.M_REMOVED)


_DP_REMOVED_OWES_NOTHING = " && ".join(
    [f"!(creq_live({r}) && mem[own[{r}]] == MEMBERSHIP_S_REMOVED)" for r in range(dp.REQS)]
    + [f"!(util == {dp.U_PENDING} && mem[uown] == MEMBERSHIP_S_REMOVED)"]
)


def _power_follows(w: World) -> bool:
    serving = [i for i in range(dp.N) if w[dp.MEM[i]] in dp.M_ROUTABLE]
    if w[dp.C] not in dp.C_LIVE or not serving:
        return True
    return (w[dp.C] in dp.C_ASLEEP) == any(w[dp.MSLP[i]] for i in serving)


_DP_ANY_SERVING_ASLEEP = _each("(member_routable({i}) && mslp[{i}])", dp.N, "||")
_DP_ANY_SERVING = _each("member_routable({i})", dp.N, "||")


def _dp_flag(name: str) -> Callable[[World], bool]:
    return _flag(name, dp.BAD)


DP_SAFETY: tuple[Property, ...] = (
    _safety(
        "dp_spec_conformance",
        "Every component of the two-engine model only fires events its machine table allows "
        "(a membership event included).",
        ("every_handshake_readies_client",),
        "!v_dp_spec_conformance",
        _dp_flag("dp_spec_conformance"),
    ),
    _safety(
        "dp_death_fails_its_own",
        "The loss of one engine fails exactly its own live requests and pending calls: none "
        "of another engine is failed, and none of the dead one is left live or pending once "
        "the client knows (or after it was replaced).",
        ("death_fails_every_engine", "fail_only_when_client_dies"),
        f"!v_dp_death_fails_its_own && {_DP_NONE_LEFT_BEHIND}",
        lambda w: w[dp.BAD] != "dp_death_fails_its_own" and _none_left_behind(w),
    ),
    _safety(
        "dp_routes_to_serving",
        "A request or utility call is only ever sent to an engine whose member is serving "
        "(MEMBER_ROUTABLE), never to a dead, starting (a joiner too) or restarting one, nor to "
        "a leaver once it drains.",
        ("route_to_restarting", "route_to_leaver"),
        "!v_dp_routes_to_serving",
        _dp_flag("dp_routes_to_serving"),
    ),
    _safety(
        "dp_request_ends_once",
        "No request or call ends twice: no finish or reply reaches one that already ended, "
        "with an error by its engine's death or otherwise (requests that died are not "
        "replayed).",
        ("replay_on_restart",),
        "!v_dp_request_ends_once",
        _dp_flag("dp_request_ends_once"),
    ),
    _safety(
        "dp_fresh_channel",
        "A replacement engine reads no frame sent to its predecessor, and the client reads no "
        "frame of the predecessor as the replacement's: each incarnation has a channel of its "
        "own.",
        ("restart_reuses_channel",),
        "!v_dp_fresh_channel",
        _dp_flag("dp_fresh_channel"),
    ),
    _safety(
        "dp_client_dead_iff_none_left",
        "The client is DEAD only when no member is left (MEMBER_LEFT is empty), and a "
        "constructed client that is not shutting down is DEAD once none is (a draining "
        "leaver still counts).",
        ("client_dies_with_first_member", "draining_not_counted"),
        f"(client != {dp.C_DEAD} || !{_DP_ANY_LEFT}) && (!client_live || closing "
        f"|| {_DP_ANY_LEFT})",
        lambda w: (w[dp.C] != dp.C_DEAD or not _any_left(w))
        and (w[dp.C] not in dp.C_LIVE or bool(w[dp.CLOSING]) or _any_left(w)),
    ),
    _safety(
        "dp_power_follows_engines",
        "A live client with a serving engine is asleep (CLIENT_ASLEEP) exactly while one of "
        "its serving engines' clients is, whatever became of its power calls (a reply after "
        "the caller gave up, a target lost during the call, a replacement that starts awake).",
        ("power_follows_combined_reply",),
        f"(!client_live || !{_DP_ANY_SERVING} || (client_asleep == {_DP_ANY_SERVING_ASLEEP}))",
        _power_follows,
    ),
    _safety(
        "dp_leaver_work_ends",
        "Every request and call an engine accepted has ended by the time its member is "
        "REMOVED, however it left: finished by the engine while it drained, with ABORT (and "
        "EngineDeadError for the call) at the drain deadline, or with ERROR if it died "
        "(exactly once: a second end has no row in the request and utility tables).",
        ("deadline_forgets_live",),
        _DP_REMOVED_OWES_NOTHING,
        _removed_owes_nothing,
    ),
    _safety(
        "dp_removed_engine_silent",
        "No frame of a removed engine is accepted: after a scale-down its process is reaped "
        "before its member is REMOVED, and an index that joins again has a new identity and "
        "channel, so nothing of the earlier tenure is taken as the joiner's (vLLM #37357).",
        ("removed_identity_reused",),
        "!v_dp_removed_engine_silent",
        _dp_flag("dp_removed_engine_silent"),
    ),    _safety(
        "dp_power_beside_no_scale",
        "A power call (sleep, wake-up, pause, resume) never runs beside a scale: each refuses "
        "the other (SCALE), since a joiner starts awake and a leaver drains awake, so a "
        "power call racing a scale would leave the group neither asleep nor awake.",
        ("power_beside_scale",),
        f"!(pcall != P_NONE && scale == {dp.S_SCALING})",
        lambda w: not (w[dp.PCALL] != dp.P_NONE and w[dp.SCALE_ST] == dp.S_SCALING),
    ),
)

DP_LIVENESS: tuple[Property, ...] = (
    _live(
        "dp_request_ends",
        "Every request eventually ends, whichever engine it went to, and even when that engine "
        "is a replacement that dies too.",
        ("replacement_unmonitored",),
        (_DP_ANY_LIVE, lambda w: any(w[q] in dp.Q_LIVE for q in dp.CREQ)),
        (f"!{_DP_ANY_LIVE}", lambda w: not any(w[q] in dp.Q_LIVE for q in dp.CREQ)),
    ),
    _live(
        "dp_restart_completes",
        "A restarting member eventually serves again, or is known dead, or is shut down.",
        ("reader_forgets_replacement",),
        (_DP_ANY_RESTARTING, lambda w: any(w[x] == dp.M_RESTARTING for x in dp.MEM)),
        (f"!{_DP_ANY_RESTARTING}", lambda w: not any(w[x] == dp.M_RESTARTING for x in dp.MEM)),
    ),
    _live(
        "dp_scale_terminates",
        "Every scale eventually returns (done, failed, or failed by shutdown()), even when a "
        "joiner or a leaver dies during it: the joiner's waiter exists before the joiner "
        "starts, and a joiner's death wakes it too (vLLM #37357).",
        ("join_waiter_after_event", "joiner_death_unwaited"),
        (f"scale == {dp.S_SCALING}", lambda w: w[dp.SCALE_ST] == dp.S_SCALING),
        (f"scale != {dp.S_SCALING}", lambda w: w[dp.SCALE_ST] != dp.S_SCALING),
    ),
)

DP_PROPERTIES: tuple[Property, ...] = DP_SAFETY + DP_LIVENESS



# ---- the front-end model (compose_fe.py) ----------------------------------------------------
# In Promela the per-front-end fields are arrays indexed by front end (``creq[f]``), the
# per-channel ones arrays indexed by channel ``f * N + i`` (``sess[c]``); the macros
# ``ereq_live(c)``, ``client_live_fe(f)`` ... are generated from the same named sets.

def _fe_flag(name: str) -> Callable[[World], bool]:
    return _flag(name, fe.BAD)


def _fe_chans() -> list[tuple[int, int, int]]:
    return [(f, i, fe.ch(f, i)) for f in range(fe.F) for i in range(fe.N)]


def _fe_no_stale_work(w: World) -> bool:
    return not any(fe.stale_work(w, f, i) for f in range(fe.F) for i in range(fe.N))


_FE_NO_STALE_WORK = " && ".join(
    f"!(ereq_live({c}) && (sess[{c}] == SESSION_S_GONE || sgen[{c}] != egen[{c}]))"
    for _f, _i, c in _fe_chans())


def _fe_attending(w: World, f: int) -> bool:
    """Front end ``f``'s process is alive and its client constructed or constructing."""
    return not w[fe.FDEAD[f]] and w[fe.C[f]] not in (fe.C_DEAD, fe.C_SHUTDOWN)


_FE_ATTENDING = ("(!fdead[{f}] && client[{f}] != CLIENT_S_DEAD"
                 " && client[{f}] != CLIENT_S_SHUTDOWN)")


def _fe_stuck(w: World, f: int) -> bool:
    """Front end ``f`` is alive with a request or call it still waits for, and nothing excuses
    the wait (a request queued in an engine its owner put to sleep)."""
    if w[fe.FDEAD[f]]:
        return False
    if w[fe.UTIL] == fe.U_PENDING and w[fe.UCALL] == f:
        return True
    return w[fe.CREQ[f]] in fe.Q_LIVE and not w[fe.ASLEEP[w[fe.OWN[f]]]]


_FE_STUCK = ("(!fdead[{f}] && ((util == " + str(fe.U_PENDING) + " && ucall == {f})"
             " || (creq_live({f}) && !asleep[own[{f}]])))")
_FE_ANY_STUCK = _each(_FE_STUCK.replace("{f}", "{i}"), fe.F, "||")


def _fe_view_off(w: World, f: int) -> bool:
    """A live client whose view of an engine it serves on differs from that engine's power
    state, or whose own state differs from its views (asleep while any is)."""
    if w[fe.FDEAD[f]] or w[fe.C[f]] not in fe.C_LIVE:
        return False
    views = [(i, fe.ch(f, i)) for i in range(fe.N)]
    if any(not w[fe.EXITED[i]] and w[fe.VIEW[c]] != w[fe.ASLEEP[i]] for i, c in views):
        return True
    asleep = any(w[fe.VIEW[c]] and not w[fe.KNOWS[c]] for _i, c in views)
    return asleep != (w[fe.C[f]] in fe.C_ASLEEP)


def _fe_view_off_pml(f: int) -> str:
    cs = [(i, fe.ch(f, i)) for i in range(fe.N)]
    engines = " || ".join(f"(!exited[{i}] && view[{c}] != asleep[{i}])" for i, c in cs)
    views = " || ".join(f"(view[{c}] && !knows[{c}])" for _i, c in cs)
    return (f"(!fdead[{f}] && client_live_fe({f}) && ({engines}"
            f" || (({views}) != client_asleep_fe({f}))))")


_FE_ANY_VIEW_OFF = "(" + " || ".join(_fe_view_off_pml(f) for f in range(fe.F)) + ")"


def _fe_unseen(w: World) -> bool:
    return any(w[fe.EXITED[i]] and not w[fe.KNOWS[c]] and _fe_attending(w, f)
               for f, i, c in _fe_chans())


_FE_UNSEEN = "(" + " || ".join(
    f"(exited[{i}] && !knows[{c}] && {_FE_ATTENDING.format(f=f)})"
    for f, i, c in _fe_chans()) + ")"


FE_SAFETY: tuple[Property, ...] = (
    _safety(
        "fe_spec_conformance",
        "Every component of the front-end model only fires events its machine table allows "
        "(a session event, and a power notice on a client, included).",
        ("notice_before_ready",),
        "!v_fe_spec_conformance",
        _fe_flag("fe_spec_conformance"),
    ),
    _safety(
        "fe_no_cross_delivery",
        "No output or reply reaches a front end other than its sender, nor a restarted front "
        "end's new incarnation its predecessor's: an engine routes by the session "
        "(client_index) and keeps request ids per session (vLLM #27711's shape).",
        ("outputs_to_front_end_0", "ids_not_scoped"),
        "!v_fe_no_cross_delivery",
        _fe_flag("fe_no_cross_delivery"),
    ),
    _safety(
        "fe_death_ends_own",
        "A front end's loss ends its own live requests in every engine by the time its "
        "session there is GONE (or replaced by a new ATTACH), and no other front end's.",
        ("dead_work_left_running", "death_ends_every_front_end"),
        f"!v_fe_death_ends_own && {_FE_NO_STALE_WORK}",
        lambda w: w[fe.BAD] != "fe_death_ends_own" and _fe_no_stale_work(w),
    ),
    _safety(
        "fe_request_ends_once",
        "No request or call ends twice at its sender: no finish or reply reaches one that "
        "already ended (a request failed by its engine's death reads nothing more from it).",
        ("dead_channel_read",),
        "!v_fe_request_ends_once",
        _fe_flag("fe_request_ends_once"),
    ),
)

FE_LIVENESS: tuple[Property, ...] = (
    _live(
        "fe_request_ends",
        "Every request and call of a live front end eventually ends at its sender, whatever "
        "the other front end does, dies or restarts, and when an engine dies (a request "
        "queued in an engine its owner keeps asleep waits).",
        ("death_seen_by_one",),
        (_FE_ANY_STUCK, lambda w: any(_fe_stuck(w, f) for f in range(fe.F))),
        (f"!{_FE_ANY_STUCK}", lambda w: not any(_fe_stuck(w, f) for f in range(fe.F))),
    ),
    _live(
        "fe_power_view_converges",
        "Every attached, live client's view of each engine's power state, and its own state "
        "(CLIENT_ASLEEP while any engine sleeps), converge to the engines' once the channels "
        "are drained, whichever front end slept or woke them (power notices).",
        ("power_notice_not_sent",),
        (_FE_ANY_VIEW_OFF, lambda w: any(_fe_view_off(w, f) for f in range(fe.F))),
        (f"!{_FE_ANY_VIEW_OFF}", lambda w: not any(_fe_view_off(w, f) for f in range(fe.F))),
    ),
    _live(
        "fe_engine_death_seen",
        "An engine's death is eventually seen by every front end attached to it (or "
        "attaching) whose process lives.",
        ("death_seen_by_one",),
        (_FE_UNSEEN, _fe_unseen),
        (f"!{_FE_UNSEEN}", lambda w: not _fe_unseen(w)),
    ),
)

FE_PROPERTIES: tuple[Property, ...] = FE_SAFETY + FE_LIVENESS


def _targets(bugs: tuple[str, ...], props: tuple[Property, ...]) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {bug: [] for bug in bugs}
    for prop in props:
        for bug in prop.controls:
            out[bug].append(prop.name)
    return {bug: tuple(names) for bug, names in out.items()}


def control_targets() -> dict[str, tuple[str, ...]]:
    """``negative control -> properties it must break``, in ``compose.BUGS`` order."""
    return _targets(BUGS, PROPERTIES)


def dp_control_targets() -> dict[str, tuple[str, ...]]:
    """The same for the two-engine model, in ``compose_dp.BUGS`` order."""
    return _targets(dp.BUGS, DP_PROPERTIES)


def fe_control_targets() -> dict[str, tuple[str, ...]]:
    """The same for the front-end model, in ``compose_fe.BUGS`` order."""
    return _targets(fe.BUGS, FE_PROPERTIES)
