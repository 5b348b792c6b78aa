"""The fault matrix: every fault, at every point, in every lifecycle state where it applies.

Theory of operation
-------------------
A *cell* is (client kind, scenario, fault). The scenario puts the engine in one lifecycle
state (starting, generating, serving a utility, sleeping, shutting down, or carrying frames
through the ``Interposer``) and the fault fires there. The cell then observes, with a bound on
every wait, what the front end saw and classifies it as one ``Outcome``; ``expected_outcome``
says what the spec requires. A cell passes when the outcome is the expected one, a death was
detected within its latency bound, and nothing leaked (child processes, threads, fds, ipc
directories, as _harness.py defines them) once the client was shut down. What every kind of
cell is made of (outcomes, result rows, the classifier, the request and utility drivers) is
_cells.py's, which the interposer's frame cells and the data-parallel cells use too.

Expectations, in one place (the spec's failure rules, restated per fault):

* a raise, OOM, ``os._exit``, SIGKILL inside the engine's loop or IO threads -> ``DEAD``
  within ``DEATH_BOUND_S`` (sentinel or exit code), every waiter woken;
* the same inside a utility that the engine survives (raise, OOM) -> ``UTILITY_ERROR`` and the
  engine still serves;
* any death before the ready handshake -> ``STARTUP_ERROR``;
* SIGSTOP (alive, silent) -> ``DEAD`` by the heartbeat deadline, within ``DEATH_BOUND_S``
  like any death (a pending utility call fails with it); before the handshake ->
  ``STARTUP_ERROR`` at the ready deadline;
* a delay -> ``OK`` (right tokens, just later);
* anything at shutdown -> ``OK``: ``shutdown()`` returns within its bound, nothing leaks;
* frames the interposer drops, reorders, truncates or corrupts -> a detected outcome
  (``DEAD`` with a ``ProtocolError`` cause, an ERROR finish, a failed utility), never
  ``HANG`` and never ``SILENT_CORRUPTION`` (tokens that differ from a clean run's).

Your own client (``factory=``, ``enginewire faults matrix --factory MODULE:FUNCTION``): a
``ClientFactory`` (conformance.py) builds every cell's client, with the options a built-in one
gets. One client it builds as configured comes first (``_probe_factory``): its kind says which
cells apply, and its clean run of the matrix's request gives the reference tokens. A cell whose
options the factory refuses (``NotApplicable``) is ``NOT_APPLICABLE``: in the table and the
JSON, neither passed nor failed. A factory may also declare where its client's contract
differs (``factory.contract``, names of ``Declared`` in _conformance_driver.py): the matrix
then leaves out an option it declares unsupported, reports a cell only that option could
judge as not applicable (``declared_away``, the declaration in the detail), waits the ready
deadline where a start-up death is declared seen only there, and excuses a declared
leftover in the leak check.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.faults import Fault, FaultAction, FaultInjector, FaultPlan, FaultPoint
from ..spec.errors import UtilityTimeoutError
from . import interposer
from ._cells import (
    CELL_BOUND_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    SHUTDOWN_TIMEOUT_S,
    UTILITY_TIMEOUT_S,
    CellResult,
    Observed,
    Outcome,
    await_death,
    build_with,
    classify,
    clean_refusal,
    fired_at,
    generate,
    reference_tokens,
    run_tokens,
    utility,
)
from ._conformance_driver import (
    CLIENT_KINDS,
    Declared,
    declared_contract,
    declared_reason,
    left_behind_as_declared,
)
from ._harness import ResourceSnapshot
from .bounds import DEATH_BOUND_S

if TYPE_CHECKING:
    from .conformance import ClientFactory

__all__ = [
    "CELL_BOUND_S",
    "Cell",
    "CellResult",
    "Outcome",
    "Scenario",
    "expected_outcome",
    "matrix_cells",
    "run_cell",
    "run_fault_matrix",
    "run_fe_fault_matrix",
]

# What a cell's shutdown may take at worst: its engine's SIGTERM grace, then SIGKILL and
# reaping (bounds.SHUTDOWN_BOUND_S is the clean path's bound, without the grace).
CELL_SHUTDOWN_BOUND_S = SHUTDOWN_TIMEOUT_S + 4.0
# Ready deadline for cells whose engine hangs before the handshake (must exceed a build).
STARTUP_HANG_READY_S = 25.0
DELAY_S = 0.3


class Scenario(enum.StrEnum):
    STARTUP = "startup"
    GENERATE = "generate"
    UTILITY = "utility"
    SLEEP = "sleep"
    SHUTDOWN = "shutdown"


# Which points each scenario reaches, so every fault is placed where it can fire.
SCENARIO_POINTS: dict[Scenario, tuple[FaultPoint, ...]] = {
    Scenario.STARTUP: (FaultPoint.BEFORE_READY, FaultPoint.AFTER_READY),
    Scenario.GENERATE: (FaultPoint.STEP, FaultPoint.FORWARD, FaultPoint.INPUT_DECODED,
                        FaultPoint.OUTPUT_SEND),
    Scenario.UTILITY: (FaultPoint.UTILITY,),
    Scenario.SLEEP: (FaultPoint.SLEEP, FaultPoint.WAKE_UP),
    Scenario.SHUTDOWN: (FaultPoint.SHUTDOWN,),
}
# Engine-side points an in-process engine reaches (it has no IO threads or handshake).
INPROC_POINTS = frozenset({FaultPoint.STEP, FaultPoint.FORWARD, FaultPoint.UTILITY,
                           FaultPoint.SLEEP, FaultPoint.WAKE_UP})
# Actions that would stop the test process itself if the engine shares it.
PROCESS_ACTIONS = frozenset({FaultAction.EXIT, FaultAction.SIGKILL, FaultAction.SIGSTOP})
# Hit number per point: late enough that the engine did real work first.
_AT = {FaultPoint.STEP: 3, FaultPoint.FORWARD: 3, FaultPoint.OUTPUT_SEND: 2}


@dataclass(frozen=True)
class Cell:
    client: str
    scenario: Scenario
    fault: Fault

    def __post_init__(self) -> None:
        # A bad cell must fail where it is written, not run and report "harness_error".
        if self.client not in CLIENT_KINDS:
            raise ValueError(f"Cell.client={self.client!r}: must be one of {CLIENT_KINDS}")
        if not isinstance(self.scenario, Scenario):
            try:
                object.__setattr__(self, "scenario", Scenario(self.scenario))
            except ValueError:
                raise ValueError(f"Cell.scenario={self.scenario!r}: must be one of"
                                 f" {[s.value for s in Scenario]}") from None
        if not isinstance(self.fault, Fault):
            raise TypeError(f"Cell.fault={self.fault!r}: must be a Fault")
        if self.client == "inproc" and self.fault.action in PROCESS_ACTIONS:
            raise ValueError(f"Cell: {self.fault.action.value} on an inproc engine would stop"
                             " the test process itself")

    @property
    def name(self) -> str:
        return f"{self.client}/{self.scenario.value}/{self.fault}"


def expected_outcome(cell: Cell) -> Outcome:
    """What the spec requires of ``cell`` (see the module docstring)."""
    f = cell.fault
    if f.action is FaultAction.DELAY or cell.scenario is Scenario.SHUTDOWN:
        return Outcome.OK
    if f.point is FaultPoint.BEFORE_READY:
        return Outcome.STARTUP_ERROR
    in_utility = f.point in (FaultPoint.UTILITY, FaultPoint.SLEEP, FaultPoint.WAKE_UP)
    if in_utility and f.action in (FaultAction.RAISE, FaultAction.OOM):
        return Outcome.UTILITY_ERROR
    return Outcome.DEAD


def _start_seen_at_ready_deadline(cell: Cell, contract: Mapping[str, str]) -> bool:
    """A hang before the handshake, or (where the factory declares that its client watches
    no process while it attaches) any death there: only the ready deadline can show it."""
    f = cell.fault
    if f.point is not FaultPoint.BEFORE_READY or f.action is FaultAction.DELAY:
        return False
    return f.action is FaultAction.SIGSTOP or (
        Declared.STARTUP_DEATH_AT_READY_DEADLINE in contract)


def latency_bound(cell: Cell, contract: Mapping[str, str] | None = None) -> float:
    if _start_seen_at_ready_deadline(cell, contract or {}):
        # No heartbeat before the handshake (a build may take seconds): the ready deadline
        # turns this hang into a startup error, not a death.
        return STARTUP_HANG_READY_S + 2.0
    return DEATH_BOUND_S


def declared_away(cell: Cell, contract: Mapping[str, str]) -> str | None:
    """Why ``cell`` cannot judge a client whose factory declares ``contract`` (``Declared``),
    or None: a SIGSTOP after the handshake is seen only by a heartbeat deadline, which a
    client declaring ``NO_HEARTBEAT_DEADLINE`` does not have (at shutdown the cell judges the
    shutdown's bound, which needs none)."""
    f = cell.fault
    if (Declared.NO_HEARTBEAT_DEADLINE in contract and f.action is FaultAction.SIGSTOP
            and f.point is not FaultPoint.BEFORE_READY and cell.scenario is not Scenario.SHUTDOWN):
        return declared_reason(contract, Declared.NO_HEARTBEAT_DEADLINE)
    return None


def _applies(client: str, scenario: Scenario, point: FaultPoint, action: FaultAction) -> bool:
    if client == "inproc":
        return point in INPROC_POINTS and action not in PROCESS_ACTIONS
    return True


def matrix_cells(clients: list[str], quick: bool) -> list[Cell]:
    """Every applicable cell, or the quick subset CI runs."""
    cells: list[Cell] = []
    if quick:
        picks: list[tuple[str, Scenario, Fault]] = []
        sync = [
            (Scenario.STARTUP, Fault(point=FaultPoint.BEFORE_READY)),
            (Scenario.STARTUP, Fault(point=FaultPoint.AFTER_READY, action=FaultAction.EXIT)),
            (Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3)),
            (Scenario.GENERATE, Fault(point=FaultPoint.STEP, at=3,
                                      action=FaultAction.SIGKILL)),
            (Scenario.GENERATE, Fault(point=FaultPoint.OUTPUT_SEND, at=2,
                                      action=FaultAction.SIGSTOP)),
            (Scenario.GENERATE, Fault(point=FaultPoint.INPUT_DECODED)),
            (Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3,
                                      action=FaultAction.DELAY, arg=DELAY_S)),
            (Scenario.UTILITY, Fault(point=FaultPoint.UTILITY, method="echo")),
            (Scenario.UTILITY, Fault(point=FaultPoint.UTILITY, method="echo",
                                     action=FaultAction.SIGSTOP)),
            (Scenario.SHUTDOWN, Fault(point=FaultPoint.SHUTDOWN, action=FaultAction.SIGSTOP)),
        ]
        picks += [("sync", s, f) for s, f in sync]
        picks += [
            ("async", Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3,
                                               action=FaultAction.OOM)),
            ("async", Scenario.UTILITY, Fault(point=FaultPoint.UTILITY, method="echo",
                                              action=FaultAction.SIGKILL)),
            ("async", Scenario.GENERATE, Fault(point=FaultPoint.STEP, at=3,
                                               action=FaultAction.SIGSTOP)),
            ("inproc", Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3)),
            ("inproc", Scenario.UTILITY, Fault(point=FaultPoint.UTILITY, method="echo")),
            ("inproc", Scenario.SLEEP, Fault(point=FaultPoint.SLEEP, action=FaultAction.OOM)),
        ]
        return [Cell(c, s, f) for c, s, f in picks if c in clients]
    for client in clients:
        for scenario, points in SCENARIO_POINTS.items():
            for point in points:
                for action in FaultAction:
                    if not _applies(client, scenario, point, action):
                        continue
                    arg = DELAY_S if action is FaultAction.DELAY else None
                    method = "echo" if point is FaultPoint.UTILITY else None
                    fault = Fault(point=point, action=action, at=_AT.get(point, 1), arg=arg,
                                  method=method)
                    cells.append(Cell(client, scenario, fault))
    return cells


# --- running one cell -------------------------------------------------------------------------


def _after_utility_error(cut: Any) -> None:
    # The call failed, not the engine: it must still answer.
    if cut.call_utility("echo", 8, timeout=10.0) != 8:
        raise Observed(Outcome.SILENT_CORRUPTION, "echo after a failed utility is wrong")


def _sleep_wake(cut: Any, deadline: float) -> Outcome:
    try:
        cut.call_utility("sleep", 1, "abort", timeout=UTILITY_TIMEOUT_S * 4)
        cut.call_utility("wake_up", None, timeout=UTILITY_TIMEOUT_S * 4)
    except UtilityTimeoutError:
        await_death(cut, deadline)
        raise
    return Outcome.OK


def _open(cell: Cell, config: Any, plan: FaultPlan, ready_timeout_s: float,
          factory: ClientFactory | None = None, monitor: Any = None) -> Any:
    from .conformance import NotApplicable, open_client

    if cell.client == "inproc":
        # No engine process to send a plan to: it goes into the engine's own fault hook.
        cut = build_with(factory) if factory is not None else open_client("inproc", config)
        engine = getattr(cut.client, "engine", None)
        if engine is None or not hasattr(engine, "fault_hook"):
            cut.shutdown()
            raise NotApplicable(f"{type(cut.client).__name__} has no engine.fault_hook to plant"
                                " the fault in")
        engine.fault_hook = FaultInjector(plan, device=str(getattr(engine, "device", "cpu")))
        return cut
    options: dict[str, Any] = dict(engine_fault=plan,
                                   engine_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                                   engine_heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                                   shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
                                   ready_timeout_s=ready_timeout_s)
    if factory is not None:
        if Declared.NO_HEARTBEAT_DEADLINE in declared_contract(factory):
            del options["engine_heartbeat_timeout_s"]  # the cells that need it are n/a
    if monitor is not None:  # a MonitorSink: the client's link goes through a monitor
        return _monitored_open(cell, config, factory, monitor, options)
    if factory is not None:
        return build_with(factory, **options)
    return open_client(cell.client, config, **options)


def _monitored_open(cell: Cell, config: Any, factory: ClientFactory | None, sink: Any,
                    options: dict[str, Any]) -> Any:
    import math

    from .conformance import open_client
    from .monitor import monitored

    def build(**more: Any) -> Any:
        if factory is not None:
            return build_with(factory, **more)
        return open_client(cell.client, config, **more)

    wire = ("vllm-0.33" if factory is not None
            and Declared.VLLM_WIRE in declared_contract(factory) else "enginewire")
    # Faults stop and kill engines: an abort then goes unanswered by design.
    return monitored(build, sink, wire=wire, abort_bound_s=math.inf)(**options)


def run_cell(cell: Cell, config: Any, workdir: str, *, factory: ClientFactory | None = None,
             reference: list[int] | None = None, monitor: Any = None) -> CellResult:
    """Run one cell in a bounded time; never raises for an engine-side outcome.

    With ``factory`` the cell's client is ``factory(**options)`` (the options a built-in one
    gets); a refusal is ``NOT_APPLICABLE``. ``reference``: a clean run's tokens (default: an
    in-process run of ``config``). ``monitor``: a ``monitor.MonitorSink`` that a monitor on
    the cell's link (not the in-process client's: it has none) reports to."""
    expected = expected_outcome(cell)
    contract = declared_contract(factory) if factory is not None else {}
    away = declared_away(cell, contract)
    if away is not None:
        return _not_applicable(cell.name, cell.client, cell.scenario.value,
                               cell.fault.point.value, cell.fault.action.value,
                               expected.value, away)
    fd, name = tempfile.mkstemp(prefix="fault-", suffix=".log", dir=workdir)
    os.close(fd)  # the engine writes it; held open here, it was one fd per cell for the run
    record = Path(name)
    plan = FaultPlan(faults=[cell.fault], record_path=str(record))
    reference = reference if reference is not None else reference_tokens(config)
    before = ResourceSnapshot.take()
    start = time.monotonic()
    deadline = start + CELL_BOUND_S - 10.0
    cut: Any = None
    outcome, detail, seen_at = Outcome.HANG, "", None
    ready_s = STARTUP_HANG_READY_S if _start_seen_at_ready_deadline(cell, contract) else 60.0
    try:
        try:
            cut = _open(cell, config, plan, ready_s, factory, monitor)
            if cell.scenario in (Scenario.GENERATE, Scenario.STARTUP):
                outcome = generate(cut, deadline, reference)
            elif cell.scenario is Scenario.UTILITY:
                outcome = utility(cut, deadline)
            elif cell.scenario is Scenario.SLEEP:
                outcome = _sleep_wake(cut, deadline)
            elif cell.scenario is Scenario.SHUTDOWN:
                outcome = generate(cut, deadline, reference)
                t0 = time.monotonic()
                cut.shutdown()
                took = time.monotonic() - t0
                if took > CELL_SHUTDOWN_BOUND_S:
                    outcome, detail = Outcome.HANG, f"shutdown took {took:.1f} s"
        except BaseException as e:
            seen_at = time.monotonic()
            obs = classify(e)
            outcome, detail = obs.outcome, obs.detail
            if outcome is Outcome.UTILITY_ERROR and expected is Outcome.UTILITY_ERROR:
                try:
                    _after_utility_error(cut)
                except BaseException as e2:
                    obs = classify(e2)
                    outcome, detail = obs.outcome, f"after the utility error: {obs.detail}"
    finally:
        if cut is not None:
            pid = getattr(cut.client, "engine_pid", None)
            if pid is not None and cell.fault.action is FaultAction.SIGSTOP:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)  # the harness resumes what it stopped
            with contextlib.suppress(Exception):
                cut.shutdown()
    wall = time.monotonic() - start
    fired = fired_at(record)
    latency = None
    if seen_at is not None and fired is not None and outcome in (
            Outcome.DEAD, Outcome.STARTUP_ERROR):
        latency = max(0.0, seen_at - fired) * 1000.0
    with contextlib.suppress(OSError):
        record.unlink()
    leaks = left_behind_as_declared(before, contract)
    outcome, detail = clean_refusal(outcome, detail, leaks)
    passed = outcome is expected and not leaks and wall <= CELL_BOUND_S
    bound = latency_bound(cell, contract)
    if passed and latency is not None and latency > bound * 1000.0:
        passed = False
        detail = f"detected after {latency:.0f} ms (bound {bound * 1000:.0f})"
    return CellResult(
        cell=cell.name, client=cell.client, scenario=cell.scenario.value,
        point=cell.fault.point.value, action=cell.fault.action.value,
        expected=expected.value, outcome=outcome.value, passed=passed,
        latency_ms=None if latency is None else round(latency, 1), wall_s=round(wall, 2),
        leaks=leaks, detail=detail)


# --- the matrix -------------------------------------------------------------------------------


def _default_config() -> Any:
    from ..runtime.config import EngineConfig

    return EngineConfig(model="tiny", max_num_seqs=4)


@contextlib.contextmanager
def _engine_threads(n: str = "1") -> Iterator[None]:
    # Engines on a shared CI machine oversubscribe cores with torch's default thread count.
    # In-process engines step on each cell's own thread: one intra-op thread, or every new
    # stepping thread gets an OpenMP team that outlives it and reads as a leaked thread.
    import torch

    # Injected crashes log tracebacks by design; quiet unless the caller asked for a level.
    saved = {k: os.environ.get(k) for k in ("ENGINEWIRE_ENGINE_THREADS",
                                            "ENGINEWIRE_ENGINE_LOG_LEVEL")}
    old_torch = torch.get_num_threads()
    os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", n)
    os.environ.setdefault("ENGINEWIRE_ENGINE_LOG_LEVEL", "CRITICAL")
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old_torch)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def _skipped(r: CellResult) -> bool:
    return r.outcome == Outcome.NOT_APPLICABLE.value


def format_table(results: list[CellResult]) -> str:
    head = ("cell", "expected", "outcome", "latency ms", "leaks", "pass")
    rows = [head] + [
        (r.cell, r.expected, r.outcome, "-" if r.latency_ms is None else f"{r.latency_ms:.0f}",
         ",".join(sorted(r.leaks)) or "-",
         "n/a" if _skipped(r) else "yes" if r.passed else "NO")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_fault_matrix(
    clients: list[str] | None = None,
    quick: bool = False,
    results_dir: str = "results",
    *,
    config: Any = None,
    cells: list[Cell] | None = None,
    extra_cells: list[Callable[[str], CellResult]] | None = None,
    echo: Callable[[str], None] | None = print,
    factory: ClientFactory | None = None,
    monitor: bool = False,
) -> int:
    """Run the matrix; print the table; write ``<results_dir>/fault_matrix.json``.

    Returns the exit status: 0 when every cell matched the spec (or was not applicable), 1
    otherwise. ``extra_cells`` are callables ``(workdir) -> CellResult`` (the interposer's
    cells register here, and, without a factory, the front-end cells of fault_matrix_fe.py).
    The data-parallel cells run through here too (fault_matrix_dp.py).
    ``factory``: a ``ClientFactory`` that builds every cell's client instead of the built-in
    ones, with its own config (``config`` then only seeds the default cell list); the kind
    of client it builds is the default for ``clients``, and a cell of another kind is not
    applicable (module docstring).
    """
    asked = list(dict.fromkeys(clients or ()))  # --client sync --client sync: once
    bad = [c for c in asked if c not in CLIENT_KINDS]
    if bad:
        raise ValueError(f"unknown client kinds {bad}; choose from {CLIENT_KINDS}")
    if factory is not None and not callable(factory):
        raise TypeError(f"factory must be a ClientFactory (a callable), got {factory!r}")
    # Before any cell runs: a path that cannot be written must not cost the whole matrix.
    out_dir = Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PermissionError(f"results_dir {results_dir!r} is not writable")
    config = config if config is not None else _default_config()
    results: list[CellResult] = []

    def report_cell(r: CellResult) -> None:
        results.append(r)
        if echo is not None:
            verdict = "n/a " if _skipped(r) else "pass" if r.passed else "FAIL"
            echo(f"{verdict} {r.cell}: {r.outcome} ({r.wall_s:.1f} s) {r.detail}")

    t0 = time.monotonic()
    probe: _Probe | None = None
    sink = None
    if monitor:  # one monitor per cell's link, all reporting here (docs/monitor.md)
        from .monitor import MonitorSink

        sink = MonitorSink()
    with _engine_threads(), tempfile.TemporaryDirectory(prefix="enginewire-faults-") as work:
        if factory is not None:
            probe, failure = _probe_factory(factory)
            if failure is not None:
                report_cell(failure)
        kinds = asked or ([probe.kind] if probe is not None else [] if factory is not None
                          else list(CLIENT_KINDS))
        todo = cells if cells is not None else matrix_cells(kinds, quick)
        if extra_cells is None:
            extra_cells = interposer.interposer_cells(
                kinds, quick, config, factory=factory,
                reference=None if probe is None else probe.reference)
            if factory is None:
                # One engine serving two front ends, one of them lost (fault_matrix_fe.py):
                # quick, a kill and an integrity failure, about 10 s.
                from .fault_matrix_fe import fe_cells

                extra_cells = [*extra_cells, *fe_cells(kinds, quick)]
        if factory is not None and probe is None:
            todo, extra_cells = [], []  # the failure row says why: every cell would repeat it
        # Without cells of its own, the clean warm-up run (see _warm_up) is for the kinds of
        # the extra cells (the data-parallel ones name theirs).
        warm = todo or [Cell(k, Scenario.GENERATE, Fault(point=FaultPoint.STEP,
                                                         action=FaultAction.DELAY, arg=0.0))
                        for k in sorted({getattr(x, "client", "inproc") for x in extra_cells})
                        if k in CLIENT_KINDS and k != "inproc"]
        if probe is not None:
            warm = [c for c in warm if c.client == probe.kind]
        if todo or extra_cells:
            _warm_up(config, warm, work, factory, probe)
        for cell in todo:
            if probe is not None and cell.client != probe.kind:
                report_cell(_not_applicable(cell.name, cell.client, cell.scenario.value,
                                            cell.fault.point.value, cell.fault.action.value,
                                            expected_outcome(cell).value, probe.other_kind_reason))
                continue
            report_cell(_bounded(functools.partial(
                run_cell, cell, config, work, factory=factory,
                reference=None if probe is None else probe.reference, monitor=sink),
                cell.name))
        for extra in extra_cells:
            name = getattr(extra, "name", "extra")
            kind = getattr(extra, "client", None)
            if probe is not None and kind in CLIENT_KINDS and kind != probe.kind:
                report_cell(_not_applicable(name, str(kind), "?", "?", "?", "?",
                                            probe.other_kind_reason))
                continue
            report_cell(_bounded(functools.partial(extra, work), name))
    failed = [r for r in results if not r.passed and not _skipped(r)]
    skipped = [r for r in results if _skipped(r)]
    if echo is not None:
        echo(format_table(results))  # first: the table survives a failed write below
    report = {
        "quick": quick, "clients": kinds, "cells": len(results), "failed": len(failed),
        "not_applicable": len(skipped),
        "factory": None if factory is None else _factory_name(factory),
        "wall_s": round(time.monotonic() - t0, 1),
        "bounds": {"death_s": DEATH_BOUND_S, "hang_s": DEATH_BOUND_S, "cell_s": CELL_BOUND_S,
                   "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                   "heartbeat_interval_s": HEARTBEAT_INTERVAL_S},
        "results": [asdict(r) for r in results],
    }
    if sink is not None:
        # Reported, not judged: the cells inject faults the wire shows (a corrupt frame, a
        # death without its sentinel), so the cells' own outcomes stay the verdict.
        seen = sink.report()
        report["monitor"] = seen
        if echo is not None:
            cov = seen["coverage"]
            echo(f"monitor: {sink.links} link(s), {len(sink.violations)} violation(s) seen"
                 f" on the wire; coverage {cov['transitions_reached']}/"
                 f"{cov['transitions_declared']} transitions")
    out = out_dir / "fault_matrix.json"
    # Written whole and renamed into place: concurrent matrices in one directory never
    # interleave their JSON (the last one wins).
    tmp = out_dir / f".fault_matrix-{os.getpid()}-{threading.get_ident()}.json"
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out)
    if echo is not None:
        ran = len(results) - len(skipped)
        echo(f"{ran - len(failed)}/{ran} cells as the spec requires"
             + (f" ({len(skipped)} not applicable)" if skipped else "") + f"; JSON: {out}")
    return 1 if failed else 0


def run_fe_fault_matrix(
    clients: list[str] | None = None,
    quick: bool = False,
    results_dir: str = "results",
    *,
    config: Any = None,
    echo: Any = print,
) -> int:
    """``run_fault_matrix`` over the front-end cells only (``enginewire faults matrix
    --front-ends 2``, model_tests/fault_matrix_fe.py): 0 when every cell is as the spec
    requires, 1 otherwise. Here rather than beside the cells, which the quick matrix runs
    too: that module imports nothing of this one."""
    kinds = list(dict.fromkeys(clients or ("sync", "async")))
    bad = [c for c in kinds if c not in ("sync", "async")]
    if bad:
        raise ValueError(f"client kinds {bad}: the front-end cells run on sync and async")
    from .fault_matrix_fe import fe_cells

    config = config if config is not None else _default_config()
    return run_fault_matrix(kinds, quick, results_dir, config=config, cells=[],
                               extra_cells=list(fe_cells(kinds, quick)), echo=echo)


def _not_applicable(name: str, client: str, scenario: str, point: str, action: str,
                    expected: str, why: str) -> CellResult:
    return CellResult(cell=name, client=client, scenario=scenario, point=point, action=action,
                      expected=expected, outcome=Outcome.NOT_APPLICABLE.value, passed=False,
                      detail=why)


# --- a factory of the user's ------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe:
    kind: str  # the factory's ClientUnderTest.kind
    reference: list[int]  # its clean run's tokens

    @property
    def other_kind_reason(self) -> str:
        return f"the factory builds {self.kind} clients"


def _factory_name(factory: Any) -> str:
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(factory)


def _probe_factory(factory: ClientFactory) -> tuple[_Probe | None, CellResult | None]:
    """One client the factory builds as configured (no options, which the contract says it
    must build): its kind decides which cells apply, and its clean run of the matrix's request
    is every cell's reference (the factory's engine and config, not the built-in in-process
    one, say what a clean run gives). A failure here is the one row the matrix reports."""
    from .conformance import ClientUnderTest

    found: list[_Probe] = []
    name = f"factory {_factory_name(factory)}"

    def probe() -> CellResult:
        start = time.monotonic()
        outcome, detail, kind, cut = Outcome.OK, "", "?", None
        try:
            cut = build_with(factory)
            if not isinstance(cut, ClientUnderTest):
                raise Observed(Outcome.HARNESS_ERROR, f"the factory returned a"
                                f" {type(cut).__name__}, not a ClientUnderTest")
            kind = cut.kind
            found.append(_Probe(kind, run_tokens(cut, start + CELL_BOUND_S - 10.0)))
        except BaseException as e:
            obs = classify(e)
            outcome = obs.outcome
            if outcome is Outcome.NOT_APPLICABLE:  # with no options there is nothing to refuse
                outcome = Outcome.HARNESS_ERROR
            detail = f"cannot build and run a clean client, so no cell ran: {obs.detail}"
        finally:
            if cut is not None and hasattr(cut, "shutdown"):
                with contextlib.suppress(Exception):
                    cut.shutdown()
        return CellResult(cell=name, client=kind, scenario="construct", point="-", action="-",
                          expected=Outcome.OK.value, outcome=outcome.value,
                          passed=outcome is Outcome.OK,
                          wall_s=round(time.monotonic() - start, 2), detail=detail[:300])

    result = _bounded(probe, name)
    if result.passed and found:
        return found[0], None
    return None, result


def _warm_up(config: Any, cells: list[Cell], work: str, factory: ClientFactory | None = None,
             probe: _Probe | None = None) -> None:
    """Create the process-wide things first use creates (multiprocessing's resource tracker
    and its pipe, torch's per-thread state), so no cell counts them as its leak; and run one
    clean generation per multi-process kind, so the first cell is not charged this process's
    first-use costs (under load they once stalled the reader past the heartbeat deadline and
    a live engine was declared dead). A factory's probe was that clean generation."""
    from multiprocessing import resource_tracker

    reference_tokens(config)
    resource_tracker.ensure_running()
    reference = None if probe is None else probe.reference
    inproc = [c for c in cells if c.client == "inproc"]
    if inproc:
        _bounded(lambda: run_cell(inproc[0], config, work, factory=factory,
                                  reference=reference), "warm-up")
    if factory is not None:
        return
    for kind in sorted({c.client for c in cells} - {"inproc"}):
        clean = Cell(kind, Scenario.GENERATE,
                     Fault(point=FaultPoint.STEP, action=FaultAction.DELAY, arg=0.0))
        _bounded(functools.partial(run_cell, clean, config, work), f"warm-up {kind}")


def _bounded(fn: Callable[[], CellResult], name: str) -> CellResult:
    """Run a cell on a helper thread so even a harness bug cannot hang the matrix."""
    box: list[CellResult] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=target, name=f"fault-cell {name}", daemon=True)
    t.start()
    t.join(CELL_BOUND_S)
    if box:
        return box[0]
    outcome = Outcome.HANG if t.is_alive() else Outcome.HARNESS_ERROR
    detail = f"{type(error[0]).__name__}: {error[0]}" if error else "cell bound exceeded"
    return CellResult(cell=name, client="?", scenario="?", point="?", action="?",
                      expected="?", outcome=outcome.value, passed=False, detail=detail[:300])
