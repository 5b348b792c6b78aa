"""``enginewire bench``: every measurement next to its floor, in one invocation.

Absolute times on a shared 2-vCPU guest move by +-30 % between runs (perf-floor.md), so the
verdicts are on ratios taken in this run; the two exceptions the issue sets as absolute
(non-compute share, µs per spec transition) are themselves shares or per-operation costs.
Tests never assert any of these figures; they only check the shape of the result.
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import platform
import sys
import time
from contextlib import ExitStack
from typing import Any

from .._command import MissingError, Parser, UsageError, require, run_handler, writable_file

__all__ = ["DP_ENGINES", "FRONT_ENDS", "SECTIONS", "TARGETS", "add_arguments", "bench_command",
           "collect", "main", "run_bench"]

SECTIONS = ("echo", "delivery", "compute", "codec", "spec", "inproc", "engine", "model", "dp",
            "frontends", "monitor")

# key -> (op, bar, goal, judged on "ratio" or "value"); issue 10's target table.
TARGETS: dict[str, tuple[str, float, float, str]] = {
    "echo_sync_p50": ("<=", 1.5, 1.2, "ratio"),
    "echo_async_p50": ("<=", 2.0, 1.5, "ratio"),
    "delivery_sync_256": (">=", 0.6, 0.85, "ratio"),
    "delivery_sync_1024": (">=", 0.6, 0.85, "ratio"),
    "compute_share_256": ("<=", 15.0, 5.0, "value"),
    "compute_share_1024": ("<=", 30.0, 12.0, "value"),
    "codec_256": ("<=", 1.3, 1.1, "ratio"),
    "spec_transition_us": ("<=", 1.0, 0.3, "value"),
    # Issue 29: two engines deliver 1.8x one engine's tokens/s on compute-bound steps.
    "dp_scaling_2": (">=", 1.8, 1.9, "ratio"),
    # Issue 47: two front-end processes deliver 1.8x one front end's tokens/s at K=1024.
    "frontends_scaling_1024": (">=", 1.8, 1.9, "ratio"),
    # Issue 48: through the monitor, a round trip at most 1.5x and tokens/s at least 0.7x
    # direct, so a staging deployment can leave it on (the issue sets no goal beyond).
    "monitor_echo_p50": ("<=", 1.5, 1.5, "ratio"),
    "monitor_delivery_256": (">=", 0.7, 0.7, "ratio"),
    "monitor_delivery_1024": (">=", 0.7, 0.7, "ratio"),
}
# Shown with a verdict but not counted in the exit status: targets owned by other issues.
_INFO_TARGETS: dict[str, tuple[str, float, float, str]] = {
    "engine_us_per_request": ("<=", 3.0, 3.0, "value"),
}


def _params(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "echo": (5000, 500, 300),
            "ks": (256, 1024),
            "reps": 3,
            "async_ks": (),
            "inproc_reps": 3,
        }
    return {
        "echo": (20000, 1000, 1000),
        "ks": (256, 1024),
        "reps": 7,
        "async_ks": (256, 1024),
        "inproc_reps": 7,
    }


def _machine() -> dict[str, Any]:
    import msgspec
    import zmq

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": msgspec.__version__,
    }


def _codec_rows(quick: bool) -> list[dict[str, Any]]:
    from .codec import run_codec_bench

    rows = []
    for r in run_codec_bench(quick):
        row = {
            "section": "codec",
            "name": f"{r['name']} / msgspec",
            "unit": "µs",
            "ours": r["ours_us"],
            "ours_spread": None,
            "floor": r["baseline_us"],
            "floor_spread": None,
            "ratio": r["ratio"],
        }
        if "outputs256 " in r["name"]:
            row["key"] = "codec_256"
        rows.append(row)
    return rows


def _engine_rows(quick: bool) -> list[dict[str, Any]]:
    from .engine_step import run_engine_bench

    rows = []
    for r in run_engine_bench(quick):
        if r.get("bench") == "engine_overhead":
            rows.append(
                {
                    "section": "engine",
                    "name": "engine µs per request, null, batch 256",
                    "unit": "µs",
                    "ours": r["us_per_request_at_256"],
                    "ours_spread": [r["us_per_request_at_256_min"], r["us_per_request_at_256"]],
                    "floor": None,
                    "floor_spread": None,
                    "ratio": None,
                    "key": "engine_us_per_request",
                    "judge": "value",
                    "slope_us": r["us_per_request_slope"],
                }
            )
        else:
            rows.append(
                {
                    "section": "engine",
                    "name": f"engine step {r['model']} batch {r['batch']}",
                    "unit": "µs",
                    "ours": r["step_us"],
                    "ours_spread": [r["step_us_min"], r["step_us"]],
                    "floor": None,
                    "floor_spread": None,
                    "ratio": None,
                    "tokens_per_s": r["tokens_per_s"],
                }
            )
    return rows


def _model_missing() -> str | None:
    """Why the model section cannot run here (its weights are not installed), or None."""
    from ..runtime.gguf_loader import find_smollm2

    try:
        find_smollm2()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def _model_rows(quick: bool) -> list[dict[str, Any]]:
    from .smollm2 import run_smollm2_bench

    missing = _model_missing()
    if missing is not None:  # a full run goes on without it, but says so
        print(f"bench: the model section is skipped: {missing}", file=sys.stderr)
        return []
    return [
        {
            "section": "model",
            "name": r["name"] + " tokens/s",
            "unit": "tok/s",
            "ours": r["tokens_per_s"],
            "ours_spread": [r["tokens_per_s"], r["tokens_per_s"]],
            "floor": None,
            "floor_spread": None,
            "ratio": None,
        }
        for r in run_smollm2_bench(quick)
    ]


DP_ENGINES = 2  # the dp section's engines when none are named: the full run's, as issue 29's bar
FRONT_ENDS = 2  # the frontends section's front ends when none are named (issue 47's bar)


def _count(v: object, lo: int) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= lo


def _selection(only: list[str] | None, engines: int, front_ends: int = FRONT_ENDS,
               front_end_engines: int = 1) -> set[str]:
    """The sections ``only`` selects (all when None), each one's arguments checked before
    anything is measured: a section refusing them at its turn would lose the run before it
    (the dp section once refused the CLI's default ``--engines 1`` after 13 s of measuring)."""
    sel = set(SECTIONS if not only else only)
    unknown = sel - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown benchmark sections {sorted(unknown)}; known: {SECTIONS}")
    if "dp" in sel and not _count(engines, 2):
        raise ValueError(f"engines={engines!r}: the dp section compares N >= 2 engines with one")
    if "frontends" in sel and not _count(front_ends, 2):
        raise ValueError(f"front_ends={front_ends!r}: the frontends section compares K >= 2"
                         " front ends with one")
    if "frontends" in sel and not _count(front_end_engines, 1):
        raise ValueError(f"front_end_engines={front_end_engines!r}: the frontends section"
                         " needs at least one engine")
    return sel


def collect(quick: bool, only: list[str] | None = None, engines: int = DP_ENGINES,
            front_ends: int = FRONT_ENDS, front_end_engines: int = 1
            ) -> list[dict[str, Any]]:
    """Run the selected sections; return their rows, not yet judged. ``engines``: the dp
    section's (ValueError below 2, before anything runs); ``front_ends`` and
    ``front_end_engines``: the frontends section's (below 2 and below 1: ValueError)."""
    from .floor import freeze_heap
    from .ipc import (
        bench_async,
        bench_compute,
        bench_delivery,
        bench_echo,
        bench_inproc,
        bench_spec,
        null_config,
        peers,
    )

    sel = _selection(only, engines, front_ends, front_end_engines)
    p = _params(quick)
    ks: tuple[int, ...] = p["ks"]
    k_max = max(ks)
    rows: list[dict[str, Any]] = []
    was_frozen = gc.get_freeze_count()
    try:
        if sel & {"echo", "delivery", "compute"}:
            from ..runtime.factory import make_client

            kinds = (["raw_echo"] if "echo" in sel else []) + ["pipeline"]
            with ExitStack() as stack:
                floor = stack.enter_context(peers(*kinds))
                sync = None
                if sel & {"echo", "delivery"}:
                    sync = make_client(null_config(k_max), multiprocess=True, asyncio=False)
                    stack.callback(sync.shutdown)
                comp = None
                if "compute" in sel:
                    comp = make_client(null_config(k_max, 0.005), multiprocess=True, asyncio=False)
                    stack.callback(comp.shutdown)
                columnar = None
                if "delivery" in sel:
                    # The opt-in columnar view (issue 31): the same engine and rounds, read by
                    # columns; no bar (the floor's caller walks one struct per token).
                    columnar = make_client(null_config(k_max), multiprocess=True, asyncio=False,
                                           columnar_outputs=True)
                    stack.callback(columnar.shutdown)
                freeze_heap()  # after start-up, as vLLM does; the peers freeze their own
                if "echo" in sel:
                    rows += bench_echo(sync, floor, *p["echo"])
                if "delivery" in sel:
                    rows += bench_delivery(sync, floor["pipeline"], ks, p["reps"])
                    rows += bench_delivery(columnar, floor["pipeline"], ks, p["reps"],
                                           label="sync_columnar")
                if "echo" in sel or ("delivery" in sel and p["async_ks"]):
                    rows += bench_async(
                        null_config(k_max),
                        floor.get("raw_echo"),
                        floor["pipeline"] if "delivery" in sel and p["async_ks"] else None,
                        p["echo"] if "echo" in sel else None,
                        p["async_ks"],
                        p["reps"],
                    )
                if "compute" in sel:
                    rows += bench_compute(comp, floor["pipeline"], ks, p["reps"])
        if "codec" in sel:
            rows += _codec_rows(quick)
        if "spec" in sel:
            step = next(
                (r["ours_step_us"] for r in rows if r.get("key") == "delivery_sync_256"), None
            )
            rows += bench_spec(step, quick)
        if "inproc" in sel:
            rows += bench_inproc(256, p["inproc_reps"])
        if "engine" in sel:
            rows += _engine_rows(quick)
        if "model" in sel and not quick:  # real-model compute: minutes on a CPU, full run only
            rows += _model_rows(quick)
        elif "model" in sel and only:  # asked for by name: say why it is missing
            print("bench: the model section runs in the full run only (not with --quick)",
                  file=sys.stderr)
        if "dp" in sel:
            from .dp import bench_dp

            rows += bench_dp(engines, quick)
        if "frontends" in sel:
            from .front_ends import bench_front_ends

            rows += bench_front_ends(front_ends, front_end_engines, ks=ks, reps=p["reps"],
                                     echo=p["echo"][:2])
        if "monitor" in sel:
            from .monitor import bench_monitor

            rows += bench_monitor(ks=ks, reps=p["reps"], echo=p["echo"][:2])
    finally:
        if not was_frozen:
            gc.unfreeze()
    return rows


def judge(rows: list[dict[str, Any]]) -> bool:
    """Attach bar/goal/pass to rows with a target; True if every counted bar is met."""
    ok = True
    for row in rows:
        key = row.get("key")
        target = TARGETS.get(key or "") or _INFO_TARGETS.get(key or "")
        if target is None:
            row.setdefault("pass", None)
            continue
        op, bar, goal, on = target
        x = row["ratio"] if on == "ratio" else row["ours"]
        meets = operator.le if op == "<=" else operator.ge
        row.update(
            op=op,
            bar=bar,
            goal=goal,
            judged_on=on,
            counted=key in TARGETS,
            meets_goal=bool(meets(x, goal)),
        )
        row["pass"] = bool(x is not None and x == x and meets(x, bar))
        if key in TARGETS and not row["pass"]:
            ok = False
    return ok


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 10000:
        return f"{x / 1000:.0f}k"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _cell(v: float | None, spread: list[float] | None) -> str:
    if v is None:
        return "-"
    if not spread:
        return _fmt(v)
    return f"{_fmt(v)} [{_fmt(spread[0])}, {_fmt(spread[1])}]"


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col, just in (
        ("section", "left"),
        ("measurement", "left"),
        ("unit", "left"),
        ("ours median [min, max]", "right"),
        ("floor median [min, max]", "right"),
        ("ratio", "right"),
        ("bar", "right"),
        ("goal", "right"),
        ("pass", "center"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        bar = f"{r['op']} {_fmt(r['bar'])}" if "bar" in r else ""
        goal = f"{r['op']} {_fmt(r['goal'])}" if "goal" in r else ""
        if r.get("judged_on") == "value":
            bar, goal = f"{bar} {r['unit']}", f"{goal} {r['unit']}"
        verdict = {True: "[green]PASS[/]", False: "[red]FAIL[/]", None: ""}[r.get("pass")]
        if r.get("pass") is not None and not r.get("counted", True):
            verdict += " (info)"
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        t.add_row(
            r["section"],
            r["name"],
            r["unit"],
            _cell(r["ours"], r.get("ours_spread")),
            _cell(r.get("floor"), r.get("floor_spread")),
            ratio,
            bar,
            goal,
            verdict,
        )
    console = Console()
    # Piped output defaults to 80 columns, which folds every row; the table needs ~150.
    Console(width=max(console.width, 150)).print(t)


def plot(rows: list[dict[str, Any]], path: str, machine: dict[str, Any]) -> None:
    """Each judged row as a fraction of its bar (<= 1 passes), with the goal marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judged = [r for r in rows if "bar" in r]
    names, frac, goals = [], [], []
    for r in judged:
        x = r["ratio"] if r["judged_on"] == "ratio" else r["ours"]
        if r["op"] == "<=":
            frac.append(x / r["bar"])
            goals.append(r["goal"] / r["bar"])
        else:
            frac.append(r["bar"] / x if x else float("inf"))
            goals.append(r["bar"] / r["goal"])
        names.append(r["name"])
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.6))
    ys = list(range(len(names)))[::-1]
    colors = ["tab:green" if f <= 1 else "tab:red" for f in frac]
    ax.barh(ys, frac, color=colors)
    ax.scatter(goals, ys, marker="|", s=300, color="black", label="goal", zorder=3)
    ax.axvline(1.0, color="gray", linestyle="--", label="bar")
    ax.set_yticks(ys, names, fontsize=8)
    ax.set_xlabel("measured / bar (<= 1 meets the bar)")
    ax.set_title(
        f"enginewire bench vs same-run floor — {machine['cpus']} CPU, {machine['cpu'][:40]}",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _check_output(path: str) -> None:
    """``path`` names a file this process can write: its directory exists and is writable."""
    f = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(f)
    if os.path.isdir(f):
        raise ValueError(f"{path}: is a directory, expected a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{path}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(f)
                                                     and not os.access(f, os.W_OK)):
        raise ValueError(f"{path}: not writable")


def run_bench(
    quick: bool = False,
    json_out: str | None = None,
    plot_out: str | None = None,
    only: list[str] | None = None,
    engines: int = DP_ENGINES,
    contended: int | None = None,
    front_ends: int = FRONT_ENDS,
    front_end_engines: int = 1,
) -> int:
    """Run, print the table, write JSON/PNG if asked; 1 if a bar of issue 10 is missed.

    ``contended=N`` runs every selected measurement, ours and its floor alike, beside N
    CPU-bound processes (``benchmarks/contention.py``) that live for the whole run.

    The output paths (and matplotlib, for a plot) are checked before anything runs: ValueError
    for a path that cannot be written, ImportError without matplotlib, FileNotFoundError when
    ``only`` names the model section and the SmolLM2 weights are not installed, ValueError
    for an unknown section, fewer than 2 ``engines`` for the dp section or fewer than 2
    ``front_ends`` (or 1 ``front_end_engines``) for the frontends section."""
    _selection(only, engines, front_ends, front_end_engines)
    for path in (json_out, plot_out):
        if path:
            _check_output(path)
    if plot_out:
        import matplotlib  # noqa: F401  (raises ImportError now, not after the run)
    if only and "model" in only and not quick:  # asked for by name: refuse, not skip
        missing = _model_missing()
        if missing is not None:
            raise FileNotFoundError(f"the model section: {missing}")
    t0 = time.perf_counter()
    machine = _machine()
    load = None
    if contended is not None:
        from .contention import BackgroundLoad

        with BackgroundLoad(contended) as load:
            rows = collect(quick, only, engines, front_ends, front_end_engines)
        machine["contended"] = load.describe()
    else:
        rows = collect(quick, only, engines, front_ends, front_end_engines)
    ok = judge(rows)
    elapsed = time.perf_counter() - t0
    mode = "quick" if quick else "full"
    beside = "" if load is None else f", beside {load.n} spinning processes"
    print_table(
        rows,
        f"enginewire bench ({mode}, {elapsed:.0f} s, "
        f"load {machine['loadavg_at_start'][0]:.1f} at start{beside})",
    )
    if json_out:
        with open(json_out, "w") as f:
            json.dump(
                {
                    "quick": quick,
                    "contended": contended,
                    "elapsed_s": elapsed,
                    "machine": machine,
                    "all_bars_met": ok,
                    "rows": rows,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                f,
                indent=1,
                default=float,
            )
    if plot_out:
        plot(rows, plot_out, machine)
    missed = [r["name"] for r in rows if r.get("counted") and not r["pass"]]
    if missed:
        print(f"bars missed: {len(missed)}: " + "; ".join(missed), file=sys.stderr)
    return 0 if ok else 1


# --- the command: `enginewire bench` and `python -m enginewire.benchmarks.run` ---------------

HELP = "measure IPC cost against a raw pyzmq floor measured in the same run"
DESCRIPTION = ("Run every measurement next to its floor in one invocation and print medians,"
               " spreads and ratios with the target bars; exits 1 if a bar is missed.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options, on the CLI's ``bench`` subcommand and on ``main``'s parser
    (one definition, so the two cannot drift apart)."""
    parser.add_argument("--quick", action="store_true", help="small counts (under 2 minutes)")
    parser.add_argument("--json", metavar="PATH", help="write every row as JSON to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot of the ratios to PATH")
    parser.add_argument("--only", metavar="SECTIONS",
                        help="comma-separated subset of: " + ", ".join(SECTIONS))
    parser.add_argument(
        "--engines", type=int, metavar="N",
        help="data parallel: N >= 2 engines' tokens/s over one engine's on compute-bound steps,"
        " and the routing cost per request (alone: the dp section only; the full and quick"
        f" runs' dp section uses {DP_ENGINES}); with --front-ends K: N >= 1 engines, each"
        " serving all K front ends")
    parser.add_argument(
        "--front-ends", type=int, metavar="K",
        help="several front ends: K >= 2 front-end processes attached to the same engine(s)"
        " (with --engines N: N engines, each serving all K), their aggregate tokens/s over one"
        " front end's, and one front end's round trip with the others idle and busy (alone:"
        f" the frontends section only; the full and quick runs' uses {FRONT_ENDS} over one"
        " engine)")
    parser.add_argument(
        "--contended", type=int, nargs="?", const=0, default=None, metavar="N",
        help="run beside N CPU-bound processes (default: one per core), as a serving host's"
        " tokenizers and workers contend for the cores; ours and the floors alike")
    parser.add_argument(
        "--against-vllm", metavar="DIR",
        help="instead: run the side-by-side comparison with vLLM's real clients kept in DIR"
        " (shared/bench-vllm), in interleaved rounds; needs a Python with vLLM installed"
        " (--vllm-python, or $ENGINEWIRE_VLLM_PYTHON)")
    parser.add_argument("--rounds", type=int, default=5, metavar="N",
                        help="--against-vllm: interleaved rounds (default 5)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="--against-vllm: the interpreter of the vLLM environment")
    parser.add_argument("--out", metavar="DIR",
                        help="--against-vllm: where the rounds' JSON, logs and summary go"
                        " (default: a new folder under results/)")
    parser.add_argument("--lean", action="store_true",
                        help="--against-vllm: delivery only, against vLLM's lean toy engine")


def bench_command(args: argparse.Namespace) -> int:
    """The command's handler: the arguments checked up front (a bad one is a ``UsageError``,
    a missing package or the model's weights a ``MissingError``), then ``run_bench``."""
    if args.contended is not None and args.contended < 0:
        raise UsageError(f"--contended {args.contended}: give a number of processes >= 1,"
                         " or none for one per core")
    contended = None
    if args.contended is not None:
        from .contention import default_procs

        contended = args.contended or default_procs()
    if args.against_vllm is not None:
        from .against_vllm import against_vllm_command

        return against_vllm_command(args, contended)
    for flag, value in (("--rounds", args.rounds != 5), ("--vllm-python", args.vllm_python),
                        ("--out", args.out), ("--lean", args.lean)):
        if value:
            raise UsageError(f"{flag} goes with --against-vllm DIR")
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    unknown = sorted(set(only or ()) - set(SECTIONS))
    if unknown:
        raise UsageError(f"--only: unknown section(s) {', '.join(unknown)}; choose from "
                         + ", ".join(SECTIONS))
    if args.json:
        writable_file("--json", args.json)
    if args.plot:
        writable_file("--plot", args.plot)
        require("matplotlib", "--plot")
    if only and "model" in only and not args.quick:
        missing = _model_missing()
        if missing is not None:
            raise MissingError(f"--only model: {missing}")
    engines, front_ends, fe_engines = DP_ENGINES, FRONT_ENDS, 1
    if args.front_ends is not None:
        if args.front_ends < 2:
            raise UsageError(f"--front-ends {args.front_ends}: the frontends section compares"
                             " K front ends with one; give K >= 2")
        front_ends = args.front_ends
    if args.engines is not None:
        # With --front-ends (and no dp section asked for), N engines serve the front ends,
        # and one engine is a valid N; the dp section compares N >= 2 with one.
        dp = args.front_ends is None or bool(only and "dp" in only)
        if args.engines < (2 if dp else 1):
            raise UsageError(f"--engines {args.engines}: the dp section compares N engines with"
                             " one; give N >= 2" if dp else
                             f"--engines {args.engines}: give N >= 1 engines")
        engines = fe_engines = args.engines
    if not only and args.front_ends is not None:
        only = ["frontends"]  # --front-ends K alone: its rows, over --engines N if given
    elif not only and args.engines is not None:
        only = ["dp"]  # --engines N alone: the data-parallel rows, with N engines
    return int(run_bench(quick=args.quick, json_out=args.json, plot_out=args.plot, only=only,
                         engines=engines, contended=contended, front_ends=front_ends,
                         front_end_engines=fe_engines))


def main(argv: list[str] | None = None) -> int:
    """``python -m enginewire.benchmarks.run [ARGS]``: exactly ``enginewire bench [ARGS]``, the
    same options, up-front checks and exit codes (cli.py builds its subcommand from these)."""
    parser = Parser(prog="enginewire bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_handler(bench_command, args, parser.prog)

if __name__ == "__main__":
    sys.exit(main())
