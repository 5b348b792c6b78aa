"""The fault matrix's scale-time cells: a fault while a data-parallel client scales (issue 46).

Theory of operation
-------------------
A cell opens a data-parallel client over ``engines`` engine cores, pins one request to each,
and scales while a fault hits the engine that joins or leaves (spec/membership.py):

* ``joiner``: the engine a scale-up adds is SIGKILLed before its handshake. Required
  (``Outcome.SCALE_UNDONE``): ``scale`` raises ``EngineStartupError`` naming its index, the
  previous set serves on (the same engines, every request with the clean run's tokens, a new
  request served), nothing leaks.
* ``leaver-kill`` / ``leaver-stop`` / ``leaver-frames``: the engine a scale-down removes is
  SIGKILLed or SIGSTOPped during its drain, or its frames to the client are corrupted.
  Required (``Outcome.LEFT``): ``scale`` returns within its drain bound plus the death
  bound, the leaver's request ends exactly once (ERROR for a death, the heartbeat's too for
  a stop; ABORT naming the removal where the drain ran out first), every other request ends
  clean, the set is the others, a new request is served by them, nothing leaks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from ..protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from ..runtime.faults import Fault, FaultAction, FaultPlan, FaultPoint
from ..spec.errors import EngineStartupError
from ..spec.membership import MEMBER_ROUTABLE, MembershipState
from . import _cells as cells
from ._cells import Outcome
from ._dp_cells import cell_options, interpose
from ._harness import ResourceSnapshot, left_behind
from .bounds import DEATH_BOUND_S

__all__ = ["SCALE_FAULTS", "ScaleCell", "scale_cells"]

# The ways a scale meets a fault, in the order the matrix runs them.
SCALE_FAULTS = ("joiner", "leaver-kill", "leaver-stop", "leaver-frames")
# A leaver's drain: long enough that the fault lands in it, short enough for a cell.
DRAIN_S = 3.0
# The leaver's request: many more tokens than the drain lets it stream.
LONG_TOKENS = 100_000


@dataclass
class ScaleCell:
    """One cell: ``client`` kind, ``how`` (one of ``SCALE_FAULTS``) over ``engines``."""

    client: str
    config: Any
    how: str
    engines: int = 2

    def __post_init__(self) -> None:
        if self.client not in ("sync", "async"):
            raise ValueError(f"ScaleCell.client={self.client!r}: must be 'sync' or 'async'")
        if self.how not in SCALE_FAULTS:
            raise ValueError(f"ScaleCell.how={self.how!r}: one of {', '.join(SCALE_FAULTS)}")
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or not (
                2 <= self.engines <= 8):
            raise ValueError(f"ScaleCell.engines={self.engines!r}: an integer in [2, 8]")

    @property
    def name(self) -> str:
        return f"{self.client}/dp{self.engines}/scale/{self.how}"

    @property
    def expected(self) -> Outcome:
        return Outcome.SCALE_UNDONE if self.how == "joiner" else Outcome.LEFT

    def __call__(self, workdir: str) -> cells.CellResult:
        from .conformance import open_client
        from .interposer import Direction, FrameAction, FrameKind, FrameRule

        config = msgspec.structs.replace(self.config, data_parallel_size=self.engines)
        before = ResourceSnapshot.take()
        start = time.monotonic()
        outcome, detail = Outcome.HANG, ""
        cut = proxy = None
        stopped: int | None = None
        options = cell_options()
        if self.how == "joiner":  # the index the scale-up adds
            options["engine_fault"] = {self.engines: FaultPlan(faults=[Fault(
                point=FaultPoint.BEFORE_READY, action=FaultAction.SIGKILL)])}
        try:
            if self.how == "leaver-frames":
                rule = FrameRule(action=FrameAction.BITFLIP, direction=Direction.TO_CLIENT,
                                 kind=FrameKind.TOKENS, skip=50)
                proxy = interpose(rule, self.engines - 1, self.engines, workdir, options)
            cut = open_client(self.client, config, **options)
            if self.how == "joiner":
                outcome, detail = self._joiner(cut)
            else:
                outcome, detail, stopped = self._leaver(cut)
        except BaseException as e:  # the client failed as a whole: say how
            obs = cells.classify(e)
            outcome, detail = obs.outcome, obs.detail
        finally:
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)  # the harness resumes what it stopped
            if cut is not None:
                with contextlib.suppress(Exception):
                    cut.shutdown()
            if proxy is not None:
                proxy.close()
        leaks = left_behind(before)
        wall = time.monotonic() - start
        passed = outcome is self.expected and not leaks and wall <= cells.CELL_BOUND_S
        return cells.CellResult(
            cell=self.name, client=self.client, scenario=f"dp{self.engines}-scale",
            point="scale", action=self.how, expected=self.expected.value,
            outcome=outcome.value, passed=passed, wall_s=round(wall, 2), leaks=leaks,
            detail=detail[:300])

    # -- the scenarios --

    def _pinned(self, cut: Any, tokens: dict[int, int]) -> dict[int, str]:
        rids = {}
        for i, n in tokens.items():
            rids[i] = f"scale-{i}"
            cut.add_request(EngineCoreRequest(
                rids[i], list(cells.PROMPT), SamplingParams(max_tokens=n, ignore_eos=True),
                data_parallel_rank=i))
        return rids

    def _ends(self, cut: Any, rids: set[str], bound: float
              ) -> tuple[dict[str, Any], dict[str, list[int]], str]:
        """Each id's finishing output and tokens; a second finish is named."""
        ends: dict[str, Any] = {}
        tokens: dict[str, list[int]] = {r: [] for r in rids}
        deadline = time.monotonic() + bound
        while set(ends) < rids:
            if time.monotonic() > deadline:
                return ends, tokens, f"unfinished: {sorted(rids - set(ends))}"
            for o in cut.get_output(timeout=0.05).outputs:
                if o.request_id in tokens:
                    tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    if o.request_id in ends:
                        return ends, tokens, f"{o.request_id} finished twice"
                    ends[o.request_id] = o
        return ends, tokens, ""

    def _serves(self, cut: Any, reference: list[int], set_: list[int]) -> tuple[Outcome, str]:
        """The set is ``set_``, and a new request is served by it with the clean tokens."""
        engines = cut.client.engines
        serving = sorted(i for i, s in engines.items() if s in MEMBER_ROUTABLE)
        if serving != set_ or sorted(engines) != set_:
            return Outcome.DEAD, f"engines are {engines}, expected {set_} serving"
        cut.add_request(cells.cell_request("scale-after"))
        ends, tokens, why = self._ends(cut, {"scale-after"}, 20.0)
        if why:
            return Outcome.HANG, f"after the scale: {why}"
        if ends["scale-after"].finish_reason is FinishReason.ERROR:
            return Outcome.DEAD, "after the scale: ERROR"
        if tokens["scale-after"] != reference:
            return Outcome.SILENT_CORRUPTION, f"after the scale: {tokens['scale-after']}"
        return Outcome.OK, ""

    def _joiner(self, cut: Any) -> tuple[Outcome, str]:
        reference = cells.reference_tokens(self.config)
        rids = self._pinned(cut, dict.fromkeys(range(self.engines), cells.MAX_TOKENS))
        pids = cut.client.engine_pids
        try:
            cut._call("scale", self.engines + 1)
            return Outcome.OK, "the scale-up went through: its joiner's death went unseen"
        except EngineStartupError as e:
            if f"engine {self.engines}" not in str(e):
                return Outcome.STARTUP_ERROR, f"the error does not name the joiner: {e}"
        if cut.client.engine_pids != pids:
            return Outcome.DEAD, f"engines changed: {pids} -> {cut.client.engine_pids}"
        ends, tokens, why = self._ends(cut, set(rids.values()), 30.0)
        if why:
            return Outcome.HANG, why
        for rid in rids.values():
            if ends[rid].finish_reason is FinishReason.ERROR or tokens[rid] != reference:
                return Outcome.SILENT_CORRUPTION, f"{rid}: {ends[rid]} {tokens[rid]}"
        outcome, why = self._serves(cut, reference, list(range(self.engines)))
        return (Outcome.SCALE_UNDONE, "") if outcome is Outcome.OK else (outcome, why)

    def _leaver(self, cut: Any) -> tuple[Outcome, str, int | None]:
        reference = cells.reference_tokens(self.config)
        leaver = self.engines - 1
        tokens_by = dict.fromkeys(range(self.engines), cells.MAX_TOKENS)
        tokens_by[leaver] = LONG_TOKENS
        rids = self._pinned(cut, tokens_by)
        pid = cut.client.engine_client(leaver).engine_pid
        stopped = None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            scaling = pool.submit(cut._call, "scale", self.engines - 1,
                                  drain_timeout_s=DRAIN_S)
            deadline = t0 + 10.0
            while cut.client.engines.get(leaver) is MembershipState.SERVING:
                if time.monotonic() > deadline:
                    return Outcome.HANG, "the leaver never began its drain", None
                time.sleep(0.005)
            if self.how == "leaver-kill":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            elif self.how == "leaver-stop":
                os.kill(pid, signal.SIGSTOP)
                stopped = pid
            try:
                scaling.result(DRAIN_S + DEATH_BOUND_S + 10.0)
            except concurrent.futures.TimeoutError:
                return Outcome.HANG, "scale() did not return", stopped
            took = time.monotonic() - t0
        if took > DRAIN_S + DEATH_BOUND_S + 5.0:
            return Outcome.HANG, f"scale() took {took:.1f} s", stopped
        ends, tokens, why = self._ends(cut, set(rids.values()), 30.0)
        if why:
            return Outcome.HANG, why, stopped
        for i, rid in rids.items():
            end = ends[rid]
            if i != leaver:
                if end.finish_reason is FinishReason.ERROR or tokens[rid] != reference:
                    return Outcome.SILENT_CORRUPTION, f"{rid}: {end} {tokens[rid]}", stopped
            elif end.finish_reason is FinishReason.ABORT and "removed" not in str(
                    end.stop_reason):
                return Outcome.ERROR_OUTPUT, f"an ABORT not naming the removal: {end}", stopped
            elif end.finish_reason not in (FinishReason.ERROR, FinishReason.ABORT):
                return Outcome.OK, f"the leaver's request ended {end}: the fault went unseen", (
                    stopped)
        outcome, why = self._serves(cut, reference, list(range(self.engines - 1)))
        if outcome is not Outcome.OK:
            return outcome, why, stopped
        return Outcome.LEFT, "", stopped


def scale_cells(clients: list[str], quick: bool, config: Any, engines: int = 2
                ) -> list[ScaleCell]:
    """A cell per (client, scale fault), or the quick subset (sync: a leaver killed)."""
    kinds = [c for c in clients if c in ("sync", "async")]
    out: list[ScaleCell] = []
    for kind in kinds:
        hows = SCALE_FAULTS if not quick else (("leaver-kill",) if kind == "sync" else ())
        out += [ScaleCell(kind, config, how, engines) for how in hows]
    return out
