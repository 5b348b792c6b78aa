"""Data parallel (``enginewire bench --engines N``): scaling and the routing cost.

*Scaling*: the same workload (requests of ``TOKENS`` tokens each, ``SEQS`` per engine at a
time) on one engine and on N, with a per-step compute delay (the null model's
``null_step_delay_s``) so that steps, not the wire, bound the rate; the ratio is N engines'
tokens/s over one engine's, both measured in this run. Two engines must reach 1.8x.

*Routing cost*: microseconds per ``add_request`` on the N-engine client against the
one-engine client, both sending to idle engines that answer each request with one token:
what choosing an engine and keeping its load figures costs per request.

*Elastic scaling* (``scale``): seconds from ``scale(N + 1)`` to the joiner serving, against
starting a one-engine client in the same run (what a joiner costs beyond an engine's start);
seconds to drain one engine out of an idle set, against shutting a one-engine client down;
and the tokens/s of a steady stream while one engine joins and one leaves, over the same
stream's rate with no scale (a ratio near 1: serving holds while the set changes).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..protocol.messages import EngineCoreRequest, SamplingParams
from ..runtime.config import EngineConfig
from ..runtime.factory import make_client

__all__ = ["bench_dp"]

SEQS = 8  # requests one engine steps at a time
TOKENS = 24
STEP_DELAY_S = 0.02  # per step: compute-bound at SEQS tokens per step


def _config(engines: int, delay_s: float, seqs: int) -> EngineConfig:
    return EngineConfig(model="null", device="cpu", max_num_seqs=seqs, max_model_len=128,
                        null_step_delay_s=delay_s, data_parallel_size=engines)


def _drain(client: Any, rids: set[str], bound_s: float = 300.0) -> None:
    left = set(rids)
    deadline = time.monotonic() + bound_s
    while left:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(left)} request(s) unfinished after {bound_s:g} s")
        for o in client.get_output(timeout=1.0).outputs:
            if o.finish_reason is not None:
                left.discard(o.request_id)


def _tokens_per_s(engines: int, requests: int, reps: int) -> list[float]:
    client: Any = make_client(_config(engines, STEP_DELAY_S, SEQS), multiprocess=True,
                              asyncio=False)
    rates = []
    try:
        for rep in range(reps):
            rids = {f"s{rep}-{i}" for i in range(requests)}
            t0 = time.perf_counter()
            for rid in sorted(rids):
                client.add_request(EngineCoreRequest(
                    rid, [1, 2, 3], SamplingParams(max_tokens=TOKENS, ignore_eos=True)))
            _drain(client, rids)
            rates.append(requests * TOKENS / (time.perf_counter() - t0))
    finally:
        client.shutdown()
    return rates


def _us_per_add(engines: int, n: int, reps: int) -> list[float]:
    client: Any = make_client(_config(engines, 0.0, 256), multiprocess=True, asyncio=False)
    costs = []
    try:
        for rep in range(reps):
            reqs = [EngineCoreRequest(f"r{rep}-{i}", [1, 2, 3], SamplingParams(max_tokens=1))
                    for i in range(n)]
            t0 = time.perf_counter()
            for r in reqs:
                client.add_request(r)
            costs.append((time.perf_counter() - t0) / n * 1e6)
            _drain(client, {r.request_id for r in reqs})
    finally:
        client.shutdown()
    return costs


def _scale_times(engines: int, reps: int) -> tuple[list[float], list[float], list[float],
                                                   list[float]]:
    """Seconds to scale up by one and to drain one out, and their floors: a one-engine
    client's start and shutdown."""
    up, out, start, stop = [], [], [], []
    cfg = _config(engines, 0.0, SEQS)
    for _ in range(reps):
        t0 = time.perf_counter()
        one: Any = make_client(_config(1, 0.0, SEQS), multiprocess=True, asyncio=False)
        start.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        one.shutdown()
        stop.append(time.perf_counter() - t0)
        client: Any = make_client(cfg, multiprocess=True, asyncio=False)
        try:
            t0 = time.perf_counter()
            client.scale(engines + 1)
            up.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.scale(engines)
            out.append(time.perf_counter() - t0)
        finally:
            client.shutdown()
    return up, start, out, stop


def _tokens_while_scaling(engines: int, requests: int, reps: int) -> tuple[list[float],
                                                                           list[float]]:
    """Tokens/s of one stream with a scale up and a scale down (drained) in its middle, and
    of the same stream without."""
    steady: list[float] = []
    scaling: list[float] = []
    client: Any = make_client(_config(engines, STEP_DELAY_S, SEQS), multiprocess=True,
                              asyncio=False)
    try:
        for rep in range(2 * reps):
            with_scale = rep % 2 == 1
            rids = {f"e{rep}-{i}" for i in range(requests)}
            t0 = time.perf_counter()
            for rid in sorted(rids):
                client.add_request(EngineCoreRequest(
                    rid, [1, 2, 3], SamplingParams(max_tokens=TOKENS, ignore_eos=True)))
            if with_scale:
                client.scale(engines + 1)
                client.scale(engines)  # the joiner leaves again, drained
            _drain(client, rids)
            (scaling if with_scale else steady).append(
                requests * TOKENS / (time.perf_counter() - t0))
    finally:
        client.shutdown()
    return scaling, steady


def bench_dp(engines: int = 2, quick: bool = False, *, reps: int | None = None,
             rounds: int | None = None, n_adds: int | None = None) -> list[dict[str, Any]]:
    """The two rows: N engines' tokens/s over one's, and µs per routed ADD over one's.
    ``rounds`` is how many times each engine's batch is filled per repetition."""
    if engines < 2:
        raise ValueError(f"engines={engines}: data-parallel rows need at least 2")
    reps = reps or (2 if quick else 4)
    requests = SEQS * engines * (rounds or (2 if quick else 4))
    one = _tokens_per_s(1, requests, reps)
    many = _tokens_per_s(engines, requests, reps)
    n_adds = n_adds or (500 if quick else 2000)
    add_one = _us_per_add(1, n_adds, reps)
    add_many = _us_per_add(engines, n_adds, reps)
    rows = []
    ours, floor = statistics.median(many), statistics.median(one)
    rows.append({
        "section": "dp",
        "name": f"tokens/s, {engines} engines over 1 ({STEP_DELAY_S * 1000:g} ms steps)",
        "unit": "tok/s", "ours": ours, "ours_spread": [min(many), max(many)],
        "floor": floor, "floor_spread": [min(one), max(one)],
        # Here the ratio is a speed-up (higher is better); judged on the value below.
        "ratio": ours / floor, "key": f"dp_scaling_{engines}" if engines == 2 else None,
        "speedup": ours / floor,
    })
    ours, floor = statistics.median(add_many), statistics.median(add_one)
    rows.append({
        "section": "dp",
        "name": f"µs per add_request, {engines} engines over 1",
        "unit": "µs", "ours": ours, "ours_spread": [min(add_many), max(add_many)],
        "floor": floor, "floor_spread": [min(add_one), max(add_one)],
        "ratio": ours / floor, "routing_us": ours - floor,
    })
    scale_reps = 1 if quick or reps == 1 else 2
    up, start, out, stop = _scale_times(engines, scale_reps)
    for name, ours_s, floor_s, what in (
            ("scale-up by one engine to serving", up, start, "one engine's start"),
            ("drain one idle engine out", out, stop, "one engine's shutdown")):
        ours, floor = statistics.median(ours_s), statistics.median(floor_s)
        rows.append({
            "section": "dp", "name": f"s, {name}, {engines} engines (floor: {what})",
            "unit": "s", "ours": ours, "ours_spread": [min(ours_s), max(ours_s)],
            "floor": floor, "floor_spread": [min(floor_s), max(floor_s)],
            "ratio": ours / floor,
        })
    scaling, steady = _tokens_while_scaling(engines, SEQS * engines * 2, scale_reps)
    ours, floor = statistics.median(scaling), statistics.median(steady)
    rows.append({
        "section": "dp", "name": f"tokens/s while one engine joins and one leaves, {engines}"
        " engines (floor: the same stream, no scale)",
        "unit": "tok/s", "ours": ours, "ours_spread": [min(scaling), max(scaling)],
        "floor": floor, "floor_spread": [min(steady), max(steady)],
        "ratio": ours / floor, "speedup": ours / floor,
    })
    return rows
