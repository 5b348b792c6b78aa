"""``enginewire bench --against-vllm DIR``: our clients beside vLLM's real ones, in one run.

DIR is the side-by-side benchmark kept in ``shared/bench-vllm`` (its README says what each
script measures): vLLM 0.33's unmodified ``SyncMPClient`` / ``AsyncMPClient`` attached to an
engine that speaks vLLM's wire, next to ours on our null engine, the two sides alternating
round by round (ABBA) so that the machine's noise hits both alike. This module only runs it:
it checks the folder and the vLLM interpreter before anything starts, points the folder's
round script at this interpreter (ours) and the vLLM one, optionally beside a fixed
background load (``--contended``), then prints the folder's summary of the per-round ratios.
vLLM is never imported here; it lives in its own environment (about 9 GB, not in CI).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from .._command import MissingError, UsageError

__all__ = ["against_vllm_command", "check_bench_dir", "find_vllm_python"]

ENV_PYTHON = "ENGINEWIRE_VLLM_PYTHON"
# The folder's own entry points, by name: a folder without them is not the benchmark.
_NEEDED = ("run_interleaved.sh", "summarize.py", "ew_bench.py", "vllm_bench.py")


def check_bench_dir(path: str) -> Path:
    """The benchmark folder, resolved; ``UsageError`` naming what is missing otherwise."""
    d = Path(path).expanduser().resolve()
    if not d.is_dir():
        raise UsageError(f"--against-vllm {path}: not a directory")
    missing = [n for n in _NEEDED if not (d / n).is_file()]
    if missing:
        raise UsageError(f"--against-vllm {path}: not the vLLM side-by-side benchmark (no "
                         f"{', '.join(missing)}; it is shared/bench-vllm)")
    return d


def find_vllm_python(given: str | None) -> str:
    """The vLLM environment's interpreter: ``given``, else $ENGINEWIRE_VLLM_PYTHON. It must
    import vllm (checked now, in a subprocess: a missing one is a ``MissingError``)."""
    py = given or os.environ.get(ENV_PYTHON)
    if not py:
        raise MissingError(f"--against-vllm needs the vLLM environment's python: --vllm-python"
                           f" PATH or ${ENV_PYTHON} (scripts/vllm_harness.sh sets one up)")
    exe = shutil.which(py) or py
    if not os.access(exe, os.X_OK):
        raise MissingError(f"--vllm-python {py}: not an executable")
    try:
        probe = subprocess.run([exe, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                               capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise MissingError(f"--vllm-python {py}: importing vllm took over 120 s") from exc
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise MissingError(f"--vllm-python {py}: cannot import vllm ({last})")
    return exe


def against_vllm_command(args: argparse.Namespace, contended: int | None) -> int:
    """Run the interleaved rounds and print the summary; the exit status of the rounds."""
    bench_dir = check_bench_dir(args.against_vllm)
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: must be at least 1")
    for flag, value in (("--only", args.only), ("--plot", args.plot), ("--json", args.json),
                        ("--quick", args.quick), ("--engines", args.engines is not None)):
        if value:
            raise UsageError(f"{flag} does not go with --against-vllm (its rounds measure"
                             " echo, delivery, compute share and admission, each side alike)")
    vllm_py = find_vllm_python(args.vllm_python)
    out = Path(args.out or f"results/against-vllm-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {out}: not writable")
    extra = ["--delivery-only", "--lean"] if args.lean else []
    with ExitStack() as stack:
        # The round script runs its benches as bench/<name>.py from its root: a private root
        # whose bench/ is the folder, so nothing is written into the folder itself.
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ew-vs-vllm-")))
        (root / "bench").symlink_to(bench_dir, target_is_directory=True)
        env = dict(os.environ, BENCH_ROOT=str(root), EW_PY=sys.executable, VL_PY=vllm_py)
        load = None
        if contended is not None:
            from .contention import BackgroundLoad

            load = stack.enter_context(BackgroundLoad(contended))
        print(f"bench --against-vllm: {args.rounds} interleaved rounds into {out}"
              + ("" if load is None else f", beside {load.n} spinning processes"), flush=True)
        rounds = subprocess.run(["bash", str(bench_dir / "run_interleaved.sh"), str(args.rounds),
                                 str(out), *extra], env=env, check=False)
    summary = subprocess.run([sys.executable, str(bench_dir / "summarize.py"), str(out),
                              "--md", str(out / "summary.md")], check=False)
    if load is not None:
        (out / "contended.txt").write_text(f"{load.describe()}\n")
    return rounds.returncode or summary.returncode
