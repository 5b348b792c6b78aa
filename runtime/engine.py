"""EngineCore: scheduler + executor behind the engine lifecycle, with the utility methods.

Theory of operation
-------------------
Rule 1: every engine state change is a fired ``ENGINE`` event, and every request state change
an ``ENGINE_REQUEST`` event; nothing here assigns a state.
Rule 2: this object does no I/O and starts no threads. A transport (in-process client or the
engine process's busy loop) calls ``add_request`` / ``abort_requests`` / ``call_utility`` as
messages arrive and ``step()`` while ``has_unfinished_requests() or has_pending_outputs()``.

Outputs that do not come from the model (ABORT and ERROR finishes) are queued and handed out
by the next ``step()``, so every output leaves through one place, in order.

Trace mode (a ``trace`` list given): every lifecycle records through one bounded
``EngineTrace`` (runtime/_engine_trace.py), which the ``drain_trace`` utility empties for the
front end; the given list still gets every entry.

Pause and sleep. ``pause_scheduler(mode)`` stops scheduling: ``abort`` finishes every live
request with ABORT; ``keep`` parks them (their KV stays, unless a sleep then releases it, in
which case they are preempted and recompute after wake); ``wait`` lets the requests live at
that moment finish first (DRAINING; new arrivals queue) and returns a ``Future`` that the step
which drains them completes. ``sleep(level, mode)`` pauses, then at level >= 1 releases memory
(level 1: weights to host, KV dropped; level 2: both dropped, weights reloaded from their
source). ``wake_up(tags)`` restores tags; scheduling resumes only when all are resident. A
wake-up while a ``wait`` still drains ends it: scheduling goes on, the deferred call fails.
``start_session()`` is for a new front end taking over: it ends the previous one's requests
and calls, and wakes or resumes the engine.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from ..protocol.codec import DEFAULT_LIMITS, checked_request_type
from ..protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from ..protocol.records import EngineStats, ResourceAudit, TraceDrain
from ..protocol.utilities import PAUSE_MODES, REMOTE_METHODS, SLEEP_LEVELS
from ..spec.engine import (
    ACCEPTS_WORK,
    ENGINE,
    HAS_WORK,
    INPROC,
    NO_LIVE_REQUESTS,
    NO_WORK,
    NONE_DRAINING,
    PARTIAL,
    PAUSE_EVENTS,
    REPORTS_SLEEPING,
    SCHEDULING,
    STATE_TRIGGERED,
    SUBPROCESS,
    EngineEvent,
    EngineState,
)
from ..spec.errors import ClientClosedError, EngineDeadError, UtilityError
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.request import ENGINE_REQUEST, EngineRequestEvent
from ._engine_trace import TRACE_BOUND, EngineTrace
from .config import EngineConfig
from .executor import MEMORY_TAGS, UniProcExecutor
from .fault_points import FaultPoint
from .kv_cache import KVCacheManager
from .scheduler import Request, Scheduler

__all__ = ["PAUSE_MODES", "SLEEP_LEVELS", "WAKE_TAGS", "EngineCore"]

logger = logging.getLogger(__name__)
S, E = EngineState, EngineEvent
# "scheduling" is the level-0 tag (vLLM): waking it alone releases nothing to restore.
WAKE_TAGS = (*MEMORY_TAGS, "scheduling")
# The most outputs one EngineCoreOutputs may carry: what every client's decoder accepts.
_MAX_BATCH = DEFAULT_LIMITS.max_batch
# Names each engine core of this process in its drained traces (an id() could be reused).
_ENGINE_SERIAL = itertools.count(1)


def _describe_tensor(value: object) -> str:
    """``float32[4, 64]`` for an array or tensor, the type name for anything else."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"



# What a refused trace directory's error tells its user to do (docs/security.md says the same).
PROFILE_DIR_REMEDY = ("remove it (or fix its owner and mode), or pass profile(path=...) a"
                      " directory only this user can write; see docs/security.md, 'Profiler"
                      " traces'")


def default_profile_dir() -> str:
    """Where ``profile`` writes without a path: ``<temp dir>/enginewire-profile-<uid>``.

    Per user, so users never share it; the name is predictable, so one another user made
    first is refused by ``_private_dir``, never used."""
    return os.path.join(tempfile.gettempdir(), f"enginewire-profile-{os.geteuid()}")


def _refusal(st: os.stat_result, uid: int, *, parent: bool) -> str | None:
    """Why another user could read or replace what a directory (``st`` its lstat, or stat
    for a parent) holds, or None.

    A parent may also be root's (/tmp, /var), and writable by others when sticky (/tmp):
    others can then add names to it but not rename or remove ours."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "is a symlink"
    if not stat.S_ISDIR(mode):
        return "is not a directory"
    if st.st_uid != uid and not (parent and st.st_uid == 0):
        return f"is owned by uid {st.st_uid}, not by this engine's uid {uid}"
    if mode & 0o022 and not (parent and mode & stat.S_ISVTX):
        return f"is writable by its group or others (mode {stat.S_IMODE(mode):04o})"
    return None


def _refuse_unless_private(path: str, st: os.stat_result, uid: int) -> None:
    why = _refusal(st, uid, parent=False)
    if why is not None:
        raise PermissionError(f"profile directory {path!r} {why}: traces there could be read"
                              f" or replaced by another user; {PROFILE_DIR_REMEDY}")


def _private_dir(path: object) -> str:
    """``path`` as a directory only this user can write into, or a PermissionError naming it
    and ``PROFILE_DIR_REMEDY``; nothing is created when it is refused.

    An existing ``path`` must be a real directory (not a symlink) of this uid that its group
    and others cannot write. Its parent (the nearest existing ancestor when levels are
    missing) must be this uid's or root's and not writable by others unless sticky, or
    another user could rename ``path`` away and put their own in its place. Missing levels
    are made 0700."""
    if not isinstance(path, str) or not path:
        raise TypeError(f"a directory path (str) is required, got {path!r}")
    target = os.path.abspath(path)
    uid = os.geteuid()
    missing: list[str] = []
    here = target
    while True:
        try:
            st = os.lstat(here)
            break
        except FileNotFoundError:
            if os.path.dirname(here) == here:
                raise
            missing.append(here)
            here = os.path.dirname(here)
    if not missing:
        _refuse_unless_private(target, st, uid)
    parent = here if missing else os.path.dirname(target)
    # Judged where it leads (os.stat): a symlinked ancestor (/var/run) is common, and only
    # its target's owner and mode decide who could replace what is in it.
    why = _refusal(os.stat(parent), uid, parent=True)
    if why is not None:
        raise PermissionError(f"profile directory {target!r}: its parent {parent!r} {why}, so"
                              " another user could replace it and read or replace the traces"
                              f" in it; {PROFILE_DIR_REMEDY}")
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)  # mkdir's mode is masked by umask; chmod makes it exact
        except FileExistsError:  # another engine of a data-parallel group made it first
            _refuse_unless_private(level, os.lstat(level), uid)
            continue
        os.chmod(level, 0o700)
    if not os.access(target, os.W_OK | os.X_OK):
        raise PermissionError(f"profile directory {target!r} is not writable")
    return target


class EngineCore:
    # Names of ``EngineCoreRequest.tensors`` entries the engine consumes. None yet: every model
    # here reads token ids only, and a request whose tensors would be dropped finishes with an
    # ERROR that names them rather than silently generating from the token ids alone.
    ACCEPTED_TENSORS: frozenset[str] = frozenset()

    # The allow-list: every utility declared remote (protocol/utilities.py), each a method
    # of this class by the same name.
    UTILITY_METHODS: frozenset[str] = REMOTE_METHODS

    def __init__(
        self,
        config: EngineConfig,
        *,
        inproc: bool = True,
        trace: list[TraceEntry] | None = None,
        stream_outputs: bool = False,
    ) -> None:
        self.config = config
        self.trace = trace
        # What drain_trace hands out: the lifecycles record through it (a caller's own list
        # still gets every entry). None: this engine records no trace (neither its caller
        # nor config.engine_trace_records asked for one).
        records = getattr(config, "engine_trace_records", 0)
        self.engine_trace: EngineTrace | None = (
            trace if isinstance(trace, EngineTrace)
            else None if trace is None and not records
            else EngineTrace(records or TRACE_BOUND, sink=trace))
        self._trace_source = f"{os.getpid()}.{next(_ENGINE_SERIAL)}"
        # Presentation only (issue 45): every step makes plain decode outputs the wire's
        # columns (EngineCoreOutputs.stream_ids/_tokens) and, where the worker can, runs the
        # decode batch. ``stream_outputs`` says whether ``step()`` returns the batch so (the
        # engine process and every client do; they expand at their delivery edge) or with
        # its columns expanded, for a caller of the bare core that reads ``outputs`` only.
        self.stream_outputs = stream_outputs
        self.lifecycle: Lifecycle[EngineState, EngineEvent] = ENGINE.lifecycle(
            trace=self.engine_trace)
        # The fault harness's hook (runtime/faults.py), called with a FaultPoint (and, at
        # UTILITY, the method); None: no plan.
        self.fault_hook: Callable[..., None] | None = None
        self.fatal_error: BaseException | None = None
        self.device = config.resolved_device()
        self.executor: UniProcExecutor | None = None
        try:
            self.executor = UniProcExecutor(config)
            arch = self.executor.arch
            if config.max_model_len > arch.max_position:
                raise ValueError(
                    f"EngineConfig.max_model_len={config.max_model_len}: the model supports "
                    f"at most {arch.max_position} positions"
                )
            self.num_gpu_blocks = self.executor.initialize()
        except BaseException as exc:
            if self.executor is not None:
                self.executor.shutdown()
            self.fatal_error = exc
            self.lifecycle.fire(E.FATAL_ERROR)
            raise
        self.arch = self.executor.arch
        # What an engine process decodes ADDs into: token ids checked against this vocabulary
        # as they were built, lists nobody else holds (codec.checked_request_type).
        self._checked_request = checked_request_type(self.arch.vocab_size)
        self.kv = KVCacheManager(self.num_gpu_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            policy=config.scheduling_policy,
            # Column-wise decode needs only a worker that reads the batch: the columns it
            # returns are how every step hands out plain decodes (see stream_outputs).
            decode_batch=self.executor.supports_decode_batch,
        )
        self._pending: list[EngineCoreOutput] = []
        # Abort ids another thread saw arrive while a step runs (the process wrapper's input
        # thread appends; deque appends/pops are atomic). They are applied after the forward
        # pass and before its tokens are, so an aborted request gets no token from that step.
        # The same ids also travel in order through the input queue, so an abort that races
        # ahead of its ADD is a no-op here and still lands after the ADD there.
        self.mid_step_aborts: collections.deque[str] = collections.deque()
        self._final: list[EngineCoreOutput] = []
        # (future, action run when the engine has drained and paused) for deferred replies.
        self._deferred: list[tuple[Future[Any], Callable[[], None] | None]] = []
        self._seq = 0
        self.step_counter = 0
        self._profiler: Any = None
        self._profile_dir: str | None = None
        self._profile_count = 0
        self.lifecycle.fire(E.BUILT, guard=INPROC if inproc else SUBPROCESS)

    # -- introspection -------------------------------------------------------------------------

    def ready_info(self) -> dict[str, Any]:
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.config.block_size,
            "max_model_len": self.config.max_model_len,
            "model": self.config.model,
            "device": self.device,
        }

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    def has_unfinished_requests(self) -> bool:
        """True when a ``step()`` would schedule work (False while paused or asleep, like
        vLLM's pause-aware ``has_requests``: parked requests do not make the loop spin)."""
        return self.lifecycle.state in SCHEDULING and bool(self.scheduler.requests)

    def has_pending_outputs(self) -> bool:
        return bool(self._pending)

    def num_live_requests(self) -> int:
        return len(self.scheduler.requests)

    # -- requests ------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        st = self.lifecycle.state
        if st is S.DEAD:
            raise EngineDeadError() from self.fatal_error
        if st is S.SHUTDOWN:
            raise ClientClosedError("engine core was shut down")

    def _validate(self, req: EngineCoreRequest) -> str | None:
        ids, sp = req.prompt_token_ids, req.sampling_params
        vocab = self.arch.vocab_size
        if not ids:
            return "prompt_token_ids is empty"
        # A decoded ADD's ids were range-checked by its decoder: the scan is half the work of
        # admitting a request (10 µs for 512 ids).
        if type(req) is not self._checked_request and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            return f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
        if len(ids) > self.config.max_model_len:
            return (f"prompt has {len(ids)} tokens, more than max_model_len="
                    f"{self.config.max_model_len}")
        if sp.max_tokens < 1:
            return f"max_tokens={sp.max_tokens} must be >= 1"
        if not sp.temperature >= 0.0:
            return f"temperature={sp.temperature} must be >= 0"
        if not 0.0 < sp.top_p <= 1.0:
            return f"top_p={sp.top_p} must be in (0, 1]"
        if sp.top_k < 0:
            return f"top_k={sp.top_k} must be >= 0 (0 = off)"
        if req.priority and self.scheduler.policy == "fcfs":
            return (f"priority={req.priority} needs EngineConfig.scheduling_policy='priority' "
                    f"(this engine runs 'fcfs')")
        if not math.isfinite(req.arrival_time):  # NaN would corrupt the waiting heap's order
            return f"arrival_time={req.arrival_time} must be a finite number"
        if req.tensors:
            return self._tensors_error(req.tensors)
        return None

    def _tensors_error(self, tensors: object) -> str | None:
        if not isinstance(tensors, dict):
            return f"tensors must map names to arrays, got {type(tensors).__name__}"
        bad = [f"{name!r} ({_describe_tensor(v)})" for name, v in sorted(
            tensors.items(), key=lambda kv: str(kv[0])) if name not in self.ACCEPTED_TENSORS]
        if not bad:
            return None
        accepted = sorted(self.ACCEPTED_TENSORS) or "none"
        return (f"model {self.config.model!r} does not accept request tensors {', '.join(bad)}; "
                f"accepted tensors: {accepted}")

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue ``req``; an invalid one finishes with an ERROR output on the next ``step()``."""
        if not isinstance(req.request_id, str):
            raise TypeError(f"request_id must be str, got {type(req.request_id).__name__}")
        self._check_alive()
        live = self.scheduler.requests.get(req.request_id)
        if live is not None:
            # One id names one request (spec/request.py, Rule 2). Answering the duplicate
            # alone would put an ERROR finish in the middle of the live request's stream, so
            # the live request ends with the ERROR and the duplicate is dropped.
            self._pending.append(self.scheduler.finish(
                live, EngineRequestEvent.ERROR, FinishReason.ERROR,
                error=f"request id {req.request_id!r} was sent again while live"))
            self.scheduler.running = [r for r in self.scheduler.running if not r.finished]
            self._settle()
            return
        error = self._validate(req)
        if error is not None:
            self.reject_request(req.request_id, error)
            return
        seq = self._seq
        self._seq = seq + 1
        default_seed = (self.config.seed * 1_000_003 + seq) & 0x7FFF_FFFF
        self.scheduler.add(Request(req, seq, self.arch.eos_token_id, default_seed,
                                   self.config.max_model_len,
                                   self._request_trace(req.request_id),
                                   own_ids=type(req) is self._checked_request))
        if self.lifecycle.state in ACCEPTS_WORK:
            self.lifecycle.fire(E.WORK_ARRIVED)

    def reject_request(self, request_id: str, error: str) -> bool:
        """Answer a request that never became one (it arrived malformed) with an ERROR output
        on the next ``step()``, as for an invalid request; False (nothing sent) when its id
        names a live request: an ERROR under that id would finish the live request for its
        front end while it streams on (outputs after a finish). The rejected message never
        became a request, so it has no id of its own to be answered by."""
        if request_id in self.scheduler.requests:
            logger.warning("dropped a malformed ADD that reuses the id of live request %.80r"
                           " (the live request is left alone): %.200s", request_id, error)
            return False
        lc = ENGINE_REQUEST.lifecycle(trace=self._request_trace(request_id))
        lc.fire(EngineRequestEvent.REJECT)
        self._pending.append(EngineCoreOutput(request_id, [], FinishReason.ERROR, None, 0, error))
        return True

    def _request_trace(self, request_id: str) -> list[TraceEntry] | None:
        trace = self.engine_trace
        return None if trace is None else trace.for_request(request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End each live request with an ABORT output; unknown or finished ids are no-ops."""
        if isinstance(request_ids, str):  # a bare id would iterate per character
            request_ids = (request_ids,)
        outs = self._abort(request_ids)
        if outs:
            self._pending.extend(outs)
            self._settle()

    def _abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """The scheduler's aborts; with a trace, an id it does not hold (unknown, or finished
        and so forgotten) records the spec's no-op UNKNOWN loop under its name."""
        if self.engine_trace is None:
            return self.scheduler.abort(request_ids)
        unknown: list[str] = []
        outs = self.scheduler.abort(request_ids, unknown)
        for rid in unknown:
            ENGINE_REQUEST.lifecycle(trace=self._request_trace(rid)).fire(EngineRequestEvent.ABORT)
        return outs

    def _abort_mid_step(
        self, reqs: list[Request], nums: list[int], tokens: list[int]
    ) -> tuple[list[Request], list[int], list[int], list[EngineCoreOutput]]:
        pop = self.mid_step_aborts.popleft
        ids = [pop() for _ in range(len(self.mid_step_aborts))]
        aborted = self._abort(ids)
        if not aborted:
            return reqs, nums, tokens, []
        keep = [i for i, r in enumerate(reqs) if not r.finished]
        return ([reqs[i] for i in keep], [nums[i] for i in keep], [tokens[i] for i in keep],
                aborted)

    # -- stepping ------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One scheduling step; returns every output produced since the last step.

        A step the scheduler chose to run column-wise (``Scheduler.step_batch``, see
        ``Scheduler.decode_batch_applies``) goes through ``execute_decode`` and
        ``update_decode``, unless an abort landed mid-step; every other step, the general
        path, through ``execute_model`` and ``update``. Both make the same outputs, and
        plain decodes leave as stream columns either way (``stream_outputs`` only says
        whether they are expanded before ``step`` returns).

        Any exception from scheduling or the model (a fault injected at ``step`` or
        ``forward`` included) is fatal: the engine fires FATAL_ERROR and re-raises.
        """
        lc = self.lifecycle
        st = lc.state
        if st in ENGINE.terminal:
            self._check_alive()
        if self.fault_hook is not None:
            try:
                self.fault_hook(FaultPoint.STEP)
            except Exception as exc:
                self._die(exc)
                raise
        # Every id here also sits in the input queue, applied in order before this step, so
        # what is left from before the step started is stale: kept, it would abort a later
        # request that reuses the id (found by the campaign: a reused id ended ABORT).
        self.mid_step_aborts.clear()
        if self.scheduler.ended:  # the last step's, not taken (see take_ended)
            self.scheduler.ended = []
        outs = self._pending
        finished: list[str] | None = None
        stream: tuple[list[str], list[int]] = ([], [])
        if outs:
            # A batch carries at most max_batch outputs (what a client decodes): room is
            # kept for this step's own, and the rest of a huge abort goes out next step.
            cap = _MAX_BATCH - self.config.max_num_seqs
            if len(outs) > cap:
                outs, self._pending = outs[:cap], outs[cap:]
            else:
                self._pending = []
            finished = [o.request_id for o in outs]
        sched = self.scheduler
        if st in SCHEDULING and sched.requests:
            if st is S.IDLE:  # work queued before the loop started (subprocess start-up)
                lc.fire(E.WORK_ARRIVED)
            try:
                reqs, nums = sched.schedule()
                if reqs:
                    if self.fault_hook is not None:
                        self.fault_hook(FaultPoint.FORWARD)
                    executor = self.executor
                    assert executor is not None
                    batch = sched.step_batch
                    if batch is not None:
                        toks = executor.execute_decode(batch)
                        if self.mid_step_aborts:  # an abort lands mid-step: per request
                            sched.release_batch()
                            tokens = toks.tolist()
                            batch = None
                    else:
                        tokens = executor.execute_model(reqs, nums)
                    if batch is not None:
                        # The batch's columns come back whole.
                        step_outs, step_finished, sids, stoks = sched.update_decode(
                            batch, toks)
                        stream = (sids, stoks)
                    else:
                        if self.mid_step_aborts:
                            reqs, nums, tokens, aborted = self._abort_mid_step(
                                reqs, nums, tokens)
                            if aborted:
                                outs = [*outs, *aborted]
                                finished = [*(finished or ()),
                                            *(o.request_id for o in aborted)]
                        step_outs, step_finished = sched.update(reqs, nums, tokens, stream)
                    if outs:
                        outs.extend(step_outs)
                    else:
                        outs = step_outs
                    if step_finished:
                        if finished is None:
                            finished = step_finished
                        else:
                            finished.extend(step_finished)
            except Exception as exc:
                self._die(exc)
                raise
            self.step_counter += 1
            self._settle()
        stats = SchedulerStats(len(sched.running), sched.num_waiting, self.kv.usage(),
                               sched.num_preemptions, self.step_counter)
        if stream[0]:
            out = EngineCoreOutputs(0, outs, time.monotonic(), finished, stats, None, *stream)
            return out if self.stream_outputs else out.expanded()
        return EngineCoreOutputs(0, outs, time.monotonic(), finished, stats)

    def _settle(self) -> None:
        """Fire the event that the requests' new situation implies, if any: the spec's
        state-triggered table, with this engine's reading of each condition."""
        trigger = STATE_TRIGGERED.get(self.lifecycle.state)
        if trigger is None:
            return
        condition, event = trigger
        if condition == NO_LIVE_REQUESTS:
            holds = not self.scheduler.requests
        elif condition == NONE_DRAINING:
            holds = self.scheduler.num_draining() == 0
        else:  # a condition added to the table needs its reading here
            raise NotImplementedError(f"state-triggered condition {condition!r}")
        if not holds:
            return
        if event is E.DRAINED:
            self.scheduler.drain_only = False
        self.lifecycle.fire(event)
        if event is E.DRAINED:
            self._complete_deferred()

    def _complete_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for fut, action in deferred:
            try:
                if action is not None:
                    action()
            except Exception as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def _fail_deferred(self, exc: BaseException) -> None:
        deferred, self._deferred = self._deferred, []
        for fut, _ in deferred:
            if not fut.done():
                fut.set_exception(exc)

    def _die(self, exc: BaseException) -> None:
        self.fatal_error = exc
        if self.lifecycle.can(E.FATAL_ERROR):
            self.lifecycle.fire(E.FATAL_ERROR)
        dead = EngineDeadError()
        dead.__cause__ = exc
        self._fail_deferred(dead)

    # -- utilities -----------------------------------------------------------------------------

    def call_utility(self, method: str, args: Sequence[object] = ()) -> object:
        """Run an allow-listed utility; its own exceptions propagate unchanged.

        A ``Future`` result means the reply is deferred: a later ``step()`` completes it.
        """
        if not isinstance(method, str) or method not in self.UTILITY_METHODS:
            raise UtilityError(
                str(method), f"no such utility method; allowed: {sorted(self.UTILITY_METHODS)}")
        if self.fault_hook is not None:
            self.fault_hook(FaultPoint.UTILITY, method)
        fn: Callable[..., object] = getattr(self, method)
        return fn(*args)

    def echo(self, x: object) -> object:
        return x

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        self._check_alive()
        return self.executor.collective_rpc(method, args, kwargs)  # type: ignore[union-attr]

    def save_sharded_state(self, path: str) -> list[str]:
        """Write the weights as safetensors under ``path``; return the files written."""
        self._check_alive()
        return self.executor.save_sharded_state(path)  # type: ignore[union-attr]

    def profile(self, action: str, path: str | None = None) -> str | None:
        """``start`` a torch profiler, or ``stop`` it and write a Chrome trace; returns its path.

        The trace directory (``path``, else the one given at start, else
        ``default_profile_dir()``) is made private and checked by ``_private_dir`` before the
        profiler starts or stops, so a bad or unsafe one is refused with the session intact
        (a stopped profiler cannot resume) and nothing started.
        """
        if action == "start":
            if self._profiler is not None:
                raise RuntimeError("profiler already running")
            out_dir = _private_dir(default_profile_dir() if path is None else path)
            import torch  # here, not at the top: a null-model engine never loads torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.startswith("cuda"):
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=acts)
            self._profiler.start()
            self._profile_dir = out_dir
            return None
        if action == "stop":
            if self._profiler is None:
                raise RuntimeError("profiler is not running")
            # Checked again: the directory may have changed hands since the start.
            out_dir = _private_dir(path or self._profile_dir or default_profile_dir())
            prof, self._profiler = self._profiler, None
            prof.stop()
            self._profile_count += 1
            out = os.path.join(out_dir, f"trace-{os.getpid()}-{self._profile_count}.json")
            prof.export_chrome_trace(out)
            return out
        raise ValueError(f"profile action must be 'start' or 'stop', got {action!r}")

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        sched, kv, executor = self.scheduler, self.kv, self.executor
        mem = executor.driver.report_memory() if executor else {}
        return EngineStats(
            state=self.lifecycle.state,
            num_running=len(sched.running),
            num_waiting=sched.num_waiting,
            num_live=len(sched.requests),
            num_preemptions=sched.num_preemptions,
            num_priority_preemptions=sched.num_priority_preemptions,
            scheduling_policy=sched.policy,
            step_counter=self.step_counter,
            num_gpu_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            profiled_num_blocks=executor.driver.profiled_num_blocks if executor else None,
            device_tensor_bytes=mem.get("device_tensor_bytes"),
            host_offload_bytes=mem.get("host_offload_bytes"),
            sleeping=tuple(mem.get("sleeping", ())),
            cuda_memory_allocated=mem.get("cuda_memory_allocated"),
        )

    def audit_resources(self) -> ResourceAudit:
        """Read-only: the resource accounting a quiet engine must balance (KV blocks, queues,
        pending outputs and replies, memory asleep), recounted for model_tests/oracle.py."""
        executor = self.executor
        return ResourceAudit(
            state=self.lifecycle.state,
            kv=self.kv.audit(),
            scheduler=self.scheduler.audit(),
            pending_outputs=len(self._pending),
            deferred_replies=len(self._deferred),
            mid_step_aborts=len(self.mid_step_aborts),
            asleep_tags=tuple(sorted(executor.sleeping)) if executor is not None else (),
        )

    def drain_trace(self) -> TraceDrain:
        """Read-only, trace mode only: this engine's lifecycle records since the last call, in
        its order (runtime/_engine_trace.py), with its state now and the name of this engine
        core (``source``), for model_tests/oracle.py's cross-checks."""
        if self.engine_trace is None:
            raise UtilityError("drain_trace", "this engine records no trace (an in-process"
                               " client records one when given trace=[...]; an engine"
                               " process when started with ENGINEWIRE_ENGINE_TRACE set)")
        return self.engine_trace.drain(source=self._trace_source, state=self.lifecycle.state)

    def pause_scheduler(self, mode: str = "abort") -> Future[Any] | None:
        """Stop scheduling; see the module docstring. A ``Future`` when ``wait`` must drain."""
        return self._pause(mode, None)

    def _pause(self, mode: str, then: Callable[[], None] | None) -> Future[Any] | None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._check_alive()
        lc, sched = self.lifecycle, self.scheduler
        st, event = lc.state, PAUSE_EVENTS[mode]
        if not lc.can(event):
            lc.fire(event)  # raises SpecViolation before anything changed
        if mode == "abort":
            self._pending.extend(sched.abort_all())
        elif mode == "wait" and st is S.RUNNING:
            sched.start_drain()
        lc.fire(event)
        if lc.state is S.DRAINING:
            fut: Future[Any] = Future()
            self._deferred.append((fut, then))
            return fut
        sched.drain_only = False
        if st is S.DRAINING:  # abort/keep ended a drain: the waiters' wait is over
            self._complete_deferred()
        if then is not None:
            then()
        return None

    def resume_scheduler(self) -> None:
        self._check_alive()
        # Paused: into RUNNING or IDLE; active: a no-op; draining or asleep: a SpecViolation.
        self._fire_resolving(E.RESUME)

    def _fire_resolving(self, event: EngineEvent) -> None:
        """Fire ``event`` with the guard the table asks for in this state: HAS_WORK or
        NO_WORK where its rows split on parked work, none where it has a plain row (or no
        row at all, and the SpecViolation says so). The table, not a chain of state tests,
        says where scheduling resumes, so a new row is followed without an edit here."""
        lc = self.lifecycle
        if HAS_WORK in ENGINE.guards(lc.state, event):
            lc.fire(event, HAS_WORK if self.scheduler.requests else NO_WORK)
        else:
            lc.fire(event)

    def sleep(self, level: int = 1, mode: str = "abort") -> Future[Any] | None:
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if mode not in PAUSE_MODES:
            raise ValueError(f"sleep mode must be one of {PAUSE_MODES}, got {mode!r}")
        if self.fault_hook is not None:
            self.fault_hook(FaultPoint.SLEEP)
        then = None if level == 0 else (lambda: self._release_memory(level))
        return self._pause(mode, then)

    def _release_memory(self, level: int) -> None:
        # KV is about to vanish: parked requests will recompute it after wake.
        self.scheduler.preempt_all_running()
        self.executor.sleep(level)  # type: ignore[union-attr]
        self.kv.reset()
        self.lifecycle.fire(E.RELEASE_MEMORY)

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Restore ``tags`` (all when None); True once everything is resident and scheduling."""
        if self.fault_hook is not None:
            self.fault_hook(FaultPoint.WAKE_UP)
        if isinstance(tags, (str, bytes)):  # a raw call_utility("wake_up", "weights")
            # Iterated, it would be refused as tag 'w', naming a tag nobody sent.
            raise TypeError(f"wake_up tags must be a list such as ['weights'] or None, "
                            f"got {tags!r}")
        wanted = list(WAKE_TAGS) if tags is None else list(tags)
        for t in wanted:
            if t not in WAKE_TAGS:
                raise ValueError(f"wake_up tag must be one of {WAKE_TAGS}, got {t!r}")
        self._check_alive()
        lc = self.lifecycle
        st = lc.state
        executor = self.executor
        assert executor is not None
        if PARTIAL in ENGINE.guards(st, E.WAKE_UP):  # memory was released: restore it
            executor.wake_up([t for t in wanted if t in MEMORY_TAGS])
            if executor.sleeping:
                lc.fire(E.WAKE_UP, PARTIAL)
                return False
        # Asleep, paused or draining: scheduling resumes; awake: a no-op.
        self._fire_resolving(E.WAKE_UP)
        if st is S.DRAINING:
            # A sleep/pause(wait) still draining: the wake-up wins. Scheduling goes on as
            # before the pause and the deferred call is answered with an error.
            self._end_drain()
            self._fail_deferred(UtilityError(
                "sleep", "ended by wake_up() before the engine drained: it did not pause"))
        return True

    def start_session(self) -> int:
        """A new front end took this engine over (an engine started on its own outlives its
        front ends): end everything the previous one started and leave the engine as after
        start-up, awake and scheduling with no request. Returns how many requests it dropped.

        Only existing transitions: the requests end with ABORT (their outputs are dropped:
        nobody who asked for them is listening), deferred calls fail, and an engine asleep,
        paused or draining wakes up (every tag) into IDLE; a running one settles into IDLE."""
        self._check_alive()
        self._fail_deferred(UtilityError("deferred call", "its front end was replaced"))
        dropped = len(self.scheduler.abort_all())
        self._pending = []
        self.mid_step_aborts.clear()
        if self.lifecycle.state in REPORTS_SLEEPING:
            self.wake_up()
        else:
            self._settle()
        self.kv.reset_prefix_cache()
        return dropped

    def _end_drain(self) -> None:
        self.scheduler.end_drain()

    def is_sleeping(self) -> bool:
        return self.lifecycle.state in REPORTS_SLEEPING

    # -- shutdown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Idempotent. Live requests end with ABORT; ``take_final_outputs()`` hands them over."""
        if self.lifecycle.state is S.SHUTDOWN:
            return
        self._final.extend(self._pending)
        self._pending = []
        self._final.extend(self.scheduler.abort_all())
        self._fail_deferred(UtilityError("deferred call", "engine shut down before it completed"))
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self.executor is not None:
            self.executor.shutdown()
        self.lifecycle.fire(E.SHUTDOWN)

    def take_ended(self) -> list[Any]:
        """The requests the last step finished in its batch, which this engine would
        otherwise tear down inside ``step()`` (before their outputs leave): the caller drops
        them where that costs least. The next step drops any not taken."""
        ended, self.scheduler.ended = self.scheduler.ended, []
        return ended

    def take_final_outputs(self) -> EngineCoreOutputs | None:
        """Outputs produced by ``shutdown()`` (ABORTs of live requests), a batch of at most
        max_batch at a time; None once all were taken."""
        if not self._final:
            return None
        outs, self._final = self._final[:_MAX_BATCH], self._final[_MAX_BATCH:]
        return EngineCoreOutputs(0, outs, time.monotonic(), [o.request_id for o in outs])
