"""``enginewire spec check``: the explorer and SPIN over the spec, and every negative control.

What runs:
1. each machine alone (BFS): an unreachable state or transition is a failure;
2. the composed models (BFS): the one-engine model (``compose.py``), the two-engine one
   (``compose_dp.py``) and the front-end one (``compose_fe.py``: two front ends over two
   engines), every safety property after each step, every liveness
   obligation at each quiescent world; a counterexample is printed as its shortest run;
   every table row of the machines a model covers (``COVERS``) must be exercised or declared
   unexercised with a reason (``UNEXERCISED``), and a declared row that became exercised
   fails too;
3. SPIN on the three Promela models rendered afresh from the tables (``render_promela()``,
   ``render_promela_dp()`` and ``render_promela_fe()``, the text of the committed
   ``spec/enginewire.pml``, ``spec/enginewire_dp.pml`` and ``spec/enginewire_fe.pml`` when
   ``generate --check`` passes): every property as LTL, ``pan -a -f`` (acceptance cycles
   under weak fairness); ``pan`` exits 0 even on a violation, so the verdict is parsed from
   ``errors: N``, and the trail is replayed with ``spin -t`` into the actor steps that lead
   to it;
4. every negative control of the three models in both checkers: each must break every
   property it names, else that property is vacuous and the check fails.

``--negative NAME`` checks the model with one control switched on as if it were the real
protocol, so it exits 1 and prints the shortest counterexample.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from enginewire.spec import (
    MACHINES,
    compose,
    compose_dp,
    compose_fe,
    promela,
    promela_dp,
    promela_fe,
)
from enginewire.spec.compose import BUGS
from enginewire.spec.explore import (
    ExploreResult,
    MachineReport,
    explore,
    explore_dp,
    explore_fe,
    explore_machine,
    uncovered_rows,
)
from enginewire.spec.promela import render_promela
from enginewire.spec.promela_dp import render_promela_dp
from enginewire.spec.promela_fe import render_promela_fe
from enginewire.spec.properties import (
    DP_LIVENESS,
    DP_PROPERTIES,
    DP_SAFETY,
    FE_LIVENESS,
    FE_PROPERTIES,
    FE_SAFETY,
    LIVENESS,
    PROPERTIES,
    SAFETY,
    control_targets,
    dp_control_targets,
    fe_control_targets,
)

__all__ = [
    "ALL_BUGS",
    "QUICK_CONTROLS",
    "UNEXERCISED",
    "ControlResult",
    "SpecReport",
    "SpinResult",
    "all_control_targets",
    "coverage_gaps",
    "main",
    "render_report",
    "run_spec_check",
    "run_spin",
    "spec_transition_cost_ns",
    "spin_available",
]

SPIN_TIMEOUT_S = 300
# Every negative control of the three models, and every row the one- and two-engine models may
# leave unexercised (the front-end model's are checked on their own: it covers SESSION too,
# and exercises the rows the one-engine model declares its).
ALL_BUGS: tuple[str, ...] = (*BUGS, *compose_dp.BUGS, *compose_fe.BUGS)
UNEXERCISED: dict[tuple[str, str], str] = {**compose.UNEXERCISED, **compose_dp.UNEXERCISED}
_KINDS = {p.name: p.kind for p in (*PROPERTIES, *DP_PROPERTIES, *FE_PROPERTIES)}


def all_control_targets() -> dict[str, tuple[str, ...]]:
    """The models' ``negative control -> properties it must break``, one-engine first."""
    return {**control_targets(), **dp_control_targets(), **fe_control_targets()}


@dataclass(frozen=True)
class SpinResult:
    prop: str
    bug: str | None
    errors: int
    states: int
    depth: int
    seconds: float
    output: str = ""  # pan's stdout, kept when it found an error (with the replay)


@dataclass(frozen=True)
class ControlResult:
    bug: str
    targets: tuple[str, ...]
    explorer_broke: tuple[str, ...]
    spin_broke: tuple[str, ...] | None  # None: SPIN was not run
    counterexample: str

    @property
    def ok(self) -> bool:
        spin_ok = self.spin_broke is None or set(self.targets) <= set(self.spin_broke)
        return set(self.targets) <= set(self.explorer_broke) and spin_ok


@dataclass
class SpecReport:
    machines: list[MachineReport] = field(default_factory=list)
    composed: ExploreResult | None = None
    dp_composed: ExploreResult | None = None  # the two-engine model
    fe_composed: ExploreResult | None = None  # the front-end model
    uncovered: dict[str, list[str]] = field(default_factory=dict)
    # rows neither exercised nor declared; declared rows that are exercised after all
    undeclared: list[str] = field(default_factory=list)
    stale_declared: list[str] = field(default_factory=list)
    spin: list[SpinResult] = field(default_factory=list)
    spin_skipped: str = ""
    controls: list[ControlResult] = field(default_factory=list)
    controls_skipped: int = 0  # left out by --quick
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            all(m.ok for m in self.machines)
            and (self.composed is None or self.composed.ok)
            and (self.dp_composed is None or self.dp_composed.ok)
            and (self.fe_composed is None or self.fe_composed.ok)
            and not self.undeclared
            and not self.stale_declared
            and all(r.errors == 0 for r in self.spin)
            and all(c.ok for c in self.controls)
        )


# ---- SPIN ------------------------------------------------------------------------------------

def spin_available() -> bool:
    return shutil.which("spin") is not None and shutil.which("gcc") is not None


def _sh(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=SPIN_TIMEOUT_S)
    if proc.returncode != 0:
        what = " ".join(cmd)
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def _compile(pml: str, workdir: Path, defines: Sequence[str], *, optimize: bool,
             nfair: int = promela.NFAIR) -> Path:
    # Either model is written as enginewire.pml here: replay_trail reads that name.
    (workdir / "enginewire.pml").write_text(pml, encoding="utf-8")
    _sh(["spin", *(f"-D{d}" for d in defines), "-a", "enginewire.pml"], workdir)
    # NFAIR=3 for the one-engine model's 7 processes, 4 for the two-engine one's 10
    # (promela.NFAIR, promela_dp.NFAIR). -O2 costs ~10 s more to compile and halves a full
    # search (about a million states per property): worth it for a sweep of every property,
    # not for a negative control, whose search stops at its first counterexample.
    _sh(["gcc", "-O2" if optimize else "-O0", "-w", f"-DNFAIR={nfair}", "-o", "pan", "pan.c"],
        workdir)
    return workdir / "pan"


_NUM = {
    "errors": re.compile(r"errors: (\d+)"),
    "states": re.compile(r"(\d+) states, stored"),
    "depth": re.compile(r"depth reached (\d+)"),
}


_STEP = re.compile(r"\s*(\d+):\s+proc\s+\d+ \((\w+):\d+\) enginewire\.pml:(\d+) ")


def replay_trail(workdir: Path, prop: str, defines: Sequence[str]) -> str:
    """``spin -t`` over the trail pan left in ``workdir``, cut down to one line per action.

    SPIN 6.5 has no option naming a claim for a replay, so the replay compiles only ``prop``'s
    claim (claims are not numbered processes: the trail's steps still match). An action is an
    ``atomic`` block; its source line (the guard) names it.
    """
    only = [d for d in defines if not d.startswith("LTL_")] + ["LTL_ONLY", f"LTL_{prop}"]
    text = _sh(["spin", *(f"-D{d}" for d in only), "-t", "-p", "enginewire.pml"], workdir)
    pml = (workdir / "enginewire.pml").read_text(encoding="utf-8").splitlines()
    actions = {i + 1 for i, line in enumerate(pml) if ":: atomic {" in line}
    steps: list[str] = []
    seen: set[tuple[str, str]] = set()  # (depth, line): an action's guard may be two statements
    for line in text.splitlines():
        hit = _STEP.match(line)
        key = (hit.group(1), hit.group(3)) if hit else ("", "")
        if hit is None or int(key[1]) not in actions or key in seen:
            continue
        seen.add(key)
        at = int(key[1])
        src = pml[at - 1].strip().removeprefix(":: atomic {").strip()
        if src.endswith("->") and at < len(pml):  # the guard alone does not say what ran
            src += " " + pml[at].strip()
        steps.append(f"  {len(steps) + 1:3d}. {hit.group(2):<9} {src[:150]}")
    tail = [line for line in text.splitlines() if "never claim" in line.lower()
            or "acceptance cycle" in line.lower() or "assertion violated" in line.lower()]
    return "\n".join([f"SPIN trail for {prop}: {len(steps)} actions", *steps, *tail[-2:]])


def _run_pan(workdir: Path, prop: str, bug: str | None, defines: Sequence[str]) -> SpinResult:
    t0 = time.perf_counter()
    out = _sh(["./pan", "-a", "-f", "-E", "-m50000", "-N", prop], workdir)
    found = {k: rx.search(out) for k, rx in _NUM.items()}
    if found["errors"] is None:
        raise RuntimeError(f"pan printed no 'errors:' line for {prop}:\n{out}")
    errors = int(found["errors"].group(1))
    if errors:
        try:  # best effort: the replay is for the reader, the verdict is already known
            out += "\n" + replay_trail(workdir, prop, defines)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out += f"\n(replay failed: {exc})"
    return SpinResult(
        prop, bug, errors,
        int(found["states"].group(1)) if found["states"] else 0,
        int(found["depth"].group(1)) if found["depth"] else 0,
        time.perf_counter() - t0,
        out if errors else "",
    )


def run_spin(props: Sequence[str], bug: str | None = None, *, pml: str | None = None,
             jobs: int = 2, dp: bool = False, fe: bool = False) -> list[SpinResult]:
    """Compile the model once (with ``-DBUG_<bug>``) and check each named property.
    ``dp``: the two-engine model (``pml`` defaults to ``render_promela_dp()``); ``fe``: the
    front-end model (``render_promela_fe()``)."""
    if pml is None:
        pml = render_promela_fe() if fe else render_promela_dp() if dp else render_promela()
    defines = [f"BUG_{bug.upper()}"] if bug else []
    if bug:  # only the claims under test: each claim costs compile time
        defines += ["LTL_ONLY", *(f"LTL_{p}" for p in props)]
    with tempfile.TemporaryDirectory(prefix="enginewire-spin-") as tmp:
        work = Path(tmp)
        _compile(pml, work, defines, optimize=bug is None and len(props) > 2,
                 nfair=promela_fe.NFAIR if fe else promela_dp.NFAIR if dp else promela.NFAIR)
        if len(props) <= 1 or jobs <= 1:
            return [_run_pan(work, p, bug, defines) for p in props]
        # pan writes its trail next to the model; one copy per worker avoids clashes.
        dirs: list[Path] = []
        for i in range(jobs):
            d = work / f"w{i}"
            d.mkdir()
            for name in ("pan", "enginewire.pml"):
                shutil.copy2(work / name, d / name)
            dirs.append(d)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(_run_pan, dirs[i % jobs], p, bug, defines)
                       for i, p in enumerate(props)]
            return [f.result() for f in futures]


# ---- the whole check -------------------------------------------------------------------------

def coverage_gaps(
    uncovered: dict[str, list[str]],
    declared: dict[tuple[str, str], str] | None = None,
) -> tuple[list[str], list[str]]:
    """``(undeclared, stale)``: rows neither exercised nor in ``declared`` (default: the one-
    and two-engine models' ``UNEXERCISED``; the front-end model passes its own), and rows
    listed there that the model exercises after all (so the lists stay true)."""
    declared = UNEXERCISED if declared is None else declared
    missing = {(mach, row) for mach, rows in uncovered.items() for row in rows}
    undeclared = sorted(f"{mach}: {row}" for mach, row in missing - set(declared))
    stale = sorted(f"{mach}: {row}" for mach, row in set(declared) - missing
                   if mach in uncovered)
    return undeclared, stale


def _explorer_control(bug: str, targets: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    run = (explore_fe if bug in compose_fe.BUGS else explore_dp if bug in compose_dp.BUGS
           else explore)
    res = run(bug, stop_when=frozenset(targets))
    broke = tuple(p for p in targets if p in res.violations)
    text = "\n".join(res.violations[p].render() for p in broke)
    return broke, text


# ``spec check --quick``: every property on the spec itself, but only these negative controls
# (the two of vLLM's known gaps the spec closes, one broken safety property, one broken
# liveness property, and two of the two-engine model's), so the README's first command stays
# short; the full check runs all.
QUICK_CONTROLS: tuple[str, ...] = (
    "forget_pending_on_death",  # utility futures that hang on engine death (vLLM)
    "no_startup_deadline",  # no startup deadline (vLLM)
    "abort_ack_before_flush",  # safety: an output after the finish
    "no_monitor",  # liveness: a death nobody notices
    "death_fails_every_engine",  # data parallel: one engine's loss fails the others' work
    "replacement_unmonitored",  # data parallel: a replacement's death nobody notices
    "join_waiter_after_event",  # elastic: the scale-up's waiter armed too late (vLLM #37357)
    "outputs_to_front_end_0",  # several front ends: outputs to front end 0 (vLLM #27711)
    "dead_work_left_running",  # several front ends: a dead front end's work runs on
)


def run_spec_check(
    *,
    negative: str | None = None,
    spin: bool | None = None,
    controls: bool = True,
    quick: bool = False,
    verbose: bool = False,
    out: Callable[[str], None] = print,
) -> int:
    """Run the check; print a summary table through ``out``; return the exit code.

    ``spin=None`` runs SPIN when it is installed and fails when it is not but ``CI`` is set.
    ``negative=NAME`` checks the model with that control on; it must fail (exit 1).
    ``quick`` runs only ``QUICK_CONTROLS`` of the negative controls (the spec's own check is
    the same) and prints the brief summary unless ``verbose``.
    """
    t0 = time.perf_counter()
    if negative is not None and negative not in ALL_BUGS:
        print(f"unknown negative control {negative!r}; choose one of: {', '.join(ALL_BUGS)}",
              file=sys.stderr)
        return 2
    # A control of one model switches that model only; the other is checked as specified.
    neg_one = negative if negative in BUGS else None
    neg_dp = negative if negative in compose_dp.BUGS else None
    neg_fe = negative if negative in compose_fe.BUGS else None
    if spin is None:
        spin = spin_available()
        if not spin:
            if os.environ.get("CI"):
                out("SPIN (and gcc) are required when CI is set: apt-get install spin")
                return 1
            out("note: spin not installed; liveness is checked by the explorer only")
    report = SpecReport()
    report.machines = [explore_machine(mach) for mach in MACHINES]
    with ThreadPoolExecutor(max_workers=1) as pool:
        # SPIN's searches are subprocesses: they run while the explorer (holding the GIL)
        # walks the same model here.
        sweep = pool.submit(run_spin, [p.name for p in PROPERTIES], neg_one) if spin else None
        sweep_dp = (pool.submit(run_spin, [p.name for p in DP_PROPERTIES], neg_dp, dp=True)
                    if spin else None)
        sweep_fe = (pool.submit(run_spin, [p.name for p in FE_PROPERTIES], neg_fe, fe=True)
                    if spin else None)
        report.composed = explore(neg_one)
        report.dp_composed = explore_dp(neg_dp)
        report.fe_composed = explore_fe(neg_fe)
        report.uncovered = {**uncovered_rows(report.composed, compose.COVERS),
                            **uncovered_rows(report.dp_composed, compose_dp.COVERS)}
        if negative is None:  # a control changes what runs; the declarations are the spec's
            report.undeclared, report.stale_declared = coverage_gaps(report.uncovered)
            fe_gaps = coverage_gaps(uncovered_rows(report.fe_composed, compose_fe.COVERS),
                                    compose_fe.UNEXERCISED)
            report.undeclared += [f"{row} (front-end model)" for row in fe_gaps[0]]
            report.stale_declared += [f"{row} (front-end model)" for row in fe_gaps[1]]
        if sweep is not None and sweep_dp is not None and sweep_fe is not None:
            report.spin = sweep.result() + sweep_dp.result() + sweep_fe.result()
        else:
            report.spin_skipped = "spin not run"
    targets_all = all_control_targets()
    chosen = {bug: targets for bug, targets in targets_all.items()
              if not quick or bug in QUICK_CONTROLS}
    report.controls_skipped = len(targets_all) - len(chosen) if controls else 0
    if controls and negative is None:
        # SPIN's compiles run two at a time in the background while the explorer (CPU-bound,
        # holding the GIL) works through the same controls here.
        with ThreadPoolExecutor(max_workers=2) as pool:
            pending = {
                bug: pool.submit(run_spin, list(targets), bug, jobs=1,
                                 dp=bug in compose_dp.BUGS, fe=bug in compose_fe.BUGS)
                for bug, targets in chosen.items()
            } if spin else {}
            for bug, targets in chosen.items():
                broke, text = _explorer_control(bug, targets)
                spin_broke: tuple[str, ...] | None = None
                if bug in pending:
                    spin_broke = tuple(r.prop for r in pending[bug].result() if r.errors > 0)
                report.controls.append(ControlResult(bug, targets, broke, spin_broke, text))
    report.seconds = time.perf_counter() - t0
    out(render_report(report, brief=quick and not verbose))
    return 0 if report.ok else 1


def render_report(report: SpecReport, *, brief: bool = False) -> str:
    """The summary table: machine, states, transitions, properties held, explored, time.

    ``brief`` (``spec check --quick`` without ``--verbose``, the README's main job): passing
    SPIN runs, rejected controls and the declared unexercised rows are counted in one line
    each instead of listed; anything that fails is listed in full either way."""
    lines: list[str] = []
    row = "{:<16} {:>7} {:>11} {:>10} {:>12} {:>9}"
    lines.append(
        row.format("machine", "states", "transitions", "unreached", "composed-cov", "time")
    )
    for m in report.machines:
        miss = len(report.uncovered.get(m.machine, []))
        lines.append(row.format(
            m.machine, m.states, m.transitions,
            len(m.unreachable_transitions) + len(m.unreachable_states),
            f"{m.transitions - miss}/{m.transitions}", f"{m.seconds * 1e3:.1f}ms",
        ))
    comp = report.composed
    if comp is not None:
        held = sum(1 for p in PROPERTIES if p.name not in comp.violations)
        lines.append("")
        lines.append(
            f"composed model{' (negative control ' + comp.bug + ')' if comp.bug else ''}: "
            f"{comp.states} worlds, {comp.edges} steps, {comp.quiescent} quiescent, "
            f"{comp.seconds:.2f}s (#3's bar: 60 s on 2 cores); "
            f"properties held {held}/{len(PROPERTIES)} "
            f"({len(SAFETY)} safety, {len(LIVENESS)} liveness)"
        )
        for v in comp.violations.values():
            lines.append(v.render())
    dpc = report.dp_composed
    if dpc is not None:
        held = sum(1 for p in DP_PROPERTIES if p.name not in dpc.violations)
        lines.append(
            f"two-engine model{' (negative control ' + dpc.bug + ')' if dpc.bug else ''}: "
            f"{dpc.states} worlds, {dpc.edges} steps, {dpc.quiescent} quiescent, "
            f"{dpc.seconds:.2f}s; properties held {held}/{len(DP_PROPERTIES)} "
            f"({len(DP_SAFETY)} safety, {len(DP_LIVENESS)} liveness)"
        )
        for v in dpc.violations.values():
            lines.append(v.render())
    fec = report.fe_composed
    if fec is not None:
        held = sum(1 for p in FE_PROPERTIES if p.name not in fec.violations)
        lines.append(
            f"front-end model{' (negative control ' + fec.bug + ')' if fec.bug else ''}: "
            f"{fec.states} worlds, {fec.edges} steps, {fec.quiescent} quiescent, "
            f"{fec.seconds:.2f}s; properties held {held}/{len(FE_PROPERTIES)} "
            f"({len(FE_SAFETY)} safety, {len(FE_LIVENESS)} liveness)"
        )
        for v in fec.violations.values():
            lines.append(v.render())
    for m in report.machines:
        for t in (*m.unreachable_states, *m.unreachable_transitions):
            lines.append(f"UNREACHABLE in {m.machine}: {t}")
    declared = [(mach, row) for mach, rows in report.uncovered.items() for row in rows
                if (mach, row) in UNEXERCISED]
    if declared and brief:
        lines.append(f"table rows the composed models do not exercise: {len(declared)}, each"
                     " with its declared reason (--verbose lists them)")
    elif declared:
        lines.append("")
        lines.append(f"table rows the composed models do not exercise ({len(declared)}, "
                     "compose.UNEXERCISED, compose_dp.UNEXERCISED):")
        lines += [f"  {mach}: {row}  -- {UNEXERCISED[mach, row]}" for mach, row in declared]
    for row in report.undeclared:
        lines.append(f"NOT EXERCISED and not declared in compose.UNEXERCISED: {row}")
    for row in report.stale_declared:
        lines.append(f"EXERCISED but declared in compose.UNEXERCISED (remove it): {row}")
    failed_spin = [r for r in report.spin if r.errors]
    if report.spin and brief and not failed_spin:
        searched = sum(r.seconds for r in report.spin)
        lines.append(f"SPIN: all {len(report.spin)} properties hold, no error"
                     f" ({searched:.0f} s of searches; --verbose: one row each)")
    elif report.spin:
        lines.append("")
        w = max(len("SPIN property"), *(len(r.prop) for r in report.spin))
        srow = "{:<" + str(w) + "} {:<8} {:>7} {:>9} {:>8}"
        lines.append(srow.format("SPIN property", "kind", "errors", "states", "time"))
        for r in report.spin:
            took = f"{r.seconds:.1f}s"
            lines.append(srow.format(r.prop, _KINDS[r.prop], r.errors, r.states, took))
            if r.errors:  # the replay when there is one, else pan's own last words
                at = r.output.find("SPIN trail for")
                lines.append(r.output[at:] if at >= 0 else r.output[-2000:])
    elif report.spin_skipped:
        lines.append(f"SPIN: {report.spin_skipped}")
    if report.controls and brief and all(c.ok for c in report.controls):
        both = all(c.spin_broke is not None for c in report.controls)
        lines.append(f"negative controls: {len(report.controls)} run, each rejected by the"
                     f" explorer{' and SPIN' if both else ''} ("
                     + ", ".join(c.bug for c in report.controls) + ")")
    elif report.controls:
        lines.append("")
        w = max(len("negative control"), *(len(c.bug) for c in report.controls))
        crow = "{:<" + str(w) + "} {:<44} {:<8} {:<8}"
        lines.append(crow.format("negative control", "must break", "explorer", "SPIN"))
        for c in report.controls:
            exp = "rejects" if set(c.targets) <= set(c.explorer_broke) else "MISSES"
            sp = "-" if c.spin_broke is None else (
                "rejects" if set(c.targets) <= set(c.spin_broke) else "MISSES")
            lines.append(crow.format(c.bug, ", ".join(c.targets), exp, sp))
            if not c.ok:
                lines.append(f"  vacuous property? {c.bug} must break {c.targets}")
    lines.append("")
    if report.controls_skipped:
        lines.append(f"quick check: {len(report.controls)} of"
                     f" {len(report.controls) + report.controls_skipped} negative controls;"
                     " every one runs in `enginewire spec check` (a few minutes)")
    lines.append(f"spec check {'OK' if report.ok else 'FAILED'} in {report.seconds:.1f}s")
    return "\n".join(lines)


# ---- the hot-path cost, for the benchmarks ---------------------------------------------------

def spec_transition_cost_ns(n: int = 200_000, repeat: int = 5) -> float:
    """Best-of-``repeat`` cost of one ``Lifecycle.fire`` in ns (request stream, unguarded)."""
    from enginewire.spec import CLIENT_REQUEST, ClientRequestEvent

    output = ClientRequestEvent.OUTPUT  # bound once: Enum class attribute access costs ~150 ns
    send = ClientRequestEvent.SEND
    best = float("inf")
    for _ in range(repeat):
        lc = CLIENT_REQUEST.lifecycle()
        lc.fire(send)
        lc.fire(output)
        fire = lc.fire
        t0 = time.perf_counter_ns()
        for _ in range(n // 10):
            fire(output); fire(output); fire(output); fire(output); fire(output)  # noqa: E702
            fire(output); fire(output); fire(output); fire(output); fire(output)  # noqa: E702
        best = min(best, (time.perf_counter_ns() - t0) / (n // 10 * 10))
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m enginewire.testing.spec_check")
    parser.add_argument("--negative", metavar="NAME", help=f"one of: {', '.join(ALL_BUGS)}")
    parser.add_argument("--no-spin", action="store_true", help="explorer only")
    parser.add_argument("--no-controls", action="store_true", help="skip the negative controls")
    parser.add_argument("--quick", action="store_true",
                        help=f"only {len(QUICK_CONTROLS)} of the negative controls")
    parser.add_argument("--verbose", action="store_true",
                        help="with --quick: every table in full")
    args = parser.parse_args(argv)
    return run_spec_check(
        negative=args.negative,
        spin=False if args.no_spin else None,
        controls=not args.no_controls,
        quick=args.quick,
        verbose=args.verbose,
    )


if __name__ == "__main__":
    sys.exit(main())
