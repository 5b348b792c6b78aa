"""The mutant bank: seeded bugs that prove the campaigns find bugs.

Theory of operation
-------------------
Each mutant re-creates a real bug class (vLLM's engine-client history) as source patches
(``source_patch.py``) of the clean runtime: a function named ``"module:Qual.name"`` and
``(old, new)`` snippets of its source. The runtime holds no trace of the bank: ``apply(name)``
swaps the patched functions' code in place in this process, and ``revert()`` puts the
originals back. A snippet that no longer occurs exactly once (someone edited the runtime) is a
``PatchDriftError`` naming the mutant and the function, at once, in every process
(``tests/model_tests/test_mutants.py`` applies and reverts every row).

Engines run in processes of their own, so ``apply`` also sets, for the processes this one
starts, ``ENGINEWIRE_TESTING_MUTANT`` (the mutant's name) and the runtime's generic preload
hook (``ENGINEWIRE_ENGINE_PRELOAD``, runtime/preload.py) to ``apply_from_env``: every engine
process, however it is started, applies the same mutant before it builds its engine.
``ENGINEWIRE_TESTING_MUTANT`` is also the switch of a campaign's own child process:
``run_campaign`` calls ``apply_from_env`` first, where an unknown name fails with a message
naming the bank. With nothing applied, production code runs unchanged: no mutant costs a
comparison, and none is reached without this module.

``enginewire campaign --mutant NAME`` sets the variable for the child campaign it starts; the
bank below says, for each mutant, which bug it models, which clients can exhibit it, its class
(``KINDS``: the kinds of bug the campaign must find, each with at least one mutant) and its
patches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..runtime.preload import PRELOAD_ENV
from .source_patch import AppliedPatches, SourcePatch, apply_patches

__all__ = ["BANK", "ENV_VAR", "KINDS", "PRELOAD_ENTRY", "Mutant", "active", "apply",
           "apply_from_env", "revert"]

ENV_VAR = "ENGINEWIRE_TESTING_MUTANT"
# What an engine process preloads to apply the mutant ENV_VAR names (runtime/preload.py).
PRELOAD_ENTRY = f"{__name__}:apply_from_env"

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
    "membership": "data-parallel membership (a death and restart racing the client's own"
                  " paths: a member's state read outside the lock, a power state left behind)",
    "elastic": "elastic data parallel (engines joining and leaving a serving client: routing"
               " to a leaver or a joiner, a leaver's requests never ended)",
    "front_ends": "several front ends over shared engines (an output or a power change"
                  " reaching the wrong front end, a gone front end's work left running, an"
                  " ending sent twice)",
}


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    clients: tuple[str, ...]  # the client kinds on which the bug can show
    # The model its campaign runs: "null" unless the bug changes only what a real model
    # computes (the null model's tokens ignore the KV cache).
    model: str = "null"
    # Its class, a key of KINDS (keyword only: the rows below name it after the rest).
    kind: str = field(default="", kw_only=True)
    # The bug itself: edits of the clean runtime's source.
    patches: tuple[SourcePatch, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"mutant {self.name!r}: kind={self.kind!r} is not a class of"
                             f" the bank; give one of {', '.join(KINDS)}")
        if not self.patches:
            raise ValueError(f"mutant {self.name!r}: no patches (what is the bug?)")


def _in(target: str, *edits: tuple[str, str]) -> SourcePatch:
    """A patch of ``target``, a function of the runtime (``"module:Qual.name"``)."""
    return SourcePatch(f"enginewire.runtime.{target}", edits)


_MP = ("sync", "async")
_ALL = ("inproc", *_MP)
_LONE = ("standalone",)
_DP = ("dp-sync", "dp-async")  # the data-parallel clients, on 2 engines (campaign.py)
_FE = ("fe",)  # two front ends over one engine (stateful_fe.py; campaign.py's front_ends=2)
# A mutant of the "elastic" class runs the data-parallel machine with its scale rules
# (stateful_dp_elastic.py; mutant_runs.py passes elastic=True to its campaign).
BANK: dict[str, Mutant] = {m.name: m for m in (
    Mutant("pending_utility_not_failed_on_death",
           "utility futures pending when the engine dies are never failed (they hang)", _MP,
           kind="after_end", patches=(_in(
               "mp_client:MPClient._on_engine_dead",
               ("self._deliver_failures(self._utilities.fail_all(err, UtilityEvent.ENGINE_DIED),"
                " err)", "pass"),),)),
    Mutant("sync_get_output_not_woken_on_kill",
           "a get_output blocked when the engine is SIGKILLed is never woken", ("sync",),
           kind="after_end", patches=(_in(
               "sync_mp_client:SyncMPClient._wake_waiters",
               ("self._outputs.put(marker)",
                "if marker is DEAD_MARKER:\n    return\nself._outputs.put(marker)"),),)),
    Mutant("input_thread_dies_on_malformed_frame",
           "the engine's input thread dies on a frame it cannot decode", _MP, kind="faults",
           patches=(
               _in("_engine_input:EngineInput.run",
                   ('logger.exception("engine input thread: dropped a frame it could not'
                    ' handle")', "raise")),
               _in("_engine_input:EngineInput.accept",
                   ("self._reject(frames, e)\nreturn", "raise")),
           )),
    # Every send takes a pooled buffer and drops its tracker, so the buffer is reused while
    # zmq still reads it (zero copy); the fast call path, which bypasses the pool, is off.
    Mutant("output_buffer_reused_before_send",
           "the engine reuses an output buffer before zmq finished sending it", _MP,
           kind="faults", patches=(
               _in("engine_proc:EngineCoreProc.__init__",
                   ("fast_calls = not integrity and self.faults is None",
                    "fast_calls = False")),
               _in("_engine_output:EngineOutput._send_locked",
                   ("pool.release(buf, tracker)",
                    "sock.copy_threshold, tracker = 0, None\npool.release(buf, tracker)")),
               _in("_engine_output:EngineOutput._send_direct",
                   ("if self.faults is not None and not is_marker(item):",
                    "self._send_locked(item)\nreturn None\n"
                    "if self.faults is not None and not is_marker(item):")),
           )),
    Mutant("abort_applied_before_add",
           "an abort overtakes the ADD it follows and is lost", _MP, kind="abort",
           patches=(_in(
               "_engine_input:EngineInput.accept",
               ("if kind is RequestType.ABORT:",
                "if kind is RequestType.ABORT:\n"
                "    queued = []  # jumps ahead of queued ADDs\n"
                "    while not self.input_queue.empty():\n"
                "        queued.append(self.input_queue.get_nowait())\n"
                "    self.input_queue.put((kind, payload))\n"
                "    for item in queued:\n"
                "        self.input_queue.put(item)\n"
                "    return\n"
                "if kind is RequestType.ABORT:")),)),
    Mutant("duplicate_live_id_accepted",
           "a second ADD with a live request id is accepted", _ALL, kind="requests",
           patches=(_in("client:EngineCoreClient._track_add",
                        ("if lc is None:", "if True:")),)),
    Mutant("sleep_wait_replies_before_idle",
           "sleep(mode='wait') replies while requests are still draining", _MP,
           kind="deferred", patches=(_in(
               "engine:EngineCore._pause",
               ("self._deferred.append((fut, then))\nreturn fut",
                "self._deferred.append((fut, then))\nreturn None")),)),
    Mutant("spurious_dead_on_clean_shutdown",
           "a clean shutdown fails pending calls with EngineDeadError", _MP, kind="after_end",
           patches=(_in("mp_client:MPClient.shutdown",
                        ("err: EngineWireError = ClientClosedError(self._closed_message)",
                         "err: EngineWireError = EngineDeadError()")),)),
    Mutant("engine_ignores_parent_death",
           "the engine process keeps running after its client process died", ("sync",),
           kind="faults", patches=(_in(
               "_engine_lifeline:watch_parent",
               ('if sys.platform.startswith("linux"):',
                'return\nif sys.platform.startswith("linux"):')),)),
    Mutant("context_term_before_close",
           "the zmq context is terminated before the sockets are closed (shutdown hangs)", _MP,
           kind="faults", patches=(_in(
               "_background:BackgroundResources._tear_down",
               ("self._stop_monitor, self._stop_process, self._close_sockets,",
                "self._stop_monitor, self._stop_process, self._term_context,"
                " self._close_sockets,")),)),
    Mutant("timed_out_call_left_registered",
           "a timed-out utility call stays in the registry (a leak per timeout)", _MP,
           kind="quiescence", patches=(_in(
               "_registry:UtilityRegistry.give_up",
               ("entry = self._pending.pop(call_id, None)",
                "entry = self._pending.get(call_id)")),)),
    Mutant("abort_not_acknowledged",
           "aborting a live request ends it silently, without an ABORT output", _ALL,
           kind="abort", patches=(_in(
               "engine:EngineCore.abort_requests",
               ("outs = self._abort(request_ids)",
                "outs = self._abort(request_ids)\nouts = []")),)),
    Mutant("abort_leaks_kv_blocks",
           "an aborted request's KV blocks are never freed (no output changes: only the"
           " quiescence audit of the engine's accounting sees it)", _ALL, kind="quiescence",
           patches=(_in("scheduler:Scheduler.finish",
                        ("self.kv.free(req)",
                         "if event is not RE.ABORT:\n    self.kv.free(req)")),)),
    Mutant("length_limit_off_by_one",
           "a request ends one token past max_model_len (its LENGTH limit is off by one)",
           _ALL, kind="boundary", patches=(_in(
               "scheduler:Request.__init__",
               ("self.stop_len = min(self.num_prompt_tokens + sp.max_tokens, max_model_len)",
                "self.stop_len = min(self.num_prompt_tokens + sp.max_tokens,"
                " max_model_len + 1)")),)),
    Mutant("add_after_death_dropped",
           "an ADD on a client whose engine died is dropped silently instead of raising"
           " EngineDeadError (the caller waits for outputs that never come)", _MP,
           kind="after_end", patches=(_in(
               "mp_client:MPClient.send_add",
               ("self._track_add(request)",
                "if self.is_dead:\n    return\nself._track_add(request)")),)),
    # The books balance (each holder counts its reference) and the null model never reads
    # the KV cache: only a real model's tokens, compared with a lone run, show it.
    Mutant("kv_block_shared_while_live",
           "a request's new KV block is one another live request still holds (taken as a"
           " shared prefix block), so both write their K/V into it", _ALL,
           model="tiny", kind="kv_content", patches=(_in(
               "kv_cache:KVCacheManager.allocate",
               ("new = self._pool.take(need)",
                "shared = next((b for b in self.blocks_in_use() if b not in req.block_ids),"
                " None)\n"
                "if shared is not None:\n"
                "    self._ref[shared] += 1\n"
                "    req.block_ids.append(shared)\n"
                "    need -= 1\n"
                "new = self._pool.take(need)")),)),
    # The attach/handover path: only a standalone engine outlives a front end, so only the
    # standalone campaign (front ends taking turns on one engine) can show these.
    Mutant("attach_marker_session_not_checked",
           "an attaching client takes any message for its marker (the session is not"
           " checked), so it reads outputs of the front end it replaced", _LONE,
           kind="attached", patches=(_in(
               "_attach_side:AttachSide._is_marker",
               ("if marker.session != session:", "if False:")),)),
    Mutant("session_keeps_old_requests",
           "a new front end's session leaves the previous one's requests running", _LONE,
           kind="attached", patches=(_in(
               "engine:EngineCore.start_session",
               ("dropped = len(self.scheduler.abort_all())", "dropped = 0")),)),
    Mutant("session_leaves_engine_asleep",
           "a new front end's session leaves the engine asleep or paused, as the previous one"
           " left it", _LONE, kind="attached", patches=(_in(
               "engine:EngineCore.start_session",
               ("if self.lifecycle.state in REPORTS_SLEEPING:\n    self.wake_up()",
                "if self.lifecycle.state in REPORTS_SLEEPING:\n    pass")),)),
    # Only an engine the client did not launch is watched by its heartbeat alone (a launched
    # one's exit shows on its process sentinel): the standalone campaign's kills find it.
    Mutant("attached_client_ignores_heartbeat_loss",
           "a client attached to an engine it did not launch never declares it dead when its"
           " heartbeat stops, so a SIGSTOPped or killed engine leaves every call blocked",
           _LONE, kind="attached", patches=(_in(
               "_background:_watch_engine",
               ("waitables: list[Any] = [stop_fd]",
                "if proc is None:\n    heartbeat_timeout_s = None\n"
                "waitables: list[Any] = [stop_fd]")),)),
    Mutant("inproc_wait_drops_outputs_of_deferring_step",
           "the in-process client, stepping the engine through a sleep/pause(wait), loses the"
           " outputs of the step that completes the wait (the drained requests' last tokens)",
           ("inproc",), kind="deferred", patches=(_in(
               "client:InprocClient._drive_deferred",
               ("outputs = self._step()",
                "outputs = self._step()\nif fut.done():\n    continue")),)),
    # Outputs and resources are as they should be: only the engine's own trace, drained and
    # cross-checked with the client's (model_tests/oracle.py, EngineTraceCheck), shows it.
    Mutant("abort_recorded_as_error",
           "the engine answers an abort with an ABORT output, but its own lifecycle ends the"
           " request FINISHED_ERROR (its books, logs and metrics disagree with what it sent)",
           _ALL, kind="engine_side", patches=(_in(
               "engine:EngineCore.abort_requests",
               ("outs = self._abort(request_ids)",
                "sched = self.scheduler\n"
                "outs = [sched.finish(req, EngineRequestEvent.ERROR, FinishReason.ABORT)\n"
                "        for rid in request_ids if (req := sched.requests.get(rid)) is not"
                " None]\n"
                "sched.running = [r for r in sched.running if not r.finished]")),)),
    # vLLM's scheduler skips an id it does not know (finish_requests' `continue`); a `break`
    # there leaves every live id after it running: the recycled-id leak of #23697, in a list.
    Mutant("abort_list_stops_at_unknown_id",
           "an abort list stops at its first unknown or finished id, so the live requests"
           " after it are never aborted (they run to their end)", _ALL, kind="abort",
           patches=(_in(
               "scheduler:Scheduler.abort",
               ("elif unknown is not None:\n"
                "    unknown.append(rid)",
                "else:\n"
                "    break")),)),
    # vLLM's executor cleared is_sleeping on any wake_up before tags existed (PR #15500);
    # partial wake states are still a pain point (#31618).
    Mutant("partial_wake_reports_awake",
           "a partial wake_up (wake_up(['weights']) after sleep(level=1)) marks the engine"
           " awake and scheduling while the rest of its memory is still released", _ALL,
           kind="short_deep", patches=(_in(
               "engine:EngineCore.wake_up",
               ("if executor.sleeping:", "if False:")),)),
    # vLLM's InprocClient checks nothing after shutdown: an ADD goes on to the engine core.
    Mutant("add_after_shutdown_accepted",
           "an ADD on an in-process client that was shut down is accepted silently instead of"
           " raising ClientClosedError", ("inproc",), kind="after_end", patches=(_in(
               "client:InprocClient.add_request",
               ("with self._engine_lock:",
                "with self._engine_lock:\n    if self.is_closed:\n        return")),)),
    # vLLM's check_stop tests the length cap before the stop tokens, so a stop token sampled
    # at max_tokens (or max_model_len) reports LENGTH.
    Mutant("stop_on_last_token_ends_length",
           "a stop token (or EOS) sampled on the last allowed position ends the request"
           " LENGTH, not STOP (the length limit is checked first)", _ALL, kind="boundary",
           patches=(_in(
               "scheduler:Scheduler._finish_on",
               ("if tok in req.stop_ids:",
                "if req.num_tokens >= req.stop_len:\n"
                "    return self.finish(req, RE.LENGTH, FinishReason.LENGTH, None, None, [tok])\n"
                "if tok in req.stop_ids:")),)),
    # Issue 44, item 2: the engine picked under the lock, its client read again after it
    # (a restart sets it to None in between): AttributeError instead of EngineDeadError.
    Mutant("dp_member_client_read_outside_lock",
           "a data-parallel utility call reads its engine's client again after the pick, outside"
           " the lock: a death and restart in between raise AttributeError (not EngineDeadError"
           " naming the engine) and leave the call's UTILITY lifecycle without its outcome",
           _DP, kind="membership", patches=(
               _in("dp_client:SyncDPClient._call_each",
                   ("return [_attempt(targets[0][1], method, args, timeout)]",
                    "return [_attempt(targets[0][0].client, method, args, timeout)]"),
                   ("for _, client in targets]",
                    "for s, _ in targets for client in (s.client,)]")),
               _in("dp_client:AsyncDPClient._call_each_async",
                   ("return iter([(True, await targets[0][1].call_utility_async(",
                    "return iter([(True, await targets[0][0].client.call_utility_async("),
                   ("for _, client in targets)",
                    "for s, _ in targets for client in (s.client,))")),
           )),
    # Issue 44, item 8: the group's power state moved only by a call every engine answered
    # in time (the combined reply), never by a late reply or one lost with its engine.
    Mutant("dp_power_follows_combined_reply",
           "a data-parallel client's power state follows only a power call every engine"
           " answered in time: a sleep that timed out on one engine (which slept late) or lost"
           " one leaves the client READY while its engines sleep, and the next partial"
           " wake-up is a SpecViolation", _DP, kind="membership", patches=(
               _in("dp_client:_DPClient._follow_members_power",
                   ("if lc.state not in CLIENT_LIVE:", "if True:")),
               _in("dp_client:_DPClient._after_all",
                   ("return _combine(decl.every_engine, results)",
                    "combined = _combine(decl.every_engine, results)\n"
                    "if decl.power is not None:\n"
                    "    self._on_power_reply(method, combined)\n"
                    "return combined")),
           )),
    # Issue 46: a leaving engine takes no new work from the moment scale() is called. The
    # router here still counts a DRAINING engine as serving (vLLM's scale-down kept routing to
    # the engines it was draining until the reconfiguration finished).
    Mutant("dp_leaver_still_routed",
           "a data-parallel client's router still picks an engine that is leaving (DRAINING,"
           " from the scale-down's call on) for routed ADDs", _DP, kind="elastic",
           patches=(_in("_dp_router:Router.pick",
                        ("s.lifecycle.state not in MEMBER_ROUTABLE",
                         's.lifecycle.state.name not in ("SERVING", "DRAINING")')),)),
    Mutant("dp_leaver_leftovers_never_ended",
           "a scale-down's leaver is shut down with requests still live on it (no drain, or"
           " past its deadline), and their ABORT batch is dropped: they never end", _DP,
           kind="elastic", patches=(_in(
               "dp_client:_DPClient._drain_done",
               ("ends = [EngineCoreOutput(r, [], FinishReason.ABORT, stop_reason=removal)\n"
                "        for r in rids]",
                "ends = []")),)),
    Mutant("dp_joiner_serves_before_commit",
           "a scale-up's joiner serves as soon as its own handshake arrives, while the other"
           " joiners still start (it takes requests before the scale commits, and a failed"
           " scale would have to take them back)", _DP, kind="elastic", patches=(
               _in("_dp_membership:Membership._build_all",
                   ("built.append((s, fut.result()))",
                    "built.append((s, fut.result()))\n"
                    "if abandon is not self.abandon:\n"
                    "    with self._lock:\n"
                    "        s.client = built[-1][1]\n"
                    "        s.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)")),
               _in("_dp_membership:Membership.join",
                   ("s.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)",
                    "if s.lifecycle.can(MembershipEvent.HANDSHAKE_OK):\n"
                    "    s.lifecycle.fire(MembershipEvent.HANDSHAKE_OK)")),
           )),
    # Issue 47: one engine serving several front ends at once, one row per property of the
    # composed model (spec/compose_fe.py), each a negative control there too.
    # Isolation: the shape of vLLM #27711-class bugs (outputs sent to the first API server's
    # socket whatever the request's client_index).
    Mutant("fe_outputs_routed_to_front_end_0",
           "an engine serving several front ends sends every step's outputs to front end 0,"
           " whatever front end sent the request", _FE, kind="front_ends",
           patches=(_in("engine_proc:EngineCoreProc._emit_scoped",
                        ("self.outputs[ch].put(batch,", "self.outputs[0].put(batch,")),)),
    Mutant("fe_gone_requests_left_running",
           "a front end that went (goodbye or heartbeat silence) loses its session, but its"
           " requests are left running in the engine (KV held, steps spent for nobody)", _FE,
           kind="front_ends",
           patches=(_in("engine_proc:EngineCoreProc._front_end_gone",
                        ("dropped = self._drop_channel(channel)", "dropped = 0")),)),
    Mutant("fe_power_notice_to_caller_only",
           "a sleep or wake-up from one front end is answered to it alone: the other front"
           " ends' clients still believe the engine runs (or sleeps)", _FE, kind="front_ends",
           patches=(_in("engine_proc:EngineCoreProc._notify_power",
                        ("if not self._scoped or call.method not in POWER_METHODS:",
                         "if True:")),)),
    Mutant("fe_finish_sent_twice",
           "with several front ends served, a step's batch split among them repeats each"
           " request's ending (a bare second finish to its sender)", _FE, kind="front_ends",
           patches=(_in("engine_proc:EngineCoreProc._emit_scoped",
                        ("outs[hit[0]].append(msgspec.structs.replace(out, request_id=hit[1]))",
                         "outs[hit[0]].append(msgspec.structs.replace(out, request_id=hit[1]))\n"
                         "if out.finish_reason is not None and len(served) > 1:\n"
                         "    outs[hit[0]].append(msgspec.structs.replace(\n"
                         "        out, request_id=hit[1], new_token_ids=[]))")),)),
)}

# The one mutant applied in this process: its name, its patches, and the environment
# variables as they were before (put back by revert).
_applied: tuple[str, AppliedPatches, dict[str, str | None]] | None = None


def active() -> str | None:
    """The name of the mutant applied in this process, or None."""
    return None if _applied is None else _applied[0]


def apply(name: str) -> None:
    """Switch the mutant ``name`` on in this process and in the engine processes it starts
    from now on. Applying the one already on does nothing; another one is an error."""
    global _applied
    if name not in BANK:
        raise ValueError(f"no mutant {name!r}; the bank has: {', '.join(sorted(BANK))}")
    if _applied is not None:
        if _applied[0] == name:
            return
        raise RuntimeError(f"mutant {_applied[0]!r} is on: revert() it before applying {name!r}")
    patches = apply_patches(BANK[name].patches, f"mutant {name}")
    saved = {k: os.environ.get(k) for k in (ENV_VAR, PRELOAD_ENV)}
    os.environ[ENV_VAR] = name
    entries = [e for e in (saved[PRELOAD_ENV] or "").split(",") if e.strip()]
    if PRELOAD_ENTRY not in entries:
        os.environ[PRELOAD_ENV] = ",".join([*entries, PRELOAD_ENTRY])
    _applied = (name, patches, saved)


def revert() -> None:
    """Switch the applied mutant off (the original code and environment); none: no-op."""
    global _applied
    if _applied is None:
        return
    _, patches, saved = _applied
    _applied = None
    patches.revert()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def apply_from_env() -> None:
    """Apply the mutant ``ENGINEWIRE_TESTING_MUTANT`` names, if any: the preload entry of
    engine processes, and a campaign child's first step."""
    name = os.environ.get(ENV_VAR) or None
    if name is None:
        return
    if name not in BANK:
        raise ValueError(
            f"{ENV_VAR}={name!r} names no mutant; the bank has: {', '.join(sorted(BANK))}")
    apply(name)
