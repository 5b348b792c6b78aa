"""Per-output against columnar callers (``columnar_outputs=True``, issue 31), A/B in one run:

    python -m enginewire.benchmarks.columnar [--contended [N]] [--reps R] [--ks 256,1024]

Two sync clients, each on its own null engine, run the same gated delivery rounds
(``ipc.ours_round``) in alternating order; prints per K the median tokens/s of each and the
median of the per-round ratios columnar / per-output with their range. ``--contended`` runs
beside N CPU-bound processes (default 2), as ``enginewire bench --contended`` does.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from contextlib import ExitStack
from typing import Any

from .contention import BackgroundLoad
from .floor import freeze_heap
from .ipc import null_config, ours_round, random_prompts


def ab_rounds(ks: tuple[int, ...], reps: int, contended: int | None) -> list[dict[str, Any]]:
    """One row per K: ``per_output`` and ``columnar`` tokens/s medians, ``ratio`` median and
    ``ratio_range``; the clients and any background load are gone when it returns."""
    from ..runtime.factory import make_client

    rows = []
    with ExitStack() as stack:
        config = null_config(max(ks))
        plain = make_client(config, multiprocess=True, asyncio=False)
        stack.callback(plain.shutdown)
        columnar = make_client(config, multiprocess=True, asyncio=False, columnar_outputs=True)
        stack.callback(columnar.shutdown)
        freeze_heap()
        if contended is not None:
            stack.enter_context(BackgroundLoad(contended))
        for k in ks:
            prompts = random_prompts(k, k)
            for c in (plain, columnar):  # warm-up
                ours_round(c, k, prompts, f"w{k}-{id(c)}")
            got: dict[int, list[float]] = {id(plain): [], id(columnar): []}
            for i in range(reps):
                for c in (plain, columnar) if i % 2 == 0 else (columnar, plain):
                    got[id(c)].append(ours_round(c, k, prompts, f"r{k}-{i}-{id(c)}")["tok_s"])
                gc.collect()  # between rounds, never inside a window
            a, b = got[id(plain)], got[id(columnar)]
            ratios = [y / x for x, y in zip(a, b, strict=True)]
            rows.append({"k": k, "per_output": statistics.median(a),
                         "columnar": statistics.median(b), "ratio": statistics.median(ratios),
                         "ratio_range": (min(ratios), max(ratios)), "reps": reps,
                         "contended": contended})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m enginewire.benchmarks.columnar",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--contended", nargs="?", type=int, const=2, default=None, metavar="N")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--ks", default="256,1024")
    args = p.parse_args(argv)
    try:
        ks = tuple(int(x) for x in args.ks.split(","))
    except ValueError:
        p.error(f"--ks {args.ks!r}: comma-separated integers")
    if args.reps < 1 or not ks or min(ks) < 1:
        p.error("--reps and every K must be at least 1")
    for r in ab_rounds(ks, args.reps, args.contended):
        lo, hi = r["ratio_range"]
        print(f"K={r['k']}: per-output {r['per_output'] / 1e3:.0f}k tok/s, columnar"
              f" {r['columnar'] / 1e3:.0f}k tok/s, columnar/per-output {r['ratio']:.2f}"
              f" [{lo:.2f}-{hi:.2f}] over {r['reps']} rounds"
              + (f", beside {r['contended']} spinning processes" if r["contended"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
