"""Client factories for vLLM 0.33's real ``SyncMPClient`` / ``AsyncMPClient`` (issue #33).

Theory of operation
-------------------
Rule 1: vLLM's client code runs unmodified. Each client is vLLM's own class, attached through
``client_addresses`` to an enginewire engine process speaking vLLM's wire
(``enginewire.runtime.vllm_wire``). The factory launches that process and plays vLLM's
``CoreEngineProcManager`` for it: vLLM's own monitor thread (``start_engine_core_monitor``)
watches it, so death is detected as in vLLM's engine-managed mode (reference §3.5).
Rule 2: the adapter only translates. ``VllmClientAdapter`` turns enginewire's requests into
vLLM's, vLLM's outputs and errors into enginewire's (types only: a decode error is a
``ProtocolError``, a missed ready an ``EngineStartupError``), and gives the
blocking-with-timeout surface the driver calls.
Rule 3: differences are declared, as data. Where vLLM's documented contract differs from
enginewire's, ``VLLM_CONTRACT`` names the difference, and the factories carry it as
``contract``. The names of ``Declared`` (_conformance_driver.py) are followed by the
harness itself (the fault matrix leaves out an option vLLM lacks and reports the cells only
it could judge as not applicable; the interposer reads vLLM's frames; the release check
excuses the zmq context vLLM leaves open; the campaign machines judge a shut-down client as a
dead one, send no live id, and owe no second death); the others say where the adapter gives
vLLM's call a bound it lacks, or what passes through. Anything not declared is passed
through as vLLM does it, so the campaign and the fault matrix judge vLLM's behaviour by
enginewire's spec.

Options (the ``ClientFactory`` contract and the matrix's): ``config``, ``engine_fault``,
``engine_startup_delay_s``, ``engine_heartbeat_interval_s``, ``ready_timeout_s`` (vLLM's
``VLLM_ENGINE_READY_TIMEOUT_S``), ``shutdown_timeout_s`` (what vLLM's ``shutdown(timeout)``
gives its engine manager), ``input_address``/``output_address`` (vLLM's
``client_addresses``) with ``engine_connect`` (where the engine connects instead: the
interposer's pair) and ``frame_integrity=False`` are honoured; ``engine_heartbeat_timeout_s``,
``frame_integrity=True``, ``curve`` and anything unknown are refused (``NotApplicable``).

Use (needs vLLM importable; the CLI loads these by name)::

    enginewire campaign --client sync  --factory enginewire.testing.vllm_factory:vllm_sync
    enginewire campaign --client async --factory enginewire.testing.vllm_factory:vllm_async
    enginewire faults matrix --quick --factory enginewire.testing.vllm_factory:vllm_sync
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Any

import msgspec

from ..protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from ..protocol.records import UTILITY_RECORDS
from ..spec.client import ClientState
from ..spec.errors import (
    EngineDeadError,
    EngineStartupError,
    ProtocolError,
    UtilityError,
    UtilityTimeoutError,
)
from ._conformance_driver import ClientUnderTest, Declared, LoopThread, NotApplicable
from .bounds import RULE_DEATH_BOUND_S

__all__ = ["VLLM_CONTRACT", "VllmClientAdapter", "VllmFactory", "vllm_async", "vllm_available",
           "vllm_sync"]

# Where vLLM 0.33's contract differs from enginewire's. Each key names the difference; the
# value says vLLM's side (reference section) and who follows it. The ``Declared`` names are
# read by the harness itself (``Declared``, _conformance_driver.py: the fault matrix, the
# interposer, the release checks, the campaign machines' judgements); the others say what
# this module's adapter does where vLLM has no equivalent (a timeout that only stops
# waiting) or that a difference passes through. Findings that are only these are not bugs
# (docs/vllm.md).
VLLM_CONTRACT: dict[str, str] = {
    Declared.CLOSED_IS_DEAD.value:
        "vLLM has one error for a dead and a shut-down client (EngineDeadError from"
        " ensure_alive, §1.4/§3.6; shutdown sets engine_dead): after shutdown() calls raise"
        " EngineDeadError, an abort is a no-op and a read gets what a dead client's does",
    Declared.NO_DUPLICATE_ID_CHECK.value:
        "the client does not check request ids; vLLM's InputProcessor makes them unique"
        " above it (§6.15): the campaign sends no live id, as that layer never would",
    Declared.DEAD_DELIVERED_ONCE.value:
        "get_output raises EngineDeadError once (the one item its receiver queues), then"
        " blocks; AsyncLLM keeps the death (errored) above the client: the campaign expects"
        " no second EngineDeadError and reads with a bound instead",
    "no_utility_timeout": "call_utility takes no timeout (§1.5, §8): the adapter's timeout"
                          " only stops waiting; the call stays registered in vLLM until its"
                          " late reply, and is not counted as pending by the adapter",
    "no_get_output_timeout": "SyncMPClient.get_output takes no timeout: the adapter reads"
                             " vLLM's outputs_queue with one (same checks as get_output)",
    "abort_outputs": "vLLM's engine sends no output for a client abort (§6.13); this engine"
                     " is enginewire's and sends ABORT, which vLLM's clients pass through",
    "results_untyped": "utility results arrive as plain msgpack values (§2.4): lists for"
                       " tuples and sets, dicts for structs",
    Declared.NO_HEARTBEAT_DEADLINE.value:
        "vLLM's clients have no heartbeat deadline: a silent (SIGSTOPped) engine is never"
        " declared dead; only the process monitor and the dead sentinel are (§3.5, §6.1-2)",
    Declared.NO_FRAME_INTEGRITY.value:
        "vLLM's wire has no integrity trailers (§2.3): a lost, reordered, duplicated or"
        " bit-flipped frame is not detected by the client",
    Declared.NO_ATTACH_HANDSHAKE.value:
        "vLLM's wire has no ATTACH and no attach marker: the ready is the whole handshake"
        " (§3.2 step 6)",
    Declared.STARTUP_DEATH_AT_READY_DEADLINE.value:
        "attached through client_addresses, vLLM's client watches no process while it"
        " waits for the ready (only engine-managed mode's wait_for_engine_startup polls the"
        " sentinels, §3.2): an engine that dies first is seen at VLLM_ENGINE_READY_TIMEOUT_S"
        " (ready_timeout_s here), a TimeoutError the adapter reports as EngineStartupError",
    Declared.ZMQ_CONTEXT_OUTLIVES_SHUTDOWN.value:
        "shutdown() closes the sockets but not the zmq context (§3.6 point 5): its io"
        " threads' eventfd/eventpoll fds stay until the client object is collected (finding"
        " 4, docs/vllm.md)",
    Declared.VLLM_WIRE.value: "frames are vLLM 0.33's (§2.2-§2.5; runtime/vllm_wire.py)",
}

# Options of the ClientFactory contract (and the matrix's) this factory cannot honour, and why.
_REFUSED = {
    "engine_heartbeat_timeout_s": VLLM_CONTRACT[Declared.NO_HEARTBEAT_DEADLINE.value],
    "curve": "vLLM's wire has no CURVE security",
}
_HONOURED = ("config", "engine_fault", "engine_startup_delay_s", "engine_heartbeat_interval_s",
             # vLLM's VLLM_ENGINE_READY_TIMEOUT_S (read at import: set on the module, below)
             "ready_timeout_s",
             # the timeout vLLM's shutdown(timeout) passes its engine manager
             "shutdown_timeout_s",
             # client_addresses: the client binds these (the interposer connects there) and
             # the engine connects to engine_connect (the interposer's pair) instead
             "input_address", "output_address", "engine_connect",
             # only False: vLLM's wire has none (NO_FRAME_INTEGRITY)
             "frame_integrity")
# vLLM waits this long for the ready when not told (its own default, 600 s, outlasts every
# bound the harness has).
DEFAULT_READY_TIMEOUT_S = 60.0
# The ready deadline lives in vLLM's module (bound at import): one construction at a time.
_READY_TIMEOUT_LOCK = threading.Lock()

# How long after vLLM is seen dead or closed a call still blocked in vLLM is abandoned
# (vLLM would block it forever): past every bound a rule judges, so it never hides a finding.
ABANDON_S = RULE_DEATH_BOUND_S + 10.0


class Abandoned(RuntimeError):
    """A call still blocked inside vLLM long after its client died or was shut down; the
    adapter stops waiting (vLLM never would) so threads can end. Not an enginewire error."""


def vllm_available() -> str | None:
    """None if vLLM's client layer imports, else why not."""
    try:
        import vllm.v1.engine.core_client  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"vLLM is not importable: {type(e).__name__}: {e}"
    return None


def _vllm_config(max_model_len: int) -> Any:
    from vllm.config import DeviceConfig, VllmConfig

    # The client reads only model_config.max_model_len / multimodal_config and the parallel
    # and cache configs while attaching; there is no model to build a ModelConfig from.
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    if cfg.model_config is None:
        stub = types.SimpleNamespace(max_model_len=max_model_len, multimodal_config=None)
        object.__setattr__(cfg, "model_config", stub)
    return cfg


class _EngineManager:
    """vLLM's ``CoreEngineProcManager`` duty for one engine the factory launched: what vLLM's
    monitor thread calls (``monitor_engine_liveness``) and what its shutdown calls."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.manager_stopped = threading.Event()
        try:
            self._pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def monitor_engine_liveness(self) -> None:
        # vLLM: wait on the process sentinels with a 1 s timeout until stopped; the first
        # exit ends the wait and shuts the manager down (utils.py:356-372).
        while not self.manager_stopped.is_set():
            if self._pidfd is not None:
                ready, _, _ = select.select([self._pidfd], [], [], 1.0)
                if ready:
                    break
            elif self.proc.poll() is not None:
                break
            else:
                time.sleep(0.05)
        if not self.manager_stopped.is_set():
            self.shutdown()

    def shutdown(self, timeout: float | None = None) -> None:
        # vLLM's module shutdown: SIGTERM, join against a deadline (5 s default), kill. No
        # SIGCONT first: vLLM sends none, so a SIGSTOPped engine holds its SIGTERM and is
        # killed at the deadline. (This manager once resumed it: the engine then answered a
        # call pending at shutdown before it went, which read as vLLM returning a value from
        # a call blocked at shutdown, finding 3 of docs/vllm.md.)
        self.manager_stopped.set()
        p = self.proc
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            try:
                p.wait(5.0 if timeout is None else max(timeout, 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5.0)
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


def _typed(method: str, result: Any) -> Any:
    """A record utility's reply as the record (VLLM_CONTRACT["results_untyped"]: vLLM's wire
    carries it as a map); ``ProtocolError`` if it is not one."""
    cls = UTILITY_RECORDS.get(method)
    if cls is None:
        return result
    try:
        return msgspec.convert(result, cls)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"{method} replied no {cls.__name__}: {e}") from None


def _to_vllm_request(req: EngineCoreRequest) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest as VReq

    sp = req.sampling_params
    v = SamplingParams(max_tokens=max(1, sp.max_tokens), temperature=sp.temperature,
                       top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
                       stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos)
    if sp.max_tokens < 1:
        # vLLM's SamplingParams refuses it; the campaign sends it to see the ENGINE refuse it
        # (a front end that does not validate): set it past the constructor's check.
        v.max_tokens = sp.max_tokens
    return VReq(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                mm_features=None, sampling_params=v, pooling_params=None,
                arrival_time=req.arrival_time or time.time(), lora_request=None,
                cache_salt=None, data_parallel_rank=req.data_parallel_rank,
                priority=req.priority)


def _from_vllm_outputs(v: Any) -> EngineCoreOutputs:
    outs = []
    for o in v.outputs:
        cached = 0 if o.prefill_stats is None else int(o.prefill_stats.num_cached_tokens)
        err = None if o.error is None else str(getattr(o.error, "message", o.error))
        outs.append(EngineCoreOutput(
            o.request_id, list(o.new_token_ids),
            None if o.finish_reason is None else FinishReason(int(o.finish_reason)),
            o.stop_reason, cached, err))
    return EngineCoreOutputs(engine_index=v.engine_index, outputs=outs, timestamp=v.timestamp,
                             finished_requests=None if v.finished_requests is None
                             else sorted(v.finished_requests))


class VllmClientAdapter:
    """vLLM's client behind the surface ``ClientUnderTest`` drives (module docstring)."""

    multiprocess = True

    def __init__(self, kind: str, config: Any, *, fault: Any = None, startup_delay_s: float = 0.0,
                 heartbeat_interval_s: float | None = None, loop: LoopThread | None = None,
                 client_addresses: tuple[str, str] | None = None,
                 engine_connect: tuple[str, str] | None = None,
                 ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
                 shutdown_timeout_s: float | None = None) -> None:
        from ..runtime.vllm_wire import encode_config, encode_plan

        self.kind = kind
        self.config = config
        self._loop = loop
        self._closed = False
        self._asleep = False
        self._dead_seen_at: float | None = None
        self._closed_at: float | None = None
        self._live: set[str] = set()
        self._timed_out: set[int] = set()
        self._shutdown_timeout_s = shutdown_timeout_s
        # The ipc directory is the factory's unless the caller gave the addresses (the
        # interposer's cell binds them in a directory of its own).
        self._dir: str | None = None
        if client_addresses is None:
            self._dir = tempfile.mkdtemp(prefix="ew-vllm-")
            client_addresses = (f"ipc://{self._dir}/in", f"ipc://{self._dir}/out")
            self.resources = types.SimpleNamespace(
                ipc_dir=types.SimpleNamespace(path=self._dir))
        addrs = {"input_address": client_addresses[0], "output_address": client_addresses[1]}
        engine_in, engine_out = engine_connect or client_addresses
        cmd = [sys.executable, "-m", "enginewire.runtime.vllm_wire",
               "--input-address", engine_in, "--output-address", engine_out,
               "--config", encode_config(config), "--parent-pid", str(os.getpid()),
               "--startup-delay-s", str(startup_delay_s)]
        plan = encode_plan(fault)
        if plan is not None:
            cmd += ["--fault", plan]
        if heartbeat_interval_s is not None:
            cmd += ["--heartbeat-interval-s", str(heartbeat_interval_s)]
        self._proc = subprocess.Popen(cmd)
        self.engine_pid: int | None = self._proc.pid
        self._manager = _EngineManager(self._proc)
        try:
            self._vc = self._build(addrs, ready_timeout_s)
        except BaseException as e:
            self._manager.shutdown(0.5)
            self._remove_dir()
            if isinstance(e, Exception):
                # vLLM's ready deadline (TimeoutError) or a failed attach: enginewire's
                # start-up error (Declared.STARTUP_DEATH_AT_READY_DEADLINE).
                raise EngineStartupError(f"vLLM's {kind} client did not attach:"
                                         f" {type(e).__name__}: {e}") from e
            raise

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _build(self, addrs: dict[str, str], ready_timeout_s: float) -> Any:
        from vllm.v1.engine import core_client

        # A bounded attach: MPClient reads the deadline from its module's global, bound from
        # VLLM_ENGINE_READY_TIMEOUT_S when vLLM was imported (default 600 s).
        with _READY_TIMEOUT_LOCK:
            saved = core_client.VLLM_ENGINE_READY_TIMEOUT_S
            core_client.VLLM_ENGINE_READY_TIMEOUT_S = max(1, round(ready_timeout_s))
            try:
                return self._construct(addrs)
            finally:
                core_client.VLLM_ENGINE_READY_TIMEOUT_S = saved

    def _construct(self, addrs: dict[str, str]) -> Any:
        from vllm.v1.engine.core_client import AsyncMPClient, MPClient, SyncMPClient
        from vllm.v1.executor import Executor

        cfg = _vllm_config(int(self.config.max_model_len))
        if self.kind == "async":
            assert self._loop is not None

            async def build() -> Any:  # in the loop: vLLM starts its receiver task eagerly
                return AsyncMPClient(cfg, Executor, False, client_addresses=addrs)

            vc = self._loop.run(build(), timeout=None)
        else:
            # SyncMPClient.__init__ takes no client_addresses (vLLM only builds it with
            # engines it launches): a class between it and MPClient forwards them.
            class _Attach(MPClient):  # type: ignore[misc]  # vLLM is untyped here (absent)
                def __init__(self, asyncio_mode: bool, vllm_config: Any, executor_class: Any,
                             log_stats: bool, client_addresses: Any = None,
                             renderer: Any = None) -> None:
                    super().__init__(asyncio_mode, vllm_config, executor_class, log_stats,
                                     client_addresses=addrs, renderer=renderer)

            cls = type("AttachedSyncMPClient", (SyncMPClient, _Attach), {})
            vc = cls(cfg, Executor, False)
        # Engine-managed mode's death detection: vLLM's own monitor thread, on our process.
        vc.resources.engine_manager = self._manager
        vc.start_engine_core_monitor()
        return vc

    # -- what the campaign reads ----------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return not self._closed and bool(self._vc.resources.engine_dead)

    @property
    def state(self) -> ClientState:
        if self._closed:
            return ClientState.SHUTDOWN
        if self._vc.resources.engine_dead:
            return ClientState.DEAD
        if self._asleep:
            return ClientState.SLEEPING
        return ClientState.RUNNING if self._live else ClientState.READY

    def pending_utility_calls(self) -> int:
        return len([c for c in list(self._vc.utility_results) if c not in self._timed_out])

    # -- translation of errors --------------------------------------------------------------

    def _error(self, e: BaseException, method: str | None = None) -> BaseException:
        from vllm.v1.engine.exceptions import EngineDeadError as VDead

        if isinstance(e, VDead):
            # Also after shutdown: Declared.CLOSED_IS_DEAD, which the campaign follows.
            out: BaseException = EngineDeadError()
        elif method is not None and type(e) is Exception:  # a utility's failure_message
            out = UtilityError(method, str(e))
        elif isinstance(e, msgspec.DecodeError | msgspec.ValidationError):
            # vLLM's receiver could not decode what the engine sent, and died (the error is
            # its last item, §1.5/§1.6): enginewire's name for it; the type only, vLLM does
            # not mark the engine dead (docs/vllm.md, finding 5).
            out = ProtocolError(f"vLLM's receiver could not decode an output: {e}")
        else:
            return e
        out.__cause__ = e
        return out

    def _should_abandon(self) -> bool:
        now = time.monotonic()
        if self._closed_at is None and not self._vc.resources.engine_dead:
            return False
        if self._dead_seen_at is None:
            self._dead_seen_at = now
        since = self._closed_at if self._closed_at is not None else self._dead_seen_at
        return now - since > ABANDON_S

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        v = _to_vllm_request(req)  # a live id passes: Declared.NO_DUPLICATE_ID_CHECK
        try:
            self._vc.add_request(v)
        except Exception as e:
            raise self._error(e) from None
        self._live.add(req.request_id)

    async def add_request_async(self, req: EngineCoreRequest) -> None:
        v = _to_vllm_request(req)  # a live id passes: Declared.NO_DUPLICATE_ID_CHECK
        try:
            await self._vc.add_request_async(v)
        except Exception as e:
            raise self._error(e) from None
        self._live.add(req.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        try:
            self._vc.abort_requests(list(ids))
        except Exception as e:
            raise self._error(e) from None

    async def abort_requests_async(self, ids: list[str]) -> None:
        try:
            await self._vc.abort_requests_async(list(ids))
        except Exception as e:
            raise self._error(e) from None

    def _took(self, item: Any) -> EngineCoreOutputs:
        if isinstance(item, Exception):
            raise self._error(self._vc._format_exception(item))
        if item.wave_complete is not None:  # SyncMPClient.get_output's own bookkeeping
            self._vc.engines_running = False
        out = _from_vllm_outputs(item)
        for o in out.outputs:
            if o.finish_reason is not None:
                self._live.discard(o.request_id)
        return out

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        # After a delivered death or shutdown vLLM's read blocks (Declared.DEAD_DELIVERED_ONCE,
        # CLOSED_IS_DEAD): a bounded one returns nothing, an unbounded one is abandoned.
        # VLLM_CONTRACT["no_get_output_timeout"]: SyncMPClient.get_output is
        # ``outputs_queue.get()`` and its checks; the same, with a bound.
        q = self._vc.outputs_queue
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            try:
                item = q.get(timeout=wait) if wait > 0 else q.get_nowait()
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return EngineCoreOutputs()
                if self._should_abandon():
                    raise Abandoned("vLLM's get_output is still blocked long after its"
                                    " client died or was shut down") from None
                continue
            return self._took(item)

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            try:
                item = await asyncio.wait_for(self._vc.get_output_async(), wait)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    return EngineCoreOutputs()
                if self._should_abandon():
                    raise Abandoned("vLLM's get_output_async is still blocked long after its"
                                    " client died or was shut down") from None
                continue
            except Exception as e:
                raise self._error(e) from None
            return self._took(item)

    # -- utilities --------------------------------------------------------------------------

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        before = set(self._vc.utility_results)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:  # vLLM's call blocks without a bound: on a daemon thread
            try:
                done.set_result(self._vc.call_utility(method, *args))
            except BaseException as e:
                done.set_exception(e)

        threading.Thread(target=run, name="vllm-call-utility", daemon=True).start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Never past the deadline: a 10 ms timeout must not wait a whole 0.1 s poll (a
            # reply 80 ms late once came back as a value instead of UtilityTimeoutError).
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            try:
                result = done.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    # VLLM_CONTRACT["no_utility_timeout"]
                    self._timed_out |= set(self._vc.utility_results) - before
                    raise UtilityTimeoutError(method, timeout) from None  # type: ignore[arg-type]
                if self._should_abandon():
                    raise Abandoned(f"vLLM's call_utility({method!r}) is still blocked long"
                                    " after its client died or was shut down") from None
                continue
            except Exception as e:
                raise self._error(e, method) from None
            return _typed(method, result)

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout: float | None = None) -> Any:
        before = set(self._vc.utility_results)
        task = asyncio.ensure_future(self._vc.call_utility_async(method, *args))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                wait = 0.1 if deadline is None else max(0.0, min(0.1,
                                                                 deadline - time.monotonic()))
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    self._timed_out |= set(self._vc.utility_results) - before
                    task.cancel()
                    raise UtilityTimeoutError(method, timeout)  # type: ignore[arg-type]
                if self._should_abandon():
                    task.cancel()
                    raise Abandoned(f"vLLM's call_utility_async({method!r}) is still blocked"
                                    " long after its client died or was shut down")
        except asyncio.CancelledError:
            task.cancel()  # the caller gave up: so does vLLM's await (its entry stays)
            raise
        try:
            return _typed(method, task.result())
        except Exception as e:
            raise self._error(e, method) from None

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        return [self.call_utility(method, *args)]

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        try:
            return [_typed(method, r)
                    for r in await self._vc.call_utility_all_async(method, *args)]
        except Exception as e:
            raise self._error(e, method) from None

    # Typed utilities: vLLM's own methods where the client has them.
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode={mode!r}")
        self.call_utility("sleep", level, mode)
        self._asleep = True

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode={mode!r}")
        await self._typed_async("sleep", self._vc.sleep_async, level, mode)
        self._asleep = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        full = bool(self.call_utility("wake_up", tags))
        self._asleep = not full
        return full

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        full = bool(await self._typed_async("wake_up", self._vc.wake_up_async, tags))
        self._asleep = not full
        return full

    def is_sleeping(self) -> bool:
        return bool(self.call_utility("is_sleeping"))

    async def is_sleeping_async(self) -> bool:
        return bool(await self._typed_async("is_sleeping", self._vc.is_sleeping_async))

    def pause_scheduler(self, mode: str = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode={mode!r}")
        self.call_utility("pause_scheduler", mode)  # SyncMPClient has no pause method
        self._asleep = True

    async def pause_scheduler_async(self, mode: str = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode={mode!r}")
        await self._typed_async("pause_scheduler", self._vc.pause_scheduler_async, mode)
        self._asleep = True

    def resume_scheduler(self) -> None:
        self.call_utility("resume_scheduler")
        self._asleep = False

    async def resume_scheduler_async(self) -> None:
        await self._typed_async("resume_scheduler", self._vc.resume_scheduler_async)
        self._asleep = False

    async def _typed_async(self, method: str, fn: Any, *args: Any) -> Any:
        try:
            return await fn(*args)
        except Exception as e:
            raise self._error(e, method) from None

    # -- what a misbehaving front end sends (the malformed_frame rule) -------------------

    def send_raw_frames(self, frames: list[bytes]) -> None:
        vc = self._vc
        msg = [vc.core_engine, *frames]
        if self.kind == "async":
            assert self._loop is not None

            async def send() -> None:
                await vc.input_socket.send_multipart(msg)

            self._loop.run(send())
        else:
            vc.input_socket.send_multipart(msg)

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_at = time.monotonic()
        try:
            self._vc.shutdown(timeout=self._shutdown_timeout_s if timeout is None else timeout)
        finally:
            self._manager.shutdown(0.5)
            self._remove_dir()


def _make(kind: str, options: dict[str, Any]) -> ClientUnderTest:
    why = vllm_available()
    if why is not None:
        raise NotApplicable(why)
    for name in sorted(options):
        if name in _REFUSED:
            raise NotApplicable(f"vLLM's {kind} client cannot honour {name}=: {_REFUSED[name]}")
        if name not in _HONOURED:
            raise NotApplicable(f"vLLM's {kind} client does not know option {name}=")
    if options.get("frame_integrity"):
        raise NotApplicable(f"vLLM's {kind} client cannot honour frame_integrity=True: "
                            + VLLM_CONTRACT[Declared.NO_FRAME_INTEGRITY.value])
    if ("input_address" in options) != ("output_address" in options):
        raise NotApplicable("input_address= and output_address= come together here (vLLM's"
                            " client_addresses)")
    from ..runtime.config import EngineConfig
    from ..runtime.faults import FaultPlan, as_plan

    config = options.get("config") or EngineConfig(model="null", max_num_seqs=16)
    plan = as_plan(options.get("engine_fault")) or FaultPlan(allow_arm=True)
    addresses = None
    if "input_address" in options:
        addresses = (str(options["input_address"]), str(options["output_address"]))
    connect = options.get("engine_connect")
    loop = LoopThread() if kind == "async" else None
    try:
        client = VllmClientAdapter(
            kind, config, fault=plan,
            startup_delay_s=float(options.get("engine_startup_delay_s", 0.0)),
            heartbeat_interval_s=options.get("engine_heartbeat_interval_s"), loop=loop,
            client_addresses=addresses,
            engine_connect=None if connect is None else (str(connect[0]), str(connect[1])),
            ready_timeout_s=float(options.get("ready_timeout_s", DEFAULT_READY_TIMEOUT_S)),
            shutdown_timeout_s=options.get("shutdown_timeout_s"))
    except BaseException:
        if loop is not None:
            loop.close()
        raise
    return ClientUnderTest(client, kind, None, loop)


class VllmFactory:
    """vLLM 0.33's client of one kind on enginewire's engine: a ``ClientFactory``
    (``factory(**options)``, the conformance contract) that declares where vLLM's contract
    differs (``contract``, read by ``declared_contract`` (_conformance_driver.py))."""

    contract: types.MappingProxyType[str, str] = types.MappingProxyType(VLLM_CONTRACT)

    def __init__(self, kind: str) -> None:
        if kind not in ("sync", "async"):
            raise ValueError(f"kind={kind!r}: vLLM's clients here are sync and async")
        self.kind = kind
        # What load_factory and the matrix's report name it by.
        self.__name__ = self.__qualname__ = f"vllm_{kind}"

    def __call__(self, **options: Any) -> ClientUnderTest:
        return _make(self.kind, options)

    def __repr__(self) -> str:
        return f"{type(self).__module__}:{self.__qualname__}"


vllm_sync = VllmFactory("sync")
"""vLLM 0.33's ``SyncMPClient`` on enginewire's engine (the ``ClientFactory`` contract)."""
vllm_async = VllmFactory("async")
"""vLLM 0.33's ``AsyncMPClient`` on enginewire's engine (the ``ClientFactory`` contract)."""
