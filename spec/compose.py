"""The composed model: client x engine x input channel x output channel x process monitor.

Theory of operation
-------------------
Rule 1: every component fires its events through the machine tables of this package (the
same rows the runtime uses); an event the tables forbid is itself a violation
(``spec_conformance``), so the composition can never drift from the declarations silently.
Rule 2: the model is bounded, so its state space is finite: one request id (reusable after it
finishes), at most one utility call, ``BUDGET`` owner actions, at most one fault, an input
channel of ``IN_CAP`` frames and an output channel of ``OUT_CAP`` frames.

A ``World`` is a flat tuple of small ints (enum members are stored by ``ix``) so that the
explorer can hash millions of them quickly. An *action* is a guarded atomic step of one
actor: the owner (``user``), the client's output thread (``client``), the engine busy loop
(``engine``), the client's process monitor (``monitor``), the engine's parent-death watcher
(``watchdog``) and the fault injector (``fault``). Faults are ordinary actions: a crash with
or without the dead sentinel (also during the handshake), a hang, a corrupted input frame
(one the integrity check rejects: the engine ends the session, tells its front end and ignores
it; without integrity a malformed frame is rejected on its own, tested in tests/runtime), a
corrupted output frame, a lost ATTACH, and the death of the parent. The client's start-up deadline
(``ready_timeout_s``) is not a fault: it may fire at any time during construction, so a hung
or slow engine still ends the constructor.

The engine's first move also decides how it was deployed: *launched* by this client (a
subprocess it owns, stops and reaps) or *standalone* (started on its own, already serving a
previous front end: still running its request, of the same id as this client's, or asleep
with that request parked). Every client attaches after the ready handshake (``ATTACH``; the
engine ends the previous session and answers with a marker) and drops everything read before
the marker; a marker overdue by ``ready_timeout_s`` declares the engine dead (a timer, which
the model fires only when the marker is not on its way: the engine hangs or the ATTACH was
lost; firing earlier is a slow engine, which ends like any death). A client leaving a
standalone engine aborts what the engine still runs for it and does not stop the engine; once
no front end is connected the engine's outputs are dropped. The monitor stands for the
heartbeat deadline there (a standalone engine is not this client's child), and the
parent-death watchdog applies only to launched engines.

Power calls (sleep, pause, wake_up, resume_scheduler) are counted from the owner's send to the
client's reading of their reply (``power_pending``), as the runtime answers each: every
deferred sleep(wait) is answered once the engine drained, or when an abort/keep pause ends the
drain, or with an error when a wake-up ends it.

Layout: the world (bounds, message codes, fields, the step) is ``_compose_world.py``; the
actions are methods of two mixins, ``_compose_front.py`` (owner, client threads, monitor) and
``_compose_engine.py`` (engine, watchdog, faults); ``Composition`` below orders them into one
action table (``_ACTIONS``), the order the explorer tries them in.

Each negative control (``BUGS``) is a one-line deviation from the correct protocol; the
generated Promela model carries the same deviations under ``#ifdef BUG_<NAME>`` so that both
checkers are held to rejecting it. Keep this file and ``promela.py``'s template in step: the
tests compare the explorer's and SPIN's verdicts on every property and every control.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any

from ._compose_engine import EngineActions
from ._compose_front import FrontEndActions
from ._compose_world import (
    ATT,
    BAD,
    BUDGET,
    BUDGET_LEFT,
    C_CONSTRUCTING,
    CREQ,
    E_CONSTRUCTING,
    EREQ,
    FAULTS,
    FAULTS_LEFT,
    FIELDS,
    I_PAUSE_KEEP,
    I_RESUME,
    I_SLEEP_ABORT,
    I_SLEEP_WAIT,
    I_WAKE_ALL,
    I_WAKE_WEIGHTS,
    IN_CAP,
    IN_MSGS,
    INQ,
    NO_UTIL,
    OUT_CAP,
    OUT_MSGS,
    OUTQ,
    QS,
    RS,
    SESS,
    TOKENS,
    UE,
    UTIL,
    Action,
    C,
    E,
    Table,
    World,
    ix,
)
from .attach import ATTACH, AttachState
from .client import CLIENT, ClientState
from .engine import ENGINE, EngineState
from .machine import Machine
from .request import CLIENT_REQUEST, ENGINE_REQUEST, ClientRequestState, EngineRequestState
from .session import SESSION, SessionState
from .utility import UTILITY, UtilityState

__all__ = [
    "BUDGET",
    "BUGS",
    "COVERS",
    "FAULTS",
    "FIELDS",
    "IN_CAP",
    "IN_MSGS",
    "OUT_CAP",
    "OUT_MSGS",
    "TOKENS",
    "UNEXERCISED",
    "Action",
    "Composition",
    "World",
    "describe_world",
]

# Negative controls: each breaks the protocol in one place (see ``properties.CONTROLS``).
BUGS = (
    "forget_pending_on_death",
    "late_reply_resolves",
    "abort_ack_before_flush",
    "abort_unanswered",
    "reply_before_drain",
    "wake_ignored_while_draining",
    "cancelled_wait_unanswered",
    "no_startup_deadline",
    "partial_wake_clears_flag",
    "input_reorders",
    "shutdown_skips_join",
    "shutdown_no_kill",
    "no_monitor",
    "ignore_parent_death",
    "drop_failed_reply",
    "add_before_ready",
    "reader_keeps_stale",
    "attach_keeps_work",
    "no_attach_deadline",
    "shutdown_leaves_work",
    "session_end_unannounced",
)

# The machines whose every row this model must exercise (membership is the two-engine
# model's, compose_dp.py).
COVERS: tuple[Machine[Any, Any], ...] = (
    CLIENT, ENGINE, ENGINE_REQUEST, CLIENT_REQUEST, UTILITY, ATTACH, SESSION)

# Table rows no run of this model fires, each with why (machine, row as explore prints it).
# ``enginewire spec check`` fails when a row is neither exercised nor listed here, and when a
# listed row becomes exercised, so this list stays true.

_REJECT = "not modelled: the engine rejects an invalid add (tested in tests/runtime)"
_ONE_SETTING = ("not modelled: both sides have the same frame-integrity setting here (a"
                " mismatch refused at ATTACH is tested in tests/runtime/test_reattach.py)")
_SEVERAL_FRONT_ENDS = ("not modelled here: a front end's loss and several front ends per engine"
                       " are the front-end model's (issue 47)")
UNEXERCISED: dict[tuple[str, str], str] = {
    ("session", "ATTACHED --FRONT_END_GONE--> GONE"): _SEVERAL_FRONT_ENDS,
    ("session", "GONE --ATTACH_ACCEPTED--> ATTACHED"): _SEVERAL_FRONT_ENDS,
    ("session", "GONE --ATTACH_REFUSED--> REFUSED"):
        "frame integrity after a front end's loss: tested in tests/runtime/test_front_ends.py",
    ("session", "GONE --FRONT_END_GONE--> GONE"): _SEVERAL_FRONT_ENDS,
    **{("session", f"{src} --ATTACH_MISPLACED--> {dst}"): _SEVERAL_FRONT_ENDS for src, dst in (
        ("NO_FRONT_END", "REFUSED"), ("ATTACHED", "ATTACHED"), ("REFUSED", "REFUSED"),
        ("ENDED", "ENDED"), ("GONE", "GONE"))},
    ("client", "SHUTDOWN --SHUTDOWN--> SHUTDOWN"):
        "bounded: the owner calls shutdown() once (repeats are tested in tests/runtime)",
    ("engine", "CONSTRUCTING --BUILT [inproc]--> IDLE"):
        "in-process only: the model composes the engine process",
    ("engine", "DRAINING --WORK_ARRIVED--> DRAINING"):
        "bounded: one request id, live for the whole drain",
    ("engine", "READY --FATAL_ERROR--> DEAD"):
        "atomic: the model's engine_start passes READY in one step",
    ("engine", "READY --SHUTDOWN--> SHUTDOWN"):
        "atomic: the model's engine_start passes READY in one step",
    ("engine", "DEAD --FATAL_ERROR--> DEAD"): "bounded by FAULTS=1",
    ("engine", "DEAD --SHUTDOWN--> SHUTDOWN"):
        "in-process only: a dead engine process has exited and reads no shutdown frame",
    ("engine", "SHUTDOWN --SHUTDOWN--> SHUTDOWN"):
        "in-process only: the engine process exits on its first shutdown",
    ("engine_request", "UNKNOWN --REJECT--> FINISHED_ERROR"): _REJECT,
    ("engine_request", "WAITING --ERROR--> FINISHED_ERROR"):
        "not modelled: a step error hits a scheduled (RUNNING) request only",
    ("engine_request", "PREEMPTED --ERROR--> FINISHED_ERROR"):
        "not modelled: a step error hits a scheduled (RUNNING) request only",
    **{(mach, row): _ONE_SETTING for mach, row in (
        ("attach", "AWAITING_MARKER --REFUSAL--> REFUSED"),
        ("session", "NO_FRONT_END --ATTACH_REFUSED--> REFUSED"),
        ("session", "ATTACHED --ATTACH_REFUSED--> REFUSED"),
        ("session", "ENDED --ATTACH_REFUSED--> REFUSED"),
        ("session", "REFUSED --ATTACH_REFUSED--> REFUSED"),
        ("session", "REFUSED --ATTACH_ACCEPTED--> ATTACHED"),
    )},
    ("client_request", "STREAMING --OUTPUT--> STREAMING"): "bounded by TOKENS=1",
    ("client_request", "SENT --FINISH_LENGTH--> FINISHED_LENGTH"):
        "bounded by TOKENS=1: a length finish follows the one token",
}

# The model's actions in the order the explorer tries them: (actor, action name, method,
# its fixed keyword arguments). One row per action; the methods are in the two mixins.
_ACTIONS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    # the owner (user)
    ("user", "add_request", "_add", {}),
    ("user", "abort_request", "_abort", {}),
    ("user", "call_utility", "_util", {}),
    ("user", "cancel_utility", "_end_call", {"ev": UE.CANCEL, "label": "cancel_utility"}),
    ("user", "utility_timeout", "_end_call", {"ev": UE.TIMEOUT, "label": "utility_timeout"}),
    ("user", "sleep_abort", "_power_call", {"msg": I_SLEEP_ABORT, "label": "sleep_abort"}),
    ("user", "sleep_wait", "_power_call", {"msg": I_SLEEP_WAIT, "label": "sleep_wait"}),
    ("user", "pause_keep", "_power_call", {"msg": I_PAUSE_KEEP, "label": "pause_keep"}),
    ("user", "wake_weights", "_power_call", {"msg": I_WAKE_WEIGHTS, "label": "wake_weights"}),
    ("user", "wake_all", "_power_call", {"msg": I_WAKE_ALL, "label": "wake_all"}),
    ("user", "resume_scheduler", "_power_call", {"msg": I_RESUME, "label": "resume_scheduler"}),
    ("user", "shutdown", "_shutdown", {}),
    # the client's own threads
    ("client", "shutdown_kill", "_kill", {}),
    ("client", "shutdown_finish", "_finish", {}),
    ("client", "handshake_deadline", "_deadline", {}),
    ("client", "attach_deadline", "_attach_deadline", {}),
    ("client", "receive_output", "_rx", {}),
    ("monitor", "process_exit_noticed", "_monitor", {}),
    # the engine process, its watchdog, the faults
    ("engine", "start", "_start", {}),
    ("engine", "receive_input", "_recv", {}),
    ("engine", "step", "_step", {}),
    ("watchdog", "parent_gone", "_watchdog", {}),
    ("fault", "faults", "_faults", {}),
)


class Composition(FrontEndActions, EngineActions):
    """The composed model; ``bug`` selects one negative control (``None``: the real protocol)."""

    BUGS = BUGS
    BAD_FIELD = BAD
    TABLES = (("t_client", CLIENT), ("t_engine", ENGINE), ("t_ereq", ENGINE_REQUEST),
              ("t_creq", CLIENT_REQUEST), ("t_util", UTILITY), ("t_attach", ATTACH),
              ("t_session", SESSION))

    def _actions(self) -> tuple[Action, ...]:
        return tuple(
            Action(actor, name, functools.partial(getattr(self, method), **kwargs) if kwargs
                   else getattr(self, method))
            for actor, name, method, kwargs in _ACTIONS)

    def tables(self) -> tuple[Table, ...]:
        return (self.t_client, self.t_engine, self.t_ereq, self.t_creq, self.t_util,
                self.t_attach, self.t_session)

    # ---- the initial world -------------------------------------------------------------------
    def initial(self) -> World:
        w: list[Any] = [0] * len(FIELDS)
        w[C] = C_CONSTRUCTING
        w[E] = E_CONSTRUCTING
        w[INQ] = ()
        w[OUTQ] = ()
        w[CREQ] = ix(QS.UNKNOWN)
        w[EREQ] = ix(RS.UNKNOWN)
        w[UTIL] = NO_UTIL
        w[BUDGET_LEFT] = BUDGET
        w[FAULTS_LEFT] = FAULTS
        w[BAD] = ""
        return tuple(w)


def describe_world(world: World) -> dict[str, object]:
    """A readable view of a world (enum names instead of ints) for counterexamples."""
    names: dict[int, type[Enum]] = {
        C: ClientState, E: EngineState, CREQ: ClientRequestState, EREQ: EngineRequestState,
        ATT: AttachState, SESS: SessionState,
    }
    out: dict[str, object] = {}
    for i, field in enumerate(FIELDS):
        v = world[i]
        if i in names:
            v = list(names[i])[v].name
        elif i == UTIL:
            v = "none" if v == NO_UTIL else list(UtilityState)[v].name
        elif i == INQ:
            v = [IN_MSGS[(m & 15) - 1] for m in v]
        elif i == OUTQ:
            v = [OUT_MSGS[m - 1] for m in v]
        out[field] = v
    return out
