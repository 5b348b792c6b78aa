"""The standalone-engine world: ``StandaloneEngine``, an engine started on its own (what
``enginewire engine`` runs); ``AttachPool``, whose clients attach to it and which replaces it
when a fault rule killed it; and ``StandaloneEngineStateMachine``, which runs
``EngineClientStateMachine``'s rules on those front ends, its engine faults included, and adds
the handover: the front end goes, cleanly or without a word, after a fault the engine survived
or not, and a new one attaches and carries on under a fresh oracle.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from typing import Any, TypedDict

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ..protocol.messages import EngineCoreOutputs, FinishReason
from ..protocol.records import EngineStats
from ..runtime.faults import INJECTED_EXIT_CODE
from ..runtime.ipc import OWNER_FILE, owned_tempdir
from ..spec.engine import EngineState
from ..spec.errors import ClientClosedError, EngineDeadError
from . import conformance as cf
from .bounds import LONG_MAX_TOKENS, MAX_LIVE, RULE_DEATH_BOUND_S, SHUTDOWN_BOUND_S, WAIT_S
from .campaign_stats import CampaignStats
from .oracle import Oracle, OracleViolation, ResourceSnapshot, check_released
from .pools import ClientPool, Live, close_and_check, ensure_resource_tracker
from .stateful_base import safe_note
from .stateful_client import MALFORMED, EngineClientStateMachine

__all__ = ["AttachPool", "StandaloneEngine", "StandaloneEngineStateMachine"]

# --- an engine started on its own, front end after front end --------------------------------

# The attached clients' heartbeat deadline, and the engine's beat: only the heartbeat reports
# the death of an engine the client did not start, so every SIGKILL, SIGSTOP and injected exit
# of the fault rules costs this deadline. Ten beats: 5 s (tests/runtime/test_reattach.py's)
# made a death cost ten examples' worth of steps; at 1 s a 4-minute 20 x 100 run on the
# loaded 2-core machine (13 332 steps, 53 deaths) saw no false one.
ATTACHED_HEARTBEAT_TIMEOUT_S = 1.0
STANDALONE_HEARTBEAT_S = 0.1
# Engine deaths per example: each costs the heartbeat deadline, a reap and a new engine's
# start and attach (about 0.5 s).
MAX_DEATHS = 1
# How each way to die leaves the engine process: a SIGSTOPped engine is SIGKILLed when reaped,
# a raise in a step is the engine's fatal-error exit (1), an injected exit is os._exit(17).
_EXIT_CODES = {"sigkill": -signal.SIGKILL, "sigstop": -signal.SIGKILL, "step_raise": 1,
               "step_exit": INJECTED_EXIT_CODE}
# handover_after_fault: the delay of a delayed step or utility reply as the front end goes.
FAULT_DELAY_S = 0.05
# handover's left-behind requests and its probes after the attach: seeds that differ, so an
# old output taken for a probe that reuses its id shows as a wrong token (null model).
LEFT_SEED = 21
PROBE_SEED = 22
PROBE_TOKENS = 8
# handover_mid_stream: how long the engine runs alone once its front end vanished, streaming
# (hundreds of null-model steps: many messages then wait for the next front end).
ALONE_S = 0.05
ATTACH_KINDS = ("sync", "async")
STANDALONE_DIR_PREFIX = "enginewire-standalone-"


class _HandoverDraws(TypedDict):
    left: st.SearchStrategy[int]
    then: st.SearchStrategy[str]
    next_kind: st.SearchStrategy[str]


# What both handover rules draw (``_handover``'s arguments).
_HANDOVER_DRAWS = _HandoverDraws(
    left=st.integers(0, 3), then=st.sampled_from(["running", "asleep", "paused", "pending"]),
    next_kind=st.sampled_from(ATTACH_KINDS))


def _no_abort(_request_ids: list[str]) -> None:
    """Stands in for a client's ``abort_left_behind``: the front end goes without a word."""


class StandaloneEngine:
    """An engine process started on its own (what ``enginewire engine`` runs): front ends
    attach to it one after another at the same ipc addresses, and it outlives each of them.

    ``close`` stops it (SIGTERM) and checks that it exited cleanly and that nothing it or its
    front ends held is left: its process, the socket files, this process's threads and fds.
    ``reap`` does the same for an engine a fault rule killed or stopped."""

    def __init__(self, config: Any, *, faults: bool = True) -> None:
        import multiprocessing

        import msgspec

        from ..runtime.engine_proc import process_main
        from ..runtime.faults import FaultPlan

        ensure_resource_tracker()
        self.config = config
        self.faults = faults
        self.before = ResourceSnapshot.take()
        # Owned by this process: a campaign killed outright leaves it, and the next standalone
        # engine to start removes it.
        self.dir = str(owned_tempdir(STANDALONE_DIR_PREFIX))
        self.input_address = f"ipc://{self.dir}/in"
        self.output_address = f"ipc://{self.dir}/out"
        # parent_pid: this engine waits for front ends without a deadline, so a campaign killed
        # before close() (a CI timeout's SIGTERM) would leave it running for good.
        kwargs: dict[str, Any] = {"input_address": self.input_address,
                                  "output_address": self.output_address,
                                  "heartbeat_interval_s": STANDALONE_HEARTBEAT_S,
                                  "parent_pid": os.getpid()}
        if faults:  # the fault rules arm what they inject through a utility call
            kwargs["fault"] = FaultPlan(allow_arm=True)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=process_main, name="StandaloneEngine", daemon=True,
                               args=(type(config), msgspec.msgpack.encode(config), kwargs))
        self.proc.start()
        assert self.proc.pid is not None  # started
        self.pid: int = self.proc.pid
        self._closed = False

    def attach(self, kind: str) -> cf.ClientUnderTest:
        """A new front end of ``kind`` (sync or async), attached to this engine."""
        if kind not in ATTACH_KINDS:
            raise ValueError(f"a front end attaching to a standalone engine is one of"
                             f" {ATTACH_KINDS}, not {kind!r}")
        return cf.open_client(kind, self.config, launch_engine=False,
                              input_address=self.input_address,
                              output_address=self.output_address,
                              engine_heartbeat_timeout_s=ATTACHED_HEARTBEAT_TIMEOUT_S,
                              ready_timeout_s=WAIT_S)

    def close(self, *, check: bool = True) -> None:
        """Stop the engine; with ``check``, OracleViolation if anything was left behind."""
        if self._closed:
            return
        self._closed = True
        problems = []
        proc = self.proc
        if not proc.is_alive():
            problems.append(f"the standalone engine did not outlive its front ends (exit"
                            f" code {proc.exitcode})")
        else:
            os.kill(self.pid, signal.SIGTERM)
            proc.join(SHUTDOWN_BOUND_S)
            if proc.is_alive():
                problems.append(f"the standalone engine ignored SIGTERM for {SHUTDOWN_BOUND_S} s")
                proc.kill()
                proc.join(WAIT_S)
            elif proc.exitcode != 0:
                problems.append(f"the standalone engine exited with {proc.exitcode} on SIGTERM")
        self._release(problems, check)

    def reap(self, how: str | None, *, check: bool = True) -> None:
        """Reap the engine a fault rule killed ``how`` (``_EXIT_CODES``), or stopped and left
        so: SIGKILL if it still runs, then, with ``check``, OracleViolation if it exited
        otherwise than ``how`` says or left anything behind. ``how`` None: the rule that
        meant to kill it did not finish (its failure is reported): reaped, not judged."""
        if self._closed:
            return
        self._closed = True
        problems = []
        proc = self.proc
        if how not in (None, "sigkill", "sigstop"):
            # An engine that dies by itself exits once its fatal error is logged and sent.
            proc.join(SHUTDOWN_BOUND_S)
            if proc.is_alive():
                problems.append(f"the standalone engine was still running {SHUTDOWN_BOUND_S} s"
                                f" after its death ({how}) was seen")
        if proc.is_alive():
            proc.kill()  # a stopped process takes a SIGKILL too
        proc.join(WAIT_S)
        if how is not None and proc.exitcode != _EXIT_CODES[how]:
            problems.append(f"the standalone engine killed by {how} exited with"
                            f" {proc.exitcode}, not {_EXIT_CODES[how]}")
        self._release(problems, check and how is not None)

    def _release(self, problems: list[str], check: bool) -> None:
        """The engine process is gone: release its handle and directory, and judge."""
        with contextlib.suppress(ValueError):  # still running after a SIGKILL: keep its fd
            self.proc.close()  # its sentinel fd
        release_engine_dir(self.dir, problems, check, self.before, self.pid)


def release_engine_dir(path: str, problems: list[str], check: bool,
                       before: ResourceSnapshot, engine_pid: int | None) -> None:
    """Engines started on their own are gone: remove their ipc directory ``path`` and, with
    ``check``, raise OracleViolation naming ``problems`` and anything left behind (a socket
    file a front end kept, a thread or fd of this process, an unreaped ``engine_pid``)."""
    import shutil

    # Every front end removes the socket files it bound (the engine binds none).
    left = sorted(set(os.listdir(path)) - {OWNER_FILE}) if os.path.isdir(path) else []
    if left:
        problems.append(f"socket files left behind by the front ends: {left}")
    shutil.rmtree(path, ignore_errors=True)
    if check and problems:
        raise OracleViolation("; ".join(problems))
    if check:
        check_released(before, engine_pid=engine_pid, ipc_path=path)


class AttachPool(ClientPool):
    """A ``ClientPool`` over a ``StandaloneEngine``: a new client attaches to it rather than
    starting an engine. Every example starts on a client of ``kind``: its rules depend on
    the kind, so an idle client of another kind (left by a handover) is shut down first.

    An engine a fault rule kills (``condemn``, then ``died``) is replaced at the next
    ``acquire``, once its last front end is gone: reaped and judged (``StandaloneEngine.reap``),
    and a new one started at fresh addresses, so the next front end and example carry on."""

    def __init__(self, engine: StandaloneEngine, stats: CampaignStats, kind: str = "sync"
                 ) -> None:
        super().__init__(lambda: self.engine.attach(kind), stats)
        self.engine = engine
        self.kind = kind
        # Set once a fault rule is about to kill the engine; then how it died, once seen.
        self._condemned = False
        self._died: str | None = None

    def condemn(self) -> None:
        """The engine is about to be killed: replace it at the next ``acquire`` whatever
        happens (a rule that fails halfway leaves it stopped or dying)."""
        self._condemned = True

    def died(self, how: str) -> None:
        """The engine's death (``how``) was seen: its exit is judged when it is reaped."""
        self._died = how

    def acquire(self) -> Live:
        idle = self._idle
        if idle is not None and (self._condemned or idle.cut.kind != self.kind):
            self._idle = None
            close_and_check(idle, check=not self._condemned)
        if self._condemned:
            self._replace_engine()
        if self._idle is not None:
            return super().acquire()
        return self.attach(self.kind)

    def _replace_engine(self) -> None:
        old, how = self.engine, self._died
        self._condemned, self._died = False, None
        try:
            old.reap(how)
        finally:  # a dead engine judged wrong is still replaced: the campaign goes on to report
            start = time.monotonic()
            self.engine = StandaloneEngine(old.config, faults=old.faults)
            self.stats.engines_started += 1
            self.stats.seconds["(engine start)"] += time.monotonic() - start

    def attach(self, kind: str) -> Live:
        before = ResourceSnapshot.take()
        start = time.monotonic()
        cut = self.engine.attach(kind)
        self.stats.seconds["(attach)"] += time.monotonic() - start
        return Live(cut, before, None, None)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._condemned:
                self.engine.reap(self._died)
            else:
                self.engine.close()


class StandaloneEngineStateMachine(EngineClientStateMachine):
    """``EngineClientStateMachine`` on front ends attached to one ``StandaloneEngine``, with
    ``handover``: the front end goes (cleanly, or without a word like a SIGKILLed process)
    and a new one, sync or async, attaches and carries on, under a fresh oracle.

    What a user relies on, judged at each handover: the old client's calls and reads end
    (``ClientClosedError``, or a value that beat the shutdown) and it forgets its requests;
    the old client releases its threads and fds; the new client finds the engine awake and
    idle (no live request, every KV block free); no output of an old request reaches it, even
    for an id it reuses at once (its probes reuse the old live ids, with another seed, so an
    old output shows as a wrong token).

    The launched machine's engine faults run here too, judged alike: ``crash`` (a SIGKILL,
    a SIGSTOP left so, a raise or an exit in a step) must be seen by the attached client
    within its heartbeat deadline, every blocked call failing with EngineDeadError; then
    ``restart`` gets a new front end on a new engine (the pool reaps and judges the dead one).
    ``malformed_frame`` and the delayed utilities the engine survives, and
    ``handover_after_fault`` hands it over in the middle of one. ``shutdown`` is not a rule:
    a front end that goes is the handovers' case."""

    death_bound_s = ATTACHED_HEARTBEAT_TIMEOUT_S + RULE_DEATH_BOUND_S

    def __init__(self, pool: AttachPool, **kwargs: Any) -> None:
        super().__init__(pool.factory, kind=pool.kind, pool=pool, orphan_config=None,
                         **kwargs)
        self.attach_pool = pool
        # Every id a previous front end of this example used: none may reach the current one.
        self._foreign: set[str] = set()
        self._deaths = 0  # engines this example killed (MAX_DEATHS)

    def _engine_pid(self) -> int | None:
        return self.attach_pool.engine.pid

    # Not a rule here (see the class docstring); same signature.
    def shutdown(self, with_pending: bool) -> None:
        raise NotImplementedError("a front end that goes is handover's case here")

    @precondition(lambda self: self.alive and self.faults and self._deaths < MAX_DEATHS
                  and self._life >= self.min_life)
    @rule(how=st.sampled_from(["sigkill", "sigstop", "step_raise", "step_exit"]),
          observers=st.booleans())
    def crash(self, how: str, observers: bool) -> None:
        """The engine dies, or hangs (SIGSTOP), under its attached front end: judged as the
        launched machine's ``crash``, within the heartbeat deadline. The pool replaces it."""
        with self._rule("crash", locals()):
            self._deaths += 1
            self.attach_pool.condemn()
            self.attach_pool.died(self._crash(how, observers))

    def _check_restarted(self) -> None:
        """``restart`` after the engine's death: the dead front end went (released, judged),
        the pool reaped the engine and started another; the new front end finds it fresh."""
        self.kind = self.cut.kind  # the pool's kind, which a handover may have changed
        self._check_fresh_engine()

    def _observe(self, batch: EngineCoreOutputs) -> None:
        for out in batch.outputs:
            if out.request_id in self._foreign and out.request_id not in self.oracle.requests:
                raise OracleViolation(
                    f"the new front end received an output for {out.request_id!r}, a request"
                    " of the front end it replaced")
        super()._observe(batch)

    # Two rules, one per way to go, so that a program hands over about twice as often.
    @precondition(lambda self: self.alive)
    @rule(**_HANDOVER_DRAWS)
    def handover_after_shutdown(self, left: int, then: str, next_kind: str) -> None:
        """The front end shuts down (it aborts what it leaves); see ``_handover``."""
        with self._rule("handover_after_shutdown", locals()):
            self._handover("shutdown", left, then, next_kind)

    @precondition(lambda self: self.alive)
    @rule(**_HANDOVER_DRAWS)
    def handover_after_vanish(self, left: int, then: str, next_kind: str) -> None:
        """The front end goes without a word, like a SIGKILLed process; see ``_handover``."""
        with self._rule("handover_after_vanish", locals()):
            self._handover("vanish", left, then, next_kind)

    @precondition(lambda self: self.alive)
    @rule(left=st.integers(1, 3), next_kind=st.sampled_from(ATTACH_KINDS))
    def handover_mid_stream(self, left: int, next_kind: str) -> None:
        """The front end vanishes while its requests stream, and its successor attaches once
        the engine has stepped alone for a while (a killed process's restart takes time):
        the old session's outputs are then certainly queued ahead of the new marker, the
        case the session check exists for; see ``_handover``."""
        with self._rule("handover_mid_stream", locals()):
            self._handover("vanish", left, "running", next_kind, alone=True)

    @precondition(lambda self: self.alive and self.faults and not self.oracle.paused)
    @rule(fault=st.sampled_from(["malformed_frame", "step_delay", "utility_delay", "sigstop"]),
          how=st.sampled_from(["shutdown", "vanish"]), next_kind=st.sampled_from(ATTACH_KINDS))
    def handover_after_fault(self, fault: str, how: str, next_kind: str) -> None:
        """A fault the engine survives strikes as its front end goes, one request left
        running, and the next front end must still find the engine fresh: garbage frames in
        flight, a step delayed, a utility reply delayed (the call pending as the front end
        goes), or the engine stopped (SIGSTOP) with a call held pending until the front end
        went, then resumed, as the launched machine's ``shutdown`` stops its engine. Not
        paused: a delayed step needs one to run. See ``_handover``."""
        with self._rule("handover_after_fault", locals()):
            self._handover(how, 1, "running", next_kind, fault=fault)

    def _handover(self, how: str, left: int, then: str, next_kind: str, *,
                  alone: bool = False, fault: str | None = None) -> None:
        """The front end goes, ``how``: shut down (it aborts what it leaves) or vanished (no
        abort). It leaves ``left`` long requests behind, with the engine ``then`` running
        them, asleep (level 1, keep), paused (keep), or with a read blocked and a sleep(wait)
        deferred; a ``fault`` strikes just before it goes (``_strike``). With ``alone`` the
        engine runs without a front end for ``ALONE_S`` first. A ``next_kind`` client attaches
        and the program goes on with it."""
        left_ids = self._leave_behind(left)
        waiters: list[concurrent.futures.Future[Any]] = []
        if then == "asleep":
            self.cut.sleep(1, "keep")
            self.oracle.pause("keep", 1)
        elif then == "paused":
            self.cut._call("pause_scheduler", "keep")
            self.oracle.pause("keep")
        elif then == "pending":
            waiters.append(self.cut.submit("get_output"))
            if not self.oracle.paused:  # paused, the engine replies at once
                waiters.append(self.cut.submit("sleep", 1, "wait"))
            self._until_blocked(waiters)
        stopped = None if fault is None else self._strike(fault, waiters)
        try:
            self._go(how, waiters)
        finally:
            if stopped is not None:
                os.kill(stopped[0], signal.SIGCONT)
        if stopped is not None:
            self._judge_held(*stopped[1:])
        if alone:
            # The engine steps alone meanwhile, and what it sends for the old session waits
            # in its pipe for the next front end to connect, which must drop all of it.
            time.sleep(ALONE_S)
        self._foreign |= set(self.oracle.requests)
        old_live = self.oracle.live_ids()
        self.oracle.closed()
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.oracle.max_in_flight)

        self.live = self.attach_pool.attach(next_kind)
        self.kind = next_kind
        self.oracle = Oracle(exact_tokens=self.exact_tokens)
        self._cached.clear()
        self._prompt_lens.clear()
        self._check_fresh_engine()
        self._probe(sorted(set(left_ids) | set(old_live))[:MAX_LIVE])

    def _leave_behind(self, n: int) -> list[str]:
        """``n`` requests long enough to be running when their front end goes."""
        ids: list[str] = []
        for _ in range(n):
            if self._full("handover: left behind"):
                break
            rid = self._fresh_id()
            req, expected, _ = self._request(rid, self._prompt(7, 8, 9), LONG_MAX_TOKENS,
                                             LEFT_SEED, None, True, 0.0, 1.0)
            self._send(req, expected, None)
            ids.append(rid)
        return ids

    def _until_blocked(self, waiters: list[concurrent.futures.Future[Any]]) -> None:
        """Until the read of ``waiters`` waits (a round trip issued after it has completed)
        and its deferred call is registered (or already ended: nothing to drain)."""
        self.cut.call_utility("echo", 0)
        deadline = time.monotonic() + WAIT_S
        while len(waiters) > 1 and not waiters[1].done() and not self._pending_calls():
            if time.monotonic() > deadline:
                raise OracleViolation("sleep(wait) was neither pending nor done")
            time.sleep(0.001)

    def _strike(self, fault: str, waiters: list[concurrent.futures.Future[Any]]
                ) -> tuple[int, float, concurrent.futures.Future[Any]] | None:
        """``handover_after_fault``'s fault, as the front end is about to go. A delayed
        reply's call joins ``waiters``. For a SIGSTOP: the stopped pid (resumed once the
        front end went), when it stopped, and the call it holds pending (``_judge_held``)."""
        self.stats.faults[fault] += 1
        if fault == "malformed_frame":
            for frames in MALFORMED:
                self.cut.client.send_raw_frames(list(frames))
        elif fault == "step_delay":  # the step the request left running takes next
            self._arm(f"step:1:delay:{FAULT_DELAY_S}")
        elif fault == "utility_delay":
            self._arm(f"utility:echo:1:delay:{FAULT_DELAY_S}")
            waiters.append(self.cut.submit("call_utility", "echo", "late"))
        else:
            pid = self._engine_pid()
            assert pid is not None
            cf.stop_process(pid)
            stopped = time.monotonic()
            held = self.cut.submit("call_utility", "echo", "held")
            try:
                self._wait_pending(1, held)
            except BaseException:
                os.kill(pid, signal.SIGCONT)
                raise
            return pid, stopped, held
        return None

    def _judge_held(self, stopped: float, held: concurrent.futures.Future[Any]) -> None:
        """The call a SIGSTOPped engine held as its front end went ends ClientClosedError;
        EngineDeadError only if the stop outlasted the heartbeat deadline before the front end
        was gone (a loaded machine), which then was a death the client had to report."""
        try:
            held.result(timeout=WAIT_S)
        except ClientClosedError:
            return
        except EngineDeadError:
            window = time.monotonic() - stopped
            if window < ATTACHED_HEARTBEAT_TIMEOUT_S:
                raise OracleViolation(
                    f"a call held by a SIGSTOPped engine raised EngineDeadError as its front"
                    f" end went, {window:.2f} s after the stop (heartbeat deadline"
                    f" {ATTACHED_HEARTBEAT_TIMEOUT_S} s)") from None
            safe_note(f"handover_after_fault: the stop lasted {window:.2f} s, past the heartbeat"
                      " deadline: the front end saw the engine die first")
        except concurrent.futures.TimeoutError:
            raise OracleViolation("a call held by a SIGSTOPped engine was never woken as its"
                                  " front end went") from None
        else:
            raise OracleViolation("a call held by a SIGSTOPped engine returned a value")

    def _go(self, how: str, waiters: list[concurrent.futures.Future[Any]]) -> None:
        """The current front end goes; its waiters end and it releases what it held."""
        live, client = self.live, self.cut.client
        if how == "shutdown":  # it aborts what it leaves: a read may see those ABORTs
            self.oracle.abort(self.oracle.live_ids())
        else:
            # What a SIGKILLed front end leaves (tests/runtime/test_reattach.py kills a child
            # process; this costs no interpreter): its requests running, no ABORT sent.
            client.abort_left_behind = _no_abort
        start = time.monotonic()
        client.shutdown()  # the async loop stays up until its waiters are judged
        took = time.monotonic() - start
        if took > SHUTDOWN_BOUND_S:
            raise OracleViolation(f"{how}: the front end took {took:.1f} s to go (bound"
                                  f" {SHUTDOWN_BOUND_S} s)")
        # Outputs that beat the shutdown are its own: judged.
        self._expect_closed(waiters, f"{how}: a call blocked as the front end went",
                            returned_ok=True)
        live.cut.shutdown()  # the async driver's loop
        if client.live_requests():
            raise OracleViolation(f"{how}: the old front end still counts"
                                  f" {client.live_requests()} as live")
        self._expect_raises(ClientClosedError, client.ensure_alive, "a front end that went")
        self._record_trace()
        check_released(live.before, engine_pid=None, ipc_path=None)

    def _check_fresh_engine(self) -> None:
        """The engine as after start-up: awake, no request, every KV block free."""
        if self.cut.is_sleeping():
            raise OracleViolation("is_sleeping() is True right after a new front end attached")
        stats = self.cut.call_utility("get_stats")
        if not isinstance(stats, EngineStats):
            raise OracleViolation(f"get_stats replied no EngineStats: {stats!r:.300}")
        if stats.state is not EngineState.IDLE or stats.num_live or (
                stats.num_free_blocks != stats.num_gpu_blocks):
            raise OracleViolation(
                f"the engine is not as after start-up once a new front end attached: state"
                f" {stats.state.name}, {stats.num_live} live request(s),"
                f" {stats.num_free_blocks}/{stats.num_gpu_blocks} KV blocks free")

    def _probe(self, reused: list[str]) -> None:
        """New requests complete; they reuse the old live ids (or one fresh id)."""
        ids = reused or [self._fresh_id()]
        for rid in ids:
            req, expected, _ = self._request(rid, self._prompt(5, 6), PROBE_TOKENS, PROBE_SEED,
                                             None, True, 0.0, 1.0)
            self._send(req, expected, None)
        self._drain(ids)
        for rid in ids:
            m = self.oracle.requests[rid]
            if m.finish is not FinishReason.LENGTH:
                raise OracleViolation(f"the new front end's request {rid!r} ended"
                                      f" {m.finish}, not LENGTH")
