"""Engine cores as Ray actors: the placement behind ``data_parallel_backend="ray"`` (issue 29).

Theory of operation. ``RayEngines(n)`` reserves one placement group of ``n`` bundles and
places one actor in each. The actor is a small nanny, not the engine: on a client's launch it
starts the engine program on its own node exactly as ``mp_client._spawn_engine`` does on this
host (runtime/engine_launch.py), with ``parent_pid`` set to the actor's pid, so an engine
never outlives its actor (the engine's parent watch). The engine then connects to the front
end over the addresses in its kwargs like any launched engine; Ray carries only the launch,
the exit code and signals.

Rule 1: an actor's death is an engine death. On this side a handle (``RayEngineProcess``)
answers ``mp_client.EngineProcess``; its watcher thread waits on the actor's ``wait`` method,
which returns the engine's exit code, and raises once the actor (or its node) is gone. Either
way the handle's ``exitcode`` is set and its sentinel becomes readable, so the client's own
monitor reports the death; nothing in the client knows about Ray.

Rule 2: one engine per actor, and a relaunch ends the previous one. The data-parallel client
relaunches an index only after its incarnation was declared dead (exit, sentinel, heartbeat
deadline, a bad frame), and such an engine may still run: stopped, hung, or talking. So a
launch SIGKILLs the actor's previous engine and waits, bounded, until the nanny has reaped it
before it starts the next (``EngineStartupError`` if it will not die): two generations never
run at once, and the replacement has a channel of its own (fresh addresses and CURVE keys,
made by its new client) that nothing of the old one reaches.

Rule 3: no plaintext crosses hosts. An engine placed on another host is refused an ipc
address, a loopback address or plain tcp (``EngineStartupError`` before it is spawned), so
its traffic crosses hosts only under CURVE. The engine's key pair (fresh per launch, made by
the client) travels in the launch, over Ray's own channel: where that channel is not trusted,
turn on Ray's TLS (``RAY_USE_TLS``).

A Ray this module starts itself (no cluster to join) is this host's only: its node, GCS,
raylet, object manager and workers bind and advertise 127.0.0.1 (``_start_ray``), with no
dashboard. A cluster the caller joins keeps the addresses the caller chose.

Ray is an optional extra (``pip install 'enginewire[ray]'``); it is imported when
``RayEngines`` is built, never by importing this module.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from ..spec.errors import EngineStartupError
from .engine_launch import write_report

if TYPE_CHECKING:
    from .mp_client import EngineLauncher

logger = logging.getLogger(__name__)

Strategy = Literal["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"]
STRATEGIES: tuple[str, ...] = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")

INSTALL_HINT = "pip install 'enginewire[ray]'"
# Where a Ray started here (no cluster to join) puts its node: reachable from this host only.
LOCAL_RAY_IP = "127.0.0.1"

# What the handle reports as the exit code when the actor died before telling one: the
# actor's process is gone (ray.kill SIGKILLs it; a lost node is as good as killed), and the
# engine follows it through its parent watch.
ACTOR_DIED_EXITCODE = -int(signal.SIGKILL)

# A bundle and its actor ask for a sliver of a CPU, not a whole one: the engine's own
# threads are not Ray's to count, and a two-core CI machine must fit two engines per node.
DEFAULT_RESOURCES: Mapping[str, float] = {"CPU": 0.01}
DEFAULT_READY_TIMEOUT_S = 60.0
# The nanny answers wait and terminate/kill at once: one blocked thread per engine it ran
# (one at a time, normally) and room for the signals and where().
_ACTOR_CONCURRENCY = 4
# How often the watcher looks up from its wait to see whether it is to stop (close()); death
# itself wakes it at once (the wait's result arrives).
_WATCH_POLL_S = 0.25
# Bounds: the actor's answer to a launch or a signal, a watcher's join, a kill's escalation.
_CALL_S = 10.0
_JOIN_S = 5.0
_KILL_ESCALATE_S = 2.0
# How long a launch waits for the actor's previous engine to be reaped after its SIGKILL
# (Rule 2): SIGKILL ends even a stopped process at once; only one stuck in the kernel (a
# hung mount, a GPU driver) outlasts this, and then no second engine joins it.
_PREVIOUS_GONE_S = 5.0
# A locally started Ray holds only launches and exit codes in its object store: the least
# Ray accepts is 75 MiB; a default (30% of memory) would just be taken from the engines.
_LOCAL_OBJECT_STORE_BYTES = 128 * 1024 * 1024


def import_ray() -> Any:
    """The ``ray`` module, or ``EngineStartupError`` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise EngineStartupError(
            "data_parallel_backend='ray' needs Ray, which is not installed; install the"
            f" optional extra: {INSTALL_HINT}") from e
    return ray


# --- the actor: a nanny on the engine's node -------------------------------------------------


class EngineNanny:
    """Runs on the engine's node as a threaded Ray actor (``max_concurrency`` >= 2, so a
    blocked ``wait`` never holds up ``terminate``). Each ``start`` is one engine, named by a
    generation number; at most one runs at a time: a ``start`` ends the previous one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # one launch at a time, its kill included
        self._next = 0
        self._procs: dict[int, Any] = {}  # generation -> EngineSubprocess
        self._reports: dict[int, Any] = {}  # generation -> its StartupReport
        self._results: dict[int, tuple[int, str | None]] = {}

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP address, this actor's pid)."""
        ray = import_ray()
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                os.getpid())

    def start(self, config_type: type, config_bytes: bytes, kwargs: dict[str, Any],
              name: str) -> tuple[int, int]:
        """Spawn the engine here; (generation, engine pid). A previous engine still running
        is killed and reaped first (Rule 2)."""
        from .engine_launch import StartupReport, launch_engine_process

        with self._start_lock:
            self._end_previous()
            with self._lock:
                report_r, report_w = os.pipe()
                kwargs = {**kwargs, "parent_pid": os.getpid(), "startup_report": report_w}
                try:
                    proc = launch_engine_process(config_type, config_bytes, kwargs, name)
                except BaseException:
                    os.close(report_r)
                    raise
                finally:
                    os.close(report_w)  # the engine has its own copy: EOF once it exits
                gen = self._next
                self._next += 1
                self._procs[gen] = proc
                self._reports[gen] = StartupReport(report_r)
                assert proc.pid is not None
                return gen, proc.pid

    def _end_previous(self) -> None:
        """SIGKILL every engine of this actor still alive and wait until each is reaped.
        Only a relaunch finds one: its client declared it dead, so nothing it still says
        may be heard, and a stopped or hung one would never leave on its own."""
        with self._lock:  # wait() closes a reaped one under it: kill only what is open
            previous = [(gen, proc) for gen, proc in self._procs.items() if proc.is_alive()]
            for gen, proc in previous:
                logger.warning("engine %s (pid %s, launch %d) of this actor is still alive at"
                               " a relaunch: killing it", proc.name, proc.pid, gen)
                proc.kill()  # SIGKILL: a stopped process dies too, no SIGCONT needed
        deadline = time.monotonic() + _PREVIOUS_GONE_S
        for gen, proc in previous:
            try:
                proc.join(max(0.0, deadline - time.monotonic()))
                alive = proc.is_alive()
            except ValueError:  # closed by wait(): reaped already
                alive = False
            if alive:
                raise EngineStartupError(
                    f"this Ray actor's previous engine (pid {proc.pid}, launch {gen}) is"
                    f" still alive {_PREVIOUS_GONE_S:g} s after its SIGKILL (stuck in the"
                    " kernel?); no replacement is started beside it")

    def wait(self, gen: int) -> tuple[int, str | None]:
        """Block until engine ``gen`` exits: (exit code, the start-up failure it reported)."""
        with self._lock:
            if gen in self._results:
                return self._results[gen]
            proc = self._procs[gen]
        proc.join()
        with self._lock:
            if gen not in self._results:
                report = self._reports.pop(gen)
                reason: str | None = None
                with contextlib.suppress(EOFError, OSError):
                    if proc.exitcode != 0 and report.poll(0):  # written before it exited
                        reason = str(report.recv())
                report.close()
                code = proc.exitcode
                assert code is not None
                self._results[gen] = (code, reason)
                del self._procs[gen]
                proc.close()
            return self._results[gen]

    def signal(self, gen: int, signum: int) -> None:
        """Send ``signum`` to engine ``gen`` if it still runs (SIGCONT first for SIGTERM: a
        stopped engine would hold it pending and cost the whole grace)."""
        with self._lock:
            proc = self._procs.get(gen)
            pid = proc.pid if proc is not None and proc.is_alive() else None
        if pid is None:
            return
        with contextlib.suppress(OSError):
            if signum == signal.SIGTERM:
                os.kill(pid, signal.SIGCONT)
            os.kill(pid, signum)


# --- the handle on this side -----------------------------------------------------------------


class RayEngineProcess:
    """``mp_client.EngineProcess`` for an engine a Ray actor runs. ``local`` is False: its
    pid is on the actor's node, so the client signals nothing here.

    A watcher thread waits on the actor's ``wait``; when it returns (the exit code) or
    raises (the actor or its node died: ``ACTOR_DIED_EXITCODE``), ``exitcode`` is set and
    ``sentinel`` becomes readable. A start-up failure the engine reported is written to the
    client's start-up pipe first, so the client's ``EngineStartupError`` names it."""

    local = False

    def __init__(self, ray: Any, actor: Any, gen: int, pid: int, node_id: str,
                 report: int | None, name: str) -> None:
        self._ray = ray
        self._actor = actor
        self._gen = gen
        self._pid = pid
        self.node_id = node_id
        self.name = name
        self._report = report
        self._exitcode: int | None = None
        self.exit_reason: str | None = None  # why, in words, once it exited
        self._done = threading.Event()
        self._stop = threading.Event()
        self._fd_lock = threading.Lock()
        self._sentinel_r, self._sentinel_w = os.pipe()
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name=f"RayEngineWatch_{name}",
                                         daemon=True)
        self._watcher.start()

    def __repr__(self) -> str:
        state = "alive" if self._exitcode is None else f"exitcode={self._exitcode}"
        return f"<RayEngineProcess {self.name} pid={self._pid} node={self.node_id[:12]} {state}>"

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    @property
    def sentinel(self) -> int:
        self._check_open()
        return self._sentinel_r

    def is_alive(self) -> bool:
        self._check_open()
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._check_open()
        self._done.wait(timeout)

    def terminate(self) -> None:
        self._check_open()
        self._send(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL through the actor; an actor that does not answer is killed itself (the
        engine follows its parent)."""
        self._check_open()
        ref = self._send(signal.SIGKILL)
        if ref is None:
            return
        ready, _ = self._ray.wait([ref], timeout=_KILL_ESCALATE_S)
        if not ready and not self._done.is_set():
            logger.warning("Ray actor of %s does not answer; killing the actor", self.name)
            with contextlib.suppress(Exception):
                self._ray.kill(self._actor, no_restart=True)

    def close(self) -> None:
        """Stop the watcher and release the pipe. Idempotent. Like a closed
        ``multiprocessing.Process``, a closed handle raises ``ValueError`` when used."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join(_JOIN_S)
        with self._fd_lock:
            for fd in (self._sentinel_r, self._sentinel_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._sentinel_r = self._sentinel_w = -1
            self._close_report()

    # -- internals --

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("process object is closed")

    def _send(self, signum: int) -> Any:
        if self._done.is_set():
            return None  # gone already (and Ray may be shut down: no call can be made)
        try:
            return self._actor.signal.remote(self._gen, int(signum))
        except Exception as e:  # the actor is gone: the watcher says so
            logger.debug("signal to the Ray actor of %s failed: %r", self.name, e)
            return None

    def _watch(self) -> None:
        ray = self._ray
        code: int | None = None
        reason: str | None = None
        try:
            ref = self._actor.wait.remote(self._gen)
            while code is None:
                if self._stop.is_set():
                    return
                ready, _ = ray.wait([ref], timeout=_WATCH_POLL_S)
                if not ready:
                    continue
                try:
                    code, reason = ray.get(ref)
                except Exception as e:  # RayActorError, ActorDiedError, a lost node, ...
                    code = ACTOR_DIED_EXITCODE
                    self.exit_reason = f"the Ray actor running it died: {e}"
                    logger.warning("engine %s: %s", self.name, self.exit_reason)
        except Exception as e:  # Ray itself failed under the watch: death can't be seen
            code = ACTOR_DIED_EXITCODE
            self.exit_reason = f"the watch of its Ray actor failed: {e!r}"
            logger.warning("engine %s: %s", self.name, self.exit_reason)
        self._finish(code, reason)

    def _finish(self, code: int, reason: str | None) -> None:
        """Record the exit: the reason to the start-up pipe first, then the sentinel."""
        with self._fd_lock:
            if self._done.is_set():
                return
            if reason is not None:
                if self.exit_reason is None:
                    self.exit_reason = reason
                report, self._report = self._report, None
                if report is not None:
                    with contextlib.suppress(OSError):  # the client stopped reading
                        write_report(report, reason)  # closes it
            self._close_report()
            self._exitcode = code
            self._done.set()
            if self._sentinel_w >= 0:
                os.close(self._sentinel_w)  # EOF: the read end stays readable for good
                self._sentinel_w = -1

    def _close_report(self) -> None:
        report, self._report = self._report, None
        if report is not None:
            os.close(report)

    def _orphan(self, why: str) -> None:
        """Ray is going away under a live watch: stop it and record the engine as gone (its
        actor is killed), so no later call reaches a Ray that is shut down."""
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join(_JOIN_S)
        if not self._done.is_set():
            self.exit_reason = why
            self._finish(ACTOR_DIED_EXITCODE, None)


# --- the placement ---------------------------------------------------------------------------


class RayEngines:
    """``n`` engine nannies as Ray actors, each in a placement group of its own, placed
    together with ``strategy``.

    If Ray is not initialized, connects to ``address`` (or ``RAY_ADDRESS``) when given, else
    starts a local instance on loopback only (no dashboard); ``close()`` shuts down only a Ray
    this object initialized. ``resources_per_engine`` is one bundle (default a hundredth of
    a CPU; ask ``{"GPU": 1}`` for a GPU engine). ``strategy`` is the placement group's."""

    def __init__(
        self,
        n: int,
        *,
        strategy: Strategy = "SPREAD",
        address: str | None = None,
        resources_per_engine: Mapping[str, float] | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: must be a positive integer")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: must be one of {', '.join(STRATEGIES)}")
        if not ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s={ready_timeout_s!r}: must be positive")
        resources = dict(DEFAULT_RESOURCES if resources_per_engine is None
                         else resources_per_engine)
        if not resources or any(not (isinstance(v, int | float) and v > 0)
                                for v in resources.values()):
            raise ValueError(f"resources_per_engine={resources_per_engine!r}: must name at least"
                             " one resource, each a positive amount")
        ray = import_ray()
        self._ray = ray
        self.n = n
        self.strategy = strategy
        self._ready_timeout = float(ready_timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._owns_ray = False
        self._sigterm: tuple[Any, Any] = (None, None)
        # Each engine's own placement group (one bundle), removed when it leaves.
        self._pgs: dict[int, Any] = {}
        # Indexes a scale-down removed: no actor until a scale-up adds them again.
        self._free: set[int] = set()
        self._actors: list[Any] = []
        self._where: list[tuple[str, str, int]] = []
        self._handles: list[RayEngineProcess] = []
        try:
            self._init_ray(address)
            self._place(resources)
        except BaseException:
            self.close()
            raise

    def _init_ray(self, address: str | None) -> None:
        started = _start_ray(self._ray, address)
        if started is not None:
            self._owns_ray, self._sigterm = True, started

    def _place(self, resources: dict[str, float]) -> None:
        """Place the first ``n`` engines, each in a placement group of its own.

        Ray can neither grow nor shrink a placement group, and a scale-down must hand an
        engine's resources back, so no group outlives its engine. The strategy is still
        Ray's, applied to the ``n`` engines together: a group of ``n`` bundles with it plans
        the nodes, then is removed, and each engine's own group is pinned to its planned
        node (``ray.io/node-id`` label). A task elsewhere in the cluster may take a freed
        resource in that instant: the engine's group then cannot be placed, which is an
        ``EngineStartupError`` as any unplaceable group."""
        ray = self._ray
        from ray.util import placement_group_table
        from ray.util.placement_group import placement_group, remove_placement_group

        plan = placement_group([dict(resources) for _ in range(self.n)], strategy=self.strategy)
        try:
            ready, _ = ray.wait([plan.ready()], timeout=self._ready_timeout)
            if not ready:
                raise EngineStartupError(
                    f"Ray could not place {self.n} engine bundle(s) of {resources} with"
                    f" strategy {self.strategy} within {self._ready_timeout:g} s"
                    f" (ready_timeout_s); the cluster has {ray.available_resources()}"
                    " available")
            nodes = placement_group_table(plan)["bundles_to_node_id"]
        finally:
            with contextlib.suppress(Exception):
                remove_placement_group(plan)
        rest = dict(resources)
        options = {
            "num_cpus": rest.pop("CPU", 0),
            "num_gpus": rest.pop("GPU", 0),
            "resources": rest,
            "max_concurrency": _ACTOR_CONCURRENCY,
            "max_restarts": 0,  # a restarted nanny would have lost its engine
        }
        self._actor_cls, self._actor_options = ray.remote(EngineNanny), options
        self._resources = dict(resources)
        for i in range(self.n):
            self._pgs[i] = placement_group(
                [dict(resources)], strategy="PACK",
                bundle_label_selector=[{"ray.io/node-id": nodes[i]}])
        ready, _ = ray.wait([pg.ready() for pg in self._pgs.values()],
                            num_returns=self.n, timeout=self._ready_timeout)
        if len(ready) < self.n:
            raise EngineStartupError(
                f"Ray planned {self.n} engine bundle(s) of {resources} with strategy"
                f" {self.strategy} but could not place them all within"
                f" {self._ready_timeout:g} s (ready_timeout_s); the cluster has"
                f" {ray.available_resources()} available")
        self._actors = [self._actor_for(i) for i in range(self.n)]
        try:
            self._where = ray.get([a.where.remote() for a in self._actors],
                                  timeout=self._ready_timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise EngineStartupError(
                f"the Ray engine actors did not start within {self._ready_timeout:g} s"
                " (ready_timeout_s)") from e

    # -- public --

    def launcher(self, index: int) -> EngineLauncher:
        """The ``engine_launcher`` for a client whose engine runs in actor ``index``."""
        self._check_index(index)

        def launch(config_type: type, config_bytes: bytes, kwargs: dict[str, Any],
                   name: str) -> RayEngineProcess:
            return self._launch(index, config_type, config_bytes, kwargs, name)

        return launch

    def add(self, index: int) -> None:
        """Place an actor for engine ``index`` (a scale-up) in a new placement group of its
        own, wherever its bundle fits (``strategy`` placed the first ``n`` together; a
        joiner is placed alone)."""
        ray = self._ray
        with self._lock:
            if self._closed:
                raise EngineStartupError("RayEngines is closed")
            if index < len(self._actors) and index not in self._free:
                return  # placed already
            while len(self._actors) <= index:  # joiners are placed at once, in any order
                self._free.add(len(self._actors))
                self._actors.append(None)
                self._where.append(("", "", 0))
        actor = self._actor_for(index)
        try:
            where = ray.get(actor.where.remote(), timeout=self._ready_timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise
        with self._lock:
            self._actors[index], self._where[index] = actor, where
            self._free.discard(index)

    def _actor_for(self, index: int) -> Any:
        """A new actor in engine ``index``'s own placement group, made here on first need
        (a joiner's, or an index's that left and rejoins: anywhere the bundle fits)."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        pg = self._pgs.get(index)
        if pg is None:
            pg = placement_group([dict(self._resources)], strategy="PACK")
            ready, _ = ray.wait([pg.ready()], timeout=self._ready_timeout)
            if not ready:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
                raise EngineStartupError(
                    f"Ray could not place engine {index}'s bundle of {self._resources}"
                    f" within {self._ready_timeout:g} s (ready_timeout_s); the cluster"
                    f" has {ray.available_resources()} available")
            with self._lock:
                self._pgs[index] = pg
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                    placement_group_bundle_index=0)
        return self._actor_cls.options(scheduling_strategy=strategy,
                                       **self._actor_options).remote()

    def remove(self, index: int) -> None:
        """Engine ``index`` left (a scale-down): its actor is killed (its engine follows) and
        its placement group removed, so its resources go back to the cluster. Idempotent."""
        ray = self._ray
        with self._lock:
            if self._closed or index >= len(self._actors) or index in self._free:
                return
            self._free.add(index)
            actor = self._actors[index]
            pg = self._pgs.pop(index, None)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    def node_of(self, index: int) -> str:
        """The Ray node id actor ``index`` runs on."""
        self._check_index(index)
        return self._where[index][0]

    def actor(self, index: int) -> Any:
        """Actor ``index``'s Ray handle (a test kills it to kill an engine)."""
        self._check_index(index)
        return self._actors[index]

    def close(self) -> None:
        """Kill the actors (their engines follow), remove the placement group, shut down a
        Ray this object initialized. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        ray = self._ray
        actors, self._actors = self._actors, []
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        handles, self._handles = self._handles, []
        deadline = time.monotonic() + _JOIN_S
        for handle in handles:  # their watchers see the actors die
            handle._done.wait(max(0.0, deadline - time.monotonic()))
        for handle in handles:
            handle._orphan("its Ray actor was killed (RayEngines.close)")
        from ray.util.placement_group import remove_placement_group

        pgs, self._pgs = list(self._pgs.values()), {}
        for pg in pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        if self._owns_ray:
            self._owns_ray = False
            _stop_ray(ray, self._sigterm)

    def __enter__(self) -> RayEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _replace(self, index: int) -> None:
        """A new actor in bundle ``index`` for one that died; where it runs is asked anew."""
        ray = self._ray
        with self._lock:
            if self._closed:
                raise EngineStartupError("RayEngines is closed")
            old = self._actors[index]
        actor = self._actor_for(index)
        with self._lock:
            self._actors[index] = actor
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        self._where[index] = ray.get(actor.where.remote(), timeout=self._ready_timeout)

    def _check_index(self, index: int) -> None:
        if self._closed:
            raise EngineStartupError("RayEngines is closed")
        n = len(self._actors) or self.n
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise ValueError(f"index={index!r}: must be an integer in [0, {n})")
        if index in self._free:
            raise ValueError(f"index={index}: its engine left (a scale-down); add() it first")

    def _launch(self, index: int, config_type: type, config_bytes: bytes,
                kwargs: dict[str, Any], name: str) -> RayEngineProcess:
        self._check_index(index)
        ray = self._ray
        node_id, node_ip, _ = self._where[index]
        kwargs = dict(kwargs)
        # A pipe cannot cross Ray; the handle writes the engine's start-up failure to its
        # own copy of the client's end instead.
        theirs = kwargs.pop("startup_report", None)
        kwargs.pop("parent_pid", None)  # the actor's own, set there
        _check_reach(kwargs, node_ip, ray.util.get_node_ip_address(), name)
        report = None
        if theirs is not None:
            report = os.dup(theirs)
        try:
            try:
                try:
                    gen, pid = ray.get(self._actors[index].start.remote(
                        config_type, config_bytes, kwargs, name), timeout=_CALL_S)
                except ray.exceptions.RayActorError:
                    # Its actor died (killed, or its engine's death took it): a replacing
                    # engine (restart_dead_engines) gets a new actor in the same bundle.
                    self._replace(index)
                    node_id, node_ip, _ = self._where[index]
                    _check_reach(kwargs, node_ip, ray.util.get_node_ip_address(), name)
                    gen, pid = ray.get(self._actors[index].start.remote(
                        config_type, config_bytes, kwargs, name), timeout=_CALL_S)
            except ray.exceptions.RayError as e:
                # A failure raised in the actor, said as itself, not as Ray's traceback.
                why = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
                raise EngineStartupError(
                    f"the Ray actor for engine {index} on node {node_id} could not start it:"
                    f" {why}") from e
            handle = RayEngineProcess(ray, self._actors[index], gen, pid, node_id, report, name)
        except BaseException:
            if report is not None:
                os.close(report)
            raise
        with self._lock:
            self._handles = [h for h in self._handles if not h._done.is_set()]
            self._handles.append(handle)
        return handle


def _start_ray(ray: Any, address: str | None) -> tuple[Any, Any] | None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local Ray on loopback only,
    unless one is initialized here already (then None). Returns the SIGTERM handlers before
    and after ``ray.init``, for ``_stop_ray``."""
    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS") or None
    before = signal.getsignal(signal.SIGTERM)
    if address is None:
        # "local": a new instance even if a `ray start` cluster runs on this host.
        with _loopback_node(ray):
            ray.init(address="local", _node_ip_address=LOCAL_RAY_IP, include_dashboard=False,
                     logging_level=logging.WARNING, log_to_driver=False,
                     object_store_memory=_LOCAL_OBJECT_STORE_BYTES)
        try:
            _check_loopback(ray)
        except BaseException:
            _stop_ray(ray, (before, signal.getsignal(signal.SIGTERM)))
            raise
    else:  # the caller's cluster: its addresses are the caller's choice
        ray.init(address=address, logging_level=logging.WARNING)
    # ray.init installs a SIGTERM handler in this process (sys.exit) that ray.shutdown
    # leaves behind: _stop_ray puts the caller's back.
    return before, signal.getsignal(signal.SIGTERM)


@contextlib.contextmanager
def _loopback_node(ray: Any) -> Iterator[None]:
    """Keep ``_node_ip_address="127.0.0.1"`` what it says while ``ray.init`` starts a node.
    ray.init turns a loopback node address into this host's network address ("remotely
    reachable": services.resolve_ip_for_localhost) unless Ray is in its single-host mode
    (``ray_constants.ENABLE_RAY_CLUSTER`` false, as on macOS and Windows, where it keeps
    loopback). A node on 127.0.0.1 has its GCS, raylet, object manager, agents and workers
    listen there only; started on the host's address, they listened on every interface.
    The flag is read at each resolution, so it is set for the call only; its subprocesses
    are told the node address and resolve nothing."""
    constants = ray._private.ray_constants
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved


def _check_loopback(ray: Any) -> None:
    """A local Ray's addresses, each a loopback one, or ``EngineStartupError``: checked,
    since the way to keep them there is not a public Ray option and may change."""
    found = {f"node {n['NodeManagerAddress']}" for n in ray.nodes()}
    found.add(f"GCS {ray.get_runtime_context().gcs_address}")
    found.add(f"driver {ray.util.get_node_ip_address()}")
    off = sorted(f for f in found if not is_loopback(f.split(" ", 1)[1]))
    if off:
        raise EngineStartupError(
            f"the local Ray (ray {getattr(ray, '__version__', '?')}) came up off loopback"
            f" ({', '.join(off)}), reachable from other hosts; start a Ray of your own and"
            " join it (ray_address=, RAY_ADDRESS or ray.init before the client)")


def is_loopback(address: str) -> bool:
    """Whether a host or ``host:port`` (``[v6]:port``) is a loopback address."""
    host = address.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host == "localhost" or host.startswith("localhost."):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    # ::ffff:127.0.0.1 is how a dual-stack socket shows an IPv4 loopback bind.
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool((mapped or ip).is_loopback)


def _stop_ray(ray: Any, sigterm: tuple[Any, Any]) -> None:
    ray.shutdown()
    before, ours = sigterm
    if ours is not before and signal.getsignal(signal.SIGTERM) is ours:
        with contextlib.suppress(ValueError, TypeError):  # not the main thread
            signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def ray_session(address: str | None = None) -> Iterator[Any]:
    """Ray for the duration of a block: the one initialized here, else one joined or started
    as ``RayEngines`` would, shut down at the end. Clients built inside share it: a campaign
    builds many, and Ray keeps a session's file descriptors after its shutdown, which a
    leak check per client would otherwise count."""
    ray = import_ray()
    started = _start_ray(ray, address)
    try:
        yield ray
    finally:
        if started is not None:
            _stop_ray(ray, started)


def _check_reach(kwargs: Mapping[str, Any], node_ip: str, here_ip: str, name: str) -> None:
    """Refuse what an engine on another host could not reach, or should not be sent (Rule 3)."""
    if node_ip == here_ip:
        return  # the same host: loopback and ipc reach it
    for key in ("input_address", "output_address"):
        address = str(kwargs.get(key, ""))
        where = f"{name} is placed on {node_ip}, another host than this front end ({here_ip})"
        if address.startswith("ipc://"):
            raise EngineStartupError(f"{where}: ipc does not cross hosts ({key}={address!r});"
                                     " use transport='tcp' bound to an address it can reach")
        host = address.removeprefix("tcp://").rsplit(":", 1)[0]
        if is_loopback(host):
            raise EngineStartupError(f"{where}: {key}={address!r} is this host's loopback;"
                                     " bind the client to an address that node can reach")
    if kwargs.get("curve") is None:
        raise EngineStartupError(f"{name} is placed on {node_ip}, another host: plain tcp is"
                                 " refused across hosts; leave CURVE on (the default for tcp)")


__all__ = [
    "ACTOR_DIED_EXITCODE",
    "INSTALL_HINT",
    "LOCAL_RAY_IP",
    "EngineNanny",
    "RayEngineProcess",
    "RayEngines",
    "import_ray",
    "is_loopback",
    "ray_session",
]
