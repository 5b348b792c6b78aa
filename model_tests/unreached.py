"""Why a campaign leaves a spec transition unreached: the declared reasons, and the wording of a
gap.

``UNREACHED`` holds the transitions no campaign reaches, each with its reason (unreachable by
this runtime, not observable from the campaign's process, covered by tests instead of rules);
``why_unreached`` adds the reasons that depend on the run (no engine trace drained, one
engine only). A transition a report misses and nothing here explains is a gap: a rule should
reach it. tests/model_tests/test_campaign.py checks the table against the spec machines.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

from ..spec import (
    ATTACH,
    CLIENT,
    ENGINE,
    ENGINE_REQUEST,
    MEMBERSHIP,
    SESSION,
    AttachEvent,
    AttachState,
    ClientEvent,
    ClientRequestEvent,
    ClientRequestState,
    ClientState,
    EngineEvent,
    EngineRequestEvent,
    EngineRequestState,
    EngineState,
    Machine,
    SessionEvent,
    SessionState,
)
from ..spec.session import SESSION_DROPS_INPUT

__all__ = ["UNREACHED"]

# Every spec transition a campaign never reaches, and why: exact (machine, source, event,
# target) keys, checked against the spec machines by tests/model_tests/test_campaign.py. A
# transition missing from a report and from this table is a gap: a rule should reach it.
_IN_ENGINE_PROCESS = ("not observable: only a subprocess engine takes it, and it ends the engine"
                      " before the loop serves the next drain_trace (the trace of an engine"
                      " process reaches its client only through that utility)")
_SESSION_BY_TESTS = ("covered by tests, not by campaign rules (every front end has its engine's"
                     " frame-integrity setting, and none breaks an --integrity link):"
                     " tests/runtime/test_attach_phase.py, test_reattach.py")
_AS, _AE = AttachState, AttachEvent
_CS, _CE = ClientState, ClientEvent
_ES, _EE = EngineState, EngineEvent
_CRS, _CRE = ClientRequestState, ClientRequestEvent
_ERS, _ERE = EngineRequestState, EngineRequestEvent
_SS, _SE = SessionState, SessionEvent


def _key(machine: Machine[Any, Any], source: Enum, event: Enum, target: Enum
         ) -> tuple[str, str, str, str]:
    """A transition as its trace entry names it, built from the spec's members."""
    return machine.name, source.name, event.name, target.name


UNREACHED: dict[tuple[str, str, str, str], str] = {
    _key(CLIENT, _CS.CONSTRUCTING, _CE.ENGINE_DIED, _CS.DEAD):
        "covered by conformance, not by campaign rules (which start from a ready client): the"
        " engine process dies during the handshake (check_kill_during_handshake)",
    _key(CLIENT, _CS.SHUTDOWN, _CE.ENGINE_DIED, _CS.SHUTDOWN):
        "a race no rule forces (reached in some 10-minute runs, not all): a death notice"
        " landing after shutdown() marked the client SHUTDOWN and before its monitor stopped"
        " (the client absorbs it)",
    _key(ENGINE, _ES.READY, _EE.FATAL_ERROR, _ES.DEAD):
        _IN_ENGINE_PROCESS + " (a fault between the handshake and the loop's start)",
    _key(ENGINE, _ES.READY, _EE.SHUTDOWN, _ES.SHUTDOWN):
        _IN_ENGINE_PROCESS + " (a stop between the handshake and the loop's start)",
    _key(ENGINE, _ES.DEAD, _EE.FATAL_ERROR, _ES.DEAD):
        _IN_ENGINE_PROCESS + "; in-process, a dead engine refuses every call before a second"
        " fatal error could happen",
    _key(ENGINE, _ES.CONSTRUCTING, _EE.SHUTDOWN, _ES.SHUTDOWN):
        _IN_ENGINE_PROCESS + " (a stop request during start-up); in-process, EngineCore"
        " cannot be shut down before its constructor returned",
    _key(ENGINE, _ES.DRAINING, _EE.WAKE_UP, _ES.IDLE):
        "unreachable by this runtime: the end of the last draining request drains the engine"
        " at once (DRAINED), so a wake-up never finds it DRAINING with no request left",
    _key(ENGINE, _ES.SHUTDOWN, _EE.SHUTDOWN, _ES.SHUTDOWN):
        "unreachable by this runtime: EngineCore.shutdown() returns early once shut down",
    _key(ATTACH, _AS.AWAITING_MARKER, _AE.FOREIGN_MESSAGE, _AS.AWAITING_MARKER):
        "only a standalone engine has a previous front end whose messages a new one drops"
        " (--client standalone reaches it: handover_mid_stream, every time)",
    _key(ATTACH, _AS.AWAITING_MARKER, _AE.REFUSAL, _AS.REFUSED):
        "covered by tests, not by campaign rules (every front end has its engine's"
        " frame-integrity setting): tests/runtime/test_attach_phase.py, test_reattach.py",
    _key(ATTACH, _AS.AWAITING_MARKER, _AE.DEADLINE, _AS.OVERDUE):
        "covered by tests, not by campaign rules (none loses an ATTACH or silences an engine"
        " before its marker): tests/runtime/test_attach_phase.py, test_reattach.py",
    _key(ATTACH, _AS.ATTACHED, _AE.SESSION_ENDED, _AS.ENDED):
        "covered by tests, not by campaign rules (none breaks an --integrity link):"
        " tests/runtime/test_attach_phase.py, test_reattach.py",
    _key(SESSION, _SS.ATTACHED, _SE.ATTACH_ACCEPTED, _SS.ATTACHED):
        "only a standalone engine has a second front end attach (--client standalone reaches"
        " it at every handover)",
    # The rest of the session's rows: refusals, integrity failures and the attaches after
    # them (every campaign attaches from NO_FRONT_END; ATTACHED's re-attach is above).
    **{_key(SESSION, t.source, t.event, t.target): _SESSION_BY_TESTS
       for t in SESSION.transitions if t.event is not _SE.ATTACH_ACCEPTED
       or t.source in SESSION_DROPS_INPUT},
}


# Engine-side machines reach the report only through a drained engine trace (an in-process
# engine's records are in its client's trace as well).
_ENGINE_MACHINES = (ENGINE.name, ENGINE_REQUEST.name, SESSION.name)
_NOT_OBSERVED = ("not observed by this run: no client drained an engine trace that has this"
                 " machine (an in-process engine records one with its client's trace, --client"
                 " inproc; an engine process when ENGINEWIRE_ENGINE_TRACE is set, as campaigns"
                 " set it, and only an engine process has a session; a factory's engine may"
                 " keep none)")



_ONE_ENGINE = ("not driven by this run: membership is the data-parallel client's (one engine"
               " core per client here; --engines N drives it)")


def why_unreached(item: str, *, engine_observed: bool = True,
                  data_parallel: bool = False, observed: frozenset[str] | None = None) -> str:
    """Why ``item`` was never reached: its declared reason, else what this run did not do.
    ``observed``: the machines with any step in the run (None: every engine-side machine
    when ``engine_observed``, none otherwise)."""
    m = re.fullmatch(r"(\S+) (\S+) -(\S+)-> (\S+)", item)
    why = UNREACHED.get(m.groups()) if m else None  # type: ignore[arg-type]
    if why is None and m is not None and not data_parallel and m.group(1) == MEMBERSHIP.name:
        return _ONE_ENGINE
    unseen = (m is not None and m.group(1) in _ENGINE_MACHINES
              and (not engine_observed if observed is None else m.group(1) not in observed))
    if why is None and unseen:
        return _NOT_OBSERVED
    return why or "NOT REACHED in this run: no reason declared (a gap; run longer or add a rule)"
