"""A campaign's coverage measured against what the composed model reaches.

The spec declares more rows than any one model run fires; the fair denominator for "did the
campaign cover the protocol" is the set of transitions the exhaustive explorer reaches in the
composed model (``spec.explore``: one engine, or the two-engine model for ``--engines N``).
``enginewire campaign --model-coverage`` adds this comparison to the report; it costs one
exploration (tens of seconds), so it is not on by default.
"""

from __future__ import annotations

import time
from typing import Any

from ..spec import MACHINES

__all__ = ["compare_with_model", "model_reach"]


def model_reach(data_parallel: bool = False) -> tuple[frozenset[str], float]:
    """The transitions (named as a report names them) the composed model reaches, and the
    seconds the exploration took."""
    from ..spec.explore import explore, explore_dp

    t0 = time.perf_counter()
    res = explore_dp() if data_parallel else explore()
    names = set()
    for m in MACHINES:
        states, events = m.state_members(), m.event_members()
        for t in m.transitions:
            if (m.name, states.index(t.source), events.index(t.event), t.guard) in res.covered:
                names.add(f"{m.name} {t.source.name} -{t.event.name}-> {t.target.name}")
    return frozenset(names), time.perf_counter() - t0


def compare_with_model(coverage: dict[str, Any], *, data_parallel: bool | None = False
                       ) -> dict[str, Any]:
    """The report's ``composed_model`` section: how much of what the model reaches this run
    reached, each missed row with the reason the report gives it, and the rows the run
    reached beyond the model's bounds. ``data_parallel`` None: a run of one-engine and
    data-parallel clients (``--client all``), measured against what either model reaches
    (two explorations)."""
    if data_parallel is None:
        one, one_s = model_reach(False)
        two, two_s = model_reach(True)
        model, seconds, name = one | two, one_s + two_s, "one-engine and two-engine"
    else:
        model, seconds = model_reach(data_parallel)
        name = "two-engine" if data_parallel else "one-engine"
    reached = set(coverage["transition_counts"])
    why = {item["transition"]: item["why"] for item in coverage["never_reached"]}
    hit = model & reached
    return {
        "model": name,
        "reaches": len(model),
        "reached": len(hit),
        "percent": round(100 * len(hit) / len(model), 1) if model else 100.0,
        "missed": [{"transition": t, "why": why.get(t, "")} for t in sorted(model - reached)],
        "beyond_model": sorted(reached - model),
        "explore_s": round(seconds, 1),
    }
