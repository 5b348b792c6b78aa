"""The fault matrix's data-parallel cells: a fault on one engine of two while the other serves.

Theory of operation
-------------------
A cell opens a data-parallel client over ``engines`` engine cores with the fault planted in
the last one only (``engine_fault={index: plan}``), pins one request to each engine, and lets
the fault fire. What the spec requires (spec/membership.py) is the same for every way one
engine can go (a kill, an exit, a raise in its loop, a stop that only the heartbeat deadline
reveals, frames corrupted on its channel): *one down* (``Outcome.ONE_DOWN``) means

* the faulty engine's request ends with an ERROR output, within ``DEATH_BOUND_S`` of the
  fault (its record file says when it fired) or of the first corrupted frame;
* the other engine's request ends with the clean run's tokens;
* the client is not dead: ``dead_engines`` names exactly the faulty engine, and a new
  request is served by an engine that is left;
* a utility call that was pending on the faulty engine raises ``EngineDeadError`` naming it;
* nothing leaks once the client is shut down.

Anything else is the outcome the single-engine matrix would name (a hang, a dead client, a
wrong token), and the cell fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ..protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from ..runtime.faults import Fault, FaultAction, FaultPlan, FaultPoint
from ..spec.errors import EngineDeadError
from . import _cells as cells
from . import fault_matrix as fm
from ._cells import Outcome
from ._dp_cells import cell_options, interpose
from ._harness import ResourceSnapshot, left_behind
from .bounds import DEATH_BOUND_S

__all__ = ["DPCell", "dp_cells", "run_dp_fault_matrix"]


@dataclass
class DPCell:
    """One cell: ``client`` kind, and a fault (``fault``) or a frame rule (``rule``) on the
    last engine of ``engines``."""

    client: str
    config: Any
    fault: Fault | None = None
    rule: Any = None  # interposer.FrameRule, on the last engine's channel
    engines: int = 2

    def __post_init__(self) -> None:
        if self.client not in ("sync", "async"):
            raise ValueError(f"DPCell.client={self.client!r}: must be 'sync' or 'async'")
        if (self.fault is None) == (self.rule is None):
            raise ValueError("DPCell: give exactly one of fault= and rule=")
        if self.fault is not None and not isinstance(self.fault, Fault):
            raise TypeError(f"DPCell.fault={self.fault!r}: must be a Fault")
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or not (
                2 <= self.engines <= 16):
            raise ValueError(f"DPCell.engines={self.engines!r}: must be an integer in [2, 16]")

    @property
    def name(self) -> str:
        what = (f"frames/{self.rule.direction}:{self.rule.kind}:{self.rule.action}"
                if self.rule is not None else str(self.fault))
        return f"{self.client}/dp{self.engines}/engine {self.engines - 1}/{what}"

    def __call__(self, workdir: str) -> cells.CellResult:
        from .conformance import open_client

        victim = self.engines - 1
        config = msgspec.structs.replace(self.config, data_parallel_size=self.engines)
        record = Path(tempfile.mkstemp(prefix="fault-dp-", suffix=".log", dir=workdir)[1])
        before = ResourceSnapshot.take()
        start = time.monotonic()
        outcome, detail, latency = Outcome.HANG, "", None
        proxy = None
        cut = None
        options = cell_options()
        if self.fault is not None:
            options["engine_fault"] = {victim: FaultPlan(faults=[self.fault],
                                                         record_path=str(record))}
        try:
            if self.rule is not None:
                proxy = interpose(self.rule, victim, self.engines, workdir, options)
            cut = open_client(self.client, config, **options)
            outcome, detail, latency = self._run(cut, victim, record, proxy)
        except BaseException as e:  # the client failed as a whole: say how
            obs = cells.classify(e)
            outcome, detail = obs.outcome, obs.detail
        finally:
            if cut is not None:
                pid = _pid(cut, victim)
                if pid is not None and self.fault is not None and (
                        self.fault.action is FaultAction.SIGSTOP):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)  # the harness resumes what it stopped
                with contextlib.suppress(Exception):
                    cut.shutdown()
            if proxy is not None:
                proxy.close()
            with contextlib.suppress(OSError):
                record.unlink()
        leaks = left_behind(before)
        wall = time.monotonic() - start
        passed = outcome is Outcome.ONE_DOWN and not leaks and wall <= cells.CELL_BOUND_S
        if passed and latency is not None and latency > DEATH_BOUND_S * 1000.0:
            passed = False
            detail = f"detected after {latency:.0f} ms (bound {DEATH_BOUND_S * 1000:.0f})"
        if self.rule is not None:
            point, action = f"frames:{self.rule.kind}", str(self.rule.action)
        else:
            assert self.fault is not None
            point, action = str(self.fault.point), str(self.fault.action)
        return cells.CellResult(
            cell=self.name, client=self.client, scenario=f"dp{self.engines}", point=point,
            action=action, expected=Outcome.ONE_DOWN.value, outcome=outcome.value,
            passed=passed, latency_ms=None if latency is None else round(latency, 1),
            wall_s=round(wall, 2), leaks=leaks, detail=detail[:300])

    def _run(self, cut: Any, victim: int, record: Path, proxy: Any
             ) -> tuple[Outcome, str, float | None]:
        reference = cells.reference_tokens(self.config)
        deadline = time.monotonic() + cells.CELL_BOUND_S - 15.0
        params = SamplingParams(max_tokens=cells.MAX_TOKENS, ignore_eos=True)
        if self.fault is not None and self.fault.point is FaultPoint.UTILITY:
            return self._run_utility(cut, victim, record, reference, deadline)
        rids = {i: f"dp-{i}" for i in range(self.engines)}
        for i, rid in rids.items():
            cut.add_request(EngineCoreRequest(rid, list(cells.PROMPT), params,
                                              data_parallel_rank=i))
        tokens: dict[str, list[int]] = {rid: [] for rid in rids.values()}
        ended: dict[str, tuple[FinishReason, float]] = {}
        while len(ended) < len(rids):
            if time.monotonic() > deadline:
                left = sorted(set(rids.values()) - set(ended))
                return Outcome.HANG, f"unfinished: {left}", None
            for o in cut.get_output(timeout=0.05).outputs:
                tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    ended[o.request_id] = (o.finish_reason, time.monotonic())
        victim_reason, victim_at = ended[rids[victim]]
        for i, rid in rids.items():
            if i == victim:
                continue
            reason, _ = ended[rid]
            if reason is FinishReason.ERROR:
                return Outcome.ERROR_OUTPUT, f"engine {i}'s request ended with ERROR", None
            if tokens[rid] != reference:
                return (Outcome.SILENT_CORRUPTION,
                        f"engine {i} gave {tokens[rid]}, a clean run gives {reference}", None)
        if victim_reason is not FinishReason.ERROR:
            if tokens[rids[victim]] != reference:
                return (Outcome.SILENT_CORRUPTION,
                        f"engine {victim} gave {tokens[rids[victim]]} without an error", None)
            return Outcome.OK, f"engine {victim}'s request finished: the fault went unseen", None
        outcome, detail = self._survivors_serve(cut, victim, reference, deadline)
        fired = cells.fired_at(record) if self.fault is not None else (
            proxy.applied_at[0] if proxy is not None and proxy.applied_at else None)
        latency = None if fired is None else max(0.0, victim_at - fired) * 1000.0
        return outcome, detail, latency

    def _run_utility(self, cut: Any, victim: int, record: Path, reference: list[int],
                     deadline: float) -> tuple[Outcome, str, float | None]:
        """A call on every engine, the faulty one dying under it: the call raises
        EngineDeadError naming that engine, and the others serve on."""
        try:
            got = cut._call("call_utility_all", "echo", 1)
            return Outcome.OK, f"the call on the dying engine returned {got!r}", None
        except EngineDeadError as e:
            seen = time.monotonic()
            if f"engine {victim}" not in str(e):
                return (Outcome.DEAD,
                        f"the call's error does not name engine {victim}: {e}", None)
        outcome, detail = self._survivors_serve(cut, victim, reference, deadline)
        fired = cells.fired_at(record)
        return outcome, detail, None if fired is None else max(0.0, seen - fired) * 1000.0

    def _survivors_serve(self, cut: Any, victim: int, reference: list[int], deadline: float
                         ) -> tuple[Outcome, str]:
        """The faulty engine is the only one dead, and a new request is served by another."""
        dead = cut.client.dead_engines
        if dead != [victim]:
            return Outcome.DEAD, f"dead_engines is {dead}, expected [{victim}]"
        params = SamplingParams(max_tokens=cells.MAX_TOKENS, ignore_eos=True)
        cut.add_request(EngineCoreRequest("dp-after", list(cells.PROMPT), params))
        after: list[int] = []
        while True:
            if time.monotonic() > deadline:
                return Outcome.HANG, "the request after the death did not finish"
            batch = cut.get_output(timeout=0.05)
            done = False
            for o in batch.outputs:
                after += o.new_token_ids
                if o.finish_reason is not None:
                    if o.finish_reason is FinishReason.ERROR or batch.engine_index == victim:
                        return Outcome.DEAD, (f"after the death: {o.finish_reason} from"
                                              f" engine {batch.engine_index}")
                    done = True
            if done:
                break
        if after != reference:
            return Outcome.SILENT_CORRUPTION, f"after the death: {after}"
        return Outcome.ONE_DOWN, ""


def _pid(cut: Any, index: int) -> int | None:
    member = cut.client.engine_client(index)
    return None if member is None else member.engine_pid


def dp_cells(clients: list[str], quick: bool, config: Any, engines: int = 2) -> list[DPCell]:
    """A fault on one engine of ``engines`` per (client, way to go), or the quick subset."""
    from .interposer import Direction, FrameAction, FrameKind, FrameRule

    kinds = [c for c in clients if c in ("sync", "async")]
    faults = [
        Fault(point=FaultPoint.STEP, at=3, action=FaultAction.SIGKILL),
        Fault(point=FaultPoint.STEP, at=3, action=FaultAction.SIGSTOP),
        Fault(point=FaultPoint.FORWARD, at=3, action=FaultAction.RAISE),
        Fault(point=FaultPoint.OUTPUT_SEND, at=2, action=FaultAction.EXIT),
        Fault(point=FaultPoint.UTILITY, method="echo", action=FaultAction.SIGKILL),
    ]
    corrupt = FrameRule(action=FrameAction.BITFLIP, direction=Direction.TO_CLIENT,
                        kind=FrameKind.TOKENS, skip=1)
    cells: list[DPCell] = []
    for kind in kinds:
        picks = faults if not quick else (faults[:2] if kind == "sync" else faults[1:2])
        cells += [DPCell(kind, config, fault=f, engines=engines) for f in picks]
        if not quick or kind == "sync":
            cells.append(DPCell(kind, config, rule=corrupt, engines=engines))
    return cells


def run_dp_fault_matrix(
    clients: list[str] | None = None,
    quick: bool = False,
    results_dir: str = "results",
    *,
    engines: int = 2,
    config: Any = None,
    echo: Any = print,
) -> int:
    """``run_fault_matrix`` over the data-parallel cells only (``enginewire faults matrix
    --engines N``): 0 when every cell is *one down* as the spec requires, 1 otherwise."""
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 2:
        raise ValueError(f"engines={engines!r}: the data-parallel cells need at least 2")
    kinds = list(dict.fromkeys(clients or ("sync", "async")))
    bad = [c for c in kinds if c not in ("sync", "async")]
    if bad:
        raise ValueError(f"client kinds {bad}: the data-parallel cells run on sync and async")
    config = config if config is not None else fm._default_config()
    from .fault_matrix_scale import scale_cells

    extra: list[Any] = [*dp_cells(kinds, quick, config, engines),
                        *scale_cells(kinds, quick, config, engines)]
    return fm.run_fault_matrix(kinds, quick, results_dir, config=config, cells=[],
                               extra_cells=extra, echo=echo)
