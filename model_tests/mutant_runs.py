"""A mutant's campaign in a child process, the detection table of the whole bank, and the
report paths every campaign run writes.

A mutant runs in a child process of its own (``run_campaign`` re-runs itself there with
``ENGINEWIRE_TESTING_MUTANT`` set, and the child applies the bank's patches first, in itself
and, through the runtime's preload hook, in each engine it starts), so no patch ever reaches
the process that asked and a mutant that hangs or crashes its campaign costs one row: a child
past its bound, or one that exits without a verdict, is reported as such, never as detected.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MUTANT_ERROR", "MUTANT_TIMEOUT_S"]

# Per-mutant bound on the child campaign (it stops at the first failure).
MUTANT_TIMEOUT_S = 300.0
# A single ``mutant`` run whose child crashed has no verdict: neither 0 (not detected) nor 1.
MUTANT_ERROR = 3


def new_report_path(out_dir: Path, prefix: str) -> Path:
    """``<prefix>-<stamp>-<pid>.json``, created here (exclusively) so that concurrent runs,
    or two runs of one process in the same second, never write the same file."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for n in itertools.count(1):
        path = out_dir / (f"{prefix}-{stamp}.json" if n == 1 else f"{prefix}-{stamp}-{n}.json")
        try:
            with open(path, "x"):
                return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def run_mutant(name: str, kinds: list[str], *, examples: int, steps: int, seed: int | None,
               model: str, results_dir: Path, duration: float | None = None
               ) -> dict[str, Any]:
    """One campaign in a child process with the mutant switched on: one derandomized round
    of ``examples``, or with ``duration`` the seeded rounds of a duration run, each of its
    clients a share (as a campaign of that length runs), stopping at its first detection."""
    from . import mutants

    kind = mutants.BANK[name].kind
    wanted = [k for k in kinds if k in mutants.BANK[name].clients]
    if not wanted:
        return {"mutant": name, "kind": kind, "applicable": False, "detected": False,
                "examples": None, "seconds": None, "wall_s": None,
                "detail": f"no requested client can show it (needs {mutants.BANK[name].clients})"}
    if model == "null":  # a mutant the null model cannot show runs on the model it needs
        model = mutants.BANK[name].model
    report_path = results_dir / f".mutant-{name}-{os.getpid()}.json"
    report_path.unlink(missing_ok=True)
    env = dict(os.environ, **{mutants.ENV_VAR: name,
                              "_ENGINEWIRE_CAMPAIGN_REPORT": str(report_path)})
    args = {"client": wanted[0] if len(wanted) == 1 else "all", "examples": examples,
            "steps": steps, "seed": seed, "faults": True, "model": model,
            "results_dir": str(results_dir), "profile": "ci", "duration": duration}
    if kind == "elastic":  # shows only where engines join and leave (stateful_dp_elastic.py)
        args["elastic"] = True
    if wanted == ["fe"]:  # two front ends over one engine (stateful_fe.py)
        args["client"], args["front_ends"] = "all", 2
    code = ("import json, sys\n"
            "from enginewire.testing.campaign import run_campaign\n"
            f"sys.exit(run_campaign(**json.loads({json.dumps(json.dumps(args))})))\n")
    log = results_dir / f"mutant-{name}.log"
    start = time.monotonic()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=fh,
                                  stderr=subprocess.STDOUT,
                                  timeout=MUTANT_TIMEOUT_S + (duration or 0.0))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.monotonic() - start
    report: dict[str, Any] = {}
    if report_path.exists():
        report = json.loads(report_path.read_text())
        report_path.unlink()
    failing = [c for c in report.get("clients", []) if c.get("failure")]
    detected = rc == 1 and bool(failing)
    if rc is not None and not detected and (rc != 0 or not report):
        # The child crashed (an import error, a bug in the harness): no verdict either way.
        return {"mutant": name, "kind": kind, "applicable": True, "detected": False,
                "error": True, "examples": None, "seconds": None, "wall_s": round(seconds, 1),
                "detail": f"the campaign crashed (exit status {rc}): {_last_line(log)}; "
                          f"see {log}", "log": str(log)}
    if detected:
        first = failing[0]
        # Time to detection: from the child campaign's start, so the clients it ran first
        # (each to its end, having found nothing) count; not the interpreter's start.
        before = sum(float(c.get("seconds") or 0) for c in report["clients"][
            :report["clients"].index(first)])
        ff = first.get("first_failure") or [first["examples"], first.get("seconds") or 0]
        why = first["failure"]
        if first.get("flaky"):
            # A mutant on a shared standalone engine leaves it changed for Hypothesis' replay;
            # the failure is the error that failed the example, the flaky report follows.
            why = f"{why[:120]} (then {first['flaky'].split(':')[0]})"
        detail = f"{first['client']}: {why[:160]}"
        return {"mutant": name, "kind": kind, "applicable": True, "detected": True,
                "examples": ff[0], "seconds": round(before + float(ff[1]), 1),
                "wall_s": round(seconds, 1), "client": first["client"],
                "detail": detail, "log": str(log)}
    why = "timed out" if rc is None else f"exit status {rc}"
    return {"mutant": name, "kind": kind, "applicable": True, "detected": False,
            "examples": None, "seconds": None, "wall_s": round(seconds, 1),
            "detail": f"{why}; see {log}", "log": str(log)}


def _last_line(log: Path) -> str:
    """The child's last words (a traceback ends with the exception), for the one-line detail."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "no output"


def run_mutant_table(kinds: list[str], *, examples: int, steps: int, seed: int | None,
                     model: str, results_dir: Path, duration: float | None = None) -> int:
    from . import mutants

    rows = []
    for name in mutants.BANK:
        row = run_mutant(name, kinds, examples=examples, steps=steps, seed=seed, model=model,
                         results_dir=results_dir, duration=duration)
        rows.append(row)
        found = f" in {row['seconds']} s ({row['client']})" if row["detected"] else ""
        print(f"  {name:<44} {_verdict(row)}{found}", flush=True)
    # "seconds": from the child campaign's start to its first detection; "wall": the whole
    # child run, interpreter start, the failing example's end and the shutdown included.
    print(f"\n{'mutant':<44} {'class':<11} {'detected':<8} {'examples':>8} {'seconds':>8}"
          f" {'wall':>6}  client")
    for r in rows:
        print(f"{r['mutant']:<44} {r['kind']:<11} {_verdict(r):<8} "
              f"{'' if r['examples'] is None else r['examples']:>8} "
              f"{'' if r['seconds'] is None else r['seconds']:>8} "
              f"{'' if r['wall_s'] is None else r['wall_s']:>6}  {r.get('client', '')}")
    path = new_report_path(results_dir, "mutants")
    path.write_text(json.dumps(rows, indent=2))
    applicable = [r for r in rows if r["applicable"]]
    undetected = [r["mutant"] for r in applicable if not r["detected"]]
    errors = sum(1 for r in applicable if r.get("error"))
    skipped = len(rows) - len(applicable)
    print(f"{len(applicable) - len(undetected)}/{len(applicable)} mutants detected"
          + (f", {errors} crashed (ERROR: see their logs)" if errors else "")
          + (f" ({skipped} n/a: no requested client can show them)" if skipped else "")
          + f"; table: {path}")
    return 1 if undetected else 0


def _verdict(row: dict[str, Any]) -> str:
    if not row["applicable"]:
        return "n/a"
    return "yes" if row["detected"] else "ERROR" if row.get("error") else "NO"
