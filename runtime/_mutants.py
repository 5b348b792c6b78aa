"""The mutant bank: seeded bugs that prove the campaigns find bugs.

Theory of operation
-------------------
Each mutant is a small ``if _mutants.active("name"):`` branch in the runtime that re-creates a
real bug class (vLLM's engine-client history). Exactly one mutant can be on, chosen by the
environment variable ``ENGINEWIRE_TESTING_MUTANT``, which is read ONCE, when this module is
imported, into ``ACTIVE``. Spawned engine processes inherit the variable and so run the same
mutant. With the variable unset ``ACTIVE`` is None and ``active()`` is one comparison: zero
cost in production, and no user reaches a mutant by accident (an unknown name fails the import
with a message naming the bank).

``enginewire campaign --mutant NAME`` sets the variable for the processes it starts; the bank
below says, for each mutant, which bug it models, which clients can exhibit it, and its class
(``KINDS``: the kinds of bug the campaign must find, each with at least one mutant).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["ACTIVE", "BANK", "ENV_VAR", "KINDS", "Mutant", "active"]

ENV_VAR = "ENGINEWIRE_TESTING_MUTANT"

# The classes of bug the campaign must find (issue #30's list, and the older rows' own): every
# class has a mutant, and the detection table in docs/campaigns.md gives one time per class.
KINDS: dict[str, str] = {
    "quiescence": "resources at quiescence (leaks no output shows)",
    "boundary": "boundaries (max_model_len, a stop token on the last allowed position)",
    "after_end": "calls after death and after shutdown",
    "abort": "mixed abort lists, and aborts that race an ADD or a finish",
    "attached": "standalone and attached engines (handovers, heartbeat)",
    "deferred": "deferred calls (sleep/pause in wait mode), in-process too",
    "kv_content": "KV content (only a real model's tokens show it)",
    "short_deep": "short deep sequences on every client (sleep, then a partial wake-up)",
    "engine_side": "the engine's side of the spec (its own trace)",
    "faults": "wire and process faults (garbage frames, buffer reuse, shutdown order, orphans)",
    "requests": "a request's own protocol (a live id sent twice)",
}


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    clients: tuple[str, ...]  # the client kinds on which the bug can show
    # The model its campaign runs: "null" unless the bug changes only what a real model
    # computes (the null model's tokens ignore the KV cache).
    model: str = "null"
    # Its class, a key of KINDS (keyword only: the rows above name it last).
    kind: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"mutant {self.name!r}: kind={self.kind!r} is not a class of"
                             f" the bank; give one of {', '.join(KINDS)}")


_MP = ("sync", "async")
_ALL = ("inproc", *_MP)
_LONE = ("standalone",)
BANK: dict[str, Mutant] = {m.name: m for m in (
    Mutant("pending_utility_not_failed_on_death",
           "utility futures pending when the engine dies are never failed (they hang)", _MP,
           kind="after_end"),
    Mutant("sync_get_output_not_woken_on_kill",
           "a get_output blocked when the engine is SIGKILLed is never woken", ("sync",),
           kind="after_end"),
    Mutant("input_thread_dies_on_malformed_frame",
           "the engine's input thread dies on a frame it cannot decode", _MP, kind="faults"),
    Mutant("output_buffer_reused_before_send",
           "the engine reuses an output buffer before zmq finished sending it", _MP,
           kind="faults"),
    Mutant("abort_applied_before_add",
           "an abort overtakes the ADD it follows and is lost", _MP, kind="abort"),
    Mutant("duplicate_live_id_accepted",
           "a second ADD with a live request id is accepted", _ALL, kind="requests"),
    Mutant("sleep_wait_replies_before_idle",
           "sleep(mode='wait') replies while requests are still draining", _MP,
           kind="deferred"),
    Mutant("spurious_dead_on_clean_shutdown",
           "a clean shutdown fails pending calls with EngineDeadError", _MP, kind="after_end"),
    Mutant("engine_ignores_parent_death",
           "the engine process keeps running after its client process died", ("sync",),
           kind="faults"),
    Mutant("context_term_before_close",
           "the zmq context is terminated before the sockets are closed (shutdown hangs)", _MP,
           kind="faults"),
    Mutant("timed_out_call_left_registered",
           "a timed-out utility call stays in the registry (a leak per timeout)", _MP,
           kind="quiescence"),
    Mutant("abort_not_acknowledged",
           "aborting a live request ends it silently, without an ABORT output", _ALL,
           kind="abort"),
    Mutant("abort_leaks_kv_blocks",
           "an aborted request's KV blocks are never freed (no output changes: only the"
           " quiescence audit of the engine's accounting sees it)", _ALL, kind="quiescence"),
    Mutant("length_limit_off_by_one",
           "a request ends one token past max_model_len (its LENGTH limit is off by one)",
           _ALL, kind="boundary"),
    Mutant("add_after_death_dropped",
           "an ADD on a client whose engine died is dropped silently instead of raising"
           " EngineDeadError (the caller waits for outputs that never come)", _MP,
           kind="after_end"),
    # The books balance (each holder counts its reference) and the null model never reads
    # the KV cache: only a real model's tokens, compared with a lone run, show it.
    Mutant("kv_block_shared_while_live",
           "a request's new KV block is one another live request still holds (taken as a"
           " shared prefix block), so both write their K/V into it", _ALL,
           model="tiny", kind="kv_content"),
    # The attach/handover path: only a standalone engine outlives a front end, so only the
    # standalone campaign (front ends taking turns on one engine) can show these.
    Mutant("attach_marker_session_not_checked",
           "an attaching client takes any message for its marker (the session is not"
           " checked), so it reads outputs of the front end it replaced", _LONE,
           kind="attached"),
    Mutant("session_keeps_old_requests",
           "a new front end's session leaves the previous one's requests running", _LONE,
           kind="attached"),
    Mutant("session_leaves_engine_asleep",
           "a new front end's session leaves the engine asleep or paused, as the previous one"
           " left it", _LONE, kind="attached"),
    # Only an engine the client did not launch is watched by its heartbeat alone (a launched
    # one's exit shows on its process sentinel): the standalone campaign's kills find it.
    Mutant("attached_client_ignores_heartbeat_loss",
           "a client attached to an engine it did not launch never declares it dead when its"
           " heartbeat stops, so a SIGSTOPped or killed engine leaves every call blocked",
           _LONE, kind="attached"),
    Mutant("inproc_wait_drops_outputs_of_deferring_step",
           "the in-process client, stepping the engine through a sleep/pause(wait), loses the"
           " outputs of the step that completes the wait (the drained requests' last tokens)",
           ("inproc",), kind="deferred"),
    # Outputs and resources are as they should be: only the engine's own trace, drained and
    # cross-checked with the client's (model_tests/oracle.py, EngineTraceCheck), shows it.
    Mutant("abort_recorded_as_error",
           "the engine answers an abort with an ABORT output, but its own lifecycle ends the"
           " request FINISHED_ERROR (its books, logs and metrics disagree with what it sent)",
           _ALL, kind="engine_side"),
    # vLLM's scheduler skips an id it does not know (finish_requests' `continue`); a `break`
    # there leaves every live id after it running: the recycled-id leak of #23697, in a list.
    Mutant("abort_list_stops_at_unknown_id",
           "an abort list stops at its first unknown or finished id, so the live requests"
           " after it are never aborted (they run to their end)", _ALL, kind="abort"),
    # vLLM's executor cleared is_sleeping on any wake_up before tags existed (PR #15500);
    # partial wake states are still a pain point (#31618).
    Mutant("partial_wake_reports_awake",
           "a partial wake_up (wake_up(['weights']) after sleep(level=1)) marks the engine"
           " awake and scheduling while the rest of its memory is still released", _ALL,
           kind="short_deep"),
    # vLLM's InprocClient checks nothing after shutdown: an ADD goes on to the engine core.
    Mutant("add_after_shutdown_accepted",
           "an ADD on an in-process client that was shut down is accepted silently instead of"
           " raising ClientClosedError", ("inproc",), kind="after_end"),
    # vLLM's check_stop tests the length cap before the stop tokens, so a stop token sampled
    # at max_tokens (or max_model_len) reports LENGTH.
    Mutant("stop_on_last_token_ends_length",
           "a stop token (or EOS) sampled on the last allowed position ends the request"
           " LENGTH, not STOP (the length limit is checked first)", _ALL, kind="boundary"),
)}


def _read() -> str | None:
    name = os.environ.get(ENV_VAR) or None
    if name is not None and name not in BANK:
        raise ValueError(
            f"{ENV_VAR}={name!r} names no mutant; the bank has: {', '.join(sorted(BANK))}")
    return name


ACTIVE: str | None = _read()


def active(name: str) -> bool:
    """True when the mutant ``name`` is switched on (a typo in ``name`` fails loudly)."""
    if ACTIVE is None:
        return False
    if name not in BANK:
        raise ValueError(f"no mutant named {name!r}")
    return ACTIVE == name
