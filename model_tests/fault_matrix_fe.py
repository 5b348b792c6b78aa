"""The fault matrix's front-end cells: one engine serving two front ends at once, a fault on
one front end (the *victim*, index 1) while the other (the *survivor*, index 0) serves.

Theory of operation
-------------------
A cell starts an engine on its own with two address pairs (``process_main``, as ``enginewire
engine --input-address A0 --output-address B0 --input-address A1 --output-address B1``
runs), attaches the survivor (a client of the cell's kind, in this process) with one long
request streaming, and the victim with three long requests, and strikes the victim:

* ``kill``: the victim is a front-end *process* (spawned), SIGKILLed;
* ``stop``: that process is SIGSTOPped for longer than the engine's front-end timeout, then
  SIGCONTed;
* ``garbage``: the victim (in this process) puts malformed frames on its input socket;
* ``garbage_integrity``: the same with frame integrity on (engine and both front ends).

What the spec requires (spec/session.py; spec/compose_fe.py's properties) is, for ``kill``,
``stop`` and ``garbage_integrity``, *front end gone* (``Outcome.FRONT_END_GONE``):

* the victim's requests end in the engine (aborted, KV freed) within ``GONE_BOUND_S`` of the
  fault (the latency column: from the fault to the engine's live count holding the survivor's
  request alone), read from the survivor's ``get_stats``;
* the survivor's request streams on throughout and ends LENGTH with the null model's tokens;
* a stopped victim, resumed, is told it is no longer served (``EngineDeadError``), and never
  receives an output of its old requests after their end; a victim whose input failed the
  integrity check is told so (``EngineDeadError``);
* a new front end attaches under index 1 and is served; nothing leaks.

``garbage`` without integrity is *ok* (``Outcome.OK``): the engine drops frames it cannot
decode and serves both front ends on, the victim's requests included.

The cells run the null model whatever the matrix's model (what they judge is the engine's
sessions), its steps slowed to ``STEP_DELAY_S`` so a victim's request outlives the bound.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ..protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from ..spec.errors import EngineDeadError, UtilityTimeoutError
from . import _cells as cells
from ._cells import Outcome
from ._harness import ResourceSnapshot, left_behind, wait_until
from .bounds import WAIT_S
from .oracle import null_tokens


def _vocab() -> int:
    from ..runtime.model import TINY_ARCH

    return int(TINY_ARCH.vocab_size)

__all__ = ["FE_HOWS", "FECell", "fe_cells"]

FE_HOWS = ("kill", "stop", "garbage", "garbage_integrity")
# The engine's front_end_timeout_s: 2 s, as the campaign's (stateful_fe.FE_TIMEOUT_S: at 1 s
# a loaded 2-core machine saw a live front end taken for gone).
FE_TIMEOUT_S = 2.0
ENGINE_HEARTBEAT_S = 0.1
# The victim's requests end within its deadline plus the engine's poll and a loaded
# machine's slack (tests/runtime/test_front_ends.py allows its deadline plus 5 s).
GONE_BOUND_S = FE_TIMEOUT_S + 3.0
STEP_DELAY_S = 0.004
VICTIM_TOKENS = 2000  # 8 s at STEP_DELAY_S: only the engine can end it within the bound
SURVIVOR_TOKENS = 900  # streaming through the fault and the victim's loss (3.6 s)
VICTIM_REQUESTS = 3
# The front ends' deadline on the engine's heartbeat. The stopped victim's is longer than its
# stop, so what tells it, resumed, that it is not served is the engine's ended notice (its own
# deadline racing the queued heartbeats would tell it too, by luck).
VICTIM_HEARTBEAT_TIMEOUT_S = 2.0
STOPPED_HEARTBEAT_TIMEOUT_S = 30.0
GARBAGE_TOKENS = 200  # the victim's requests without integrity: served to their end
SEED = 5
RESUMED_CALL_S = 2.0  # a resumed victim's probe call: answered, refused, or timed out
PROMPT = [3, 4, 5]


def _config() -> Any:
    from ..runtime.config import EngineConfig

    return EngineConfig(model="null", max_num_seqs=8, max_model_len=2048, seed=0,
                        null_step_delay_s=STEP_DELAY_S)


def _request(rid: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(PROMPT), SamplingParams(
        max_tokens=max_tokens, seed=SEED, ignore_eos=True))


def _victim_main(config: bytes, inp: str, out: str, integrity: bool, ready: Any, resumed: Any,
                 verdict_path: str) -> None:
    """The victim front end as a process of its own: attaches under index 1, starts its long
    requests, says so once each streamed, and, if resumed (after a SIGSTOP), writes what it
    then saw: ``dead`` (told it is not served), ``served`` (an output of an old request after
    the engine ended it) or ``hang``."""
    from ..runtime.config import EngineConfig
    from ..runtime.factory import make_client

    cfg = msgspec.msgpack.decode(config, type=EngineConfig)
    client: Any
    with make_client(cfg, multiprocess=True, asyncio=False, launch_engine=False, input_address=inp,
                     output_address=out, client_index=1, ready_timeout_s=WAIT_S,
                     frame_integrity=integrity,
                     engine_heartbeat_timeout_s=STOPPED_HEARTBEAT_TIMEOUT_S) as client:
        ids = {f"v{i}" for i in range(VICTIM_REQUESTS)}
        for rid in sorted(ids):
            client.add_request(_request(rid, VICTIM_TOKENS))
        seen: set[str] = set()
        deadline = time.monotonic() + WAIT_S
        while seen != ids and time.monotonic() < deadline:
            seen |= {o.request_id for o in client.get_output(timeout=0.5).outputs}
        ready.set()
        if not resumed.wait(cells.CELL_BOUND_S):
            return
        start = time.monotonic()
        try:
            # What was queued before the stop may still be read; no ending may come.
            while time.monotonic() - start < 1.0:
                batch = client.get_output(timeout=0.2)
                ended = [o.request_id for o in batch.outputs if o.finish_reason is not None]
                if ended:
                    verdict = f"served: {ended} ended at the victim after its session went"
                    break
            else:
                got = client.call_utility("echo", 1, timeout=RESUMED_CALL_S)
                verdict = f"served: a call answered ({got!r}) after its session went"
        except EngineDeadError as e:
            verdict = f"dead after {time.monotonic() - start:.2f} s: {e} ({e.__cause__})"
        except UtilityTimeoutError:
            verdict = (f"not told: its call timed out after {RESUMED_CALL_S} s (the engine"
                       " drops a gone session's input unread and says nothing)")
        Path(verdict_path).write_text(verdict)


@dataclass
class FECell:
    """One cell: the survivor's ``client`` kind and the fault on the victim (``how``)."""

    client: str
    how: str
    # The victim's process while a kill or stop cell runs (the cell's cleanup reaps it).
    _victim: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.client not in ("sync", "async"):
            raise ValueError(f"FECell.client={self.client!r}: must be 'sync' or 'async'")
        if self.how not in FE_HOWS:
            raise ValueError(f"FECell.how={self.how!r}: must be one of {FE_HOWS}")

    @property
    def name(self) -> str:
        return f"{self.client}/front ends 2/front end 1/{self.how}"

    @property
    def expected(self) -> Outcome:
        return Outcome.OK if self.how == "garbage" else Outcome.FRONT_END_GONE

    def __call__(self, workdir: str) -> cells.CellResult:
        from ..runtime.engine_proc import process_main

        config = _config()
        integrity = self.how == "garbage_integrity"
        before = ResourceSnapshot.take()
        start = time.monotonic()
        outcome, detail, latency = Outcome.HANG, "", None
        d = tempfile.mkdtemp(prefix="fe-", dir=workdir)
        pairs = [(f"ipc://{d}/in{i}", f"ipc://{d}/out{i}") for i in range(2)]
        mp = multiprocessing.get_context("spawn")
        engine = mp.Process(target=process_main, name="fe-cell-engine", daemon=True, args=(
            type(config), msgspec.msgpack.encode(config), {
                "input_address": [p[0] for p in pairs],
                "output_address": [p[1] for p in pairs],
                "heartbeat_interval_s": ENGINE_HEARTBEAT_S, "integrity": integrity,
                "front_end_timeout_s": FE_TIMEOUT_S, "parent_pid": os.getpid()}))
        engine.start()
        opened: list[Any] = []
        try:
            survivor = self._attach(pairs, 0, self.client, integrity, opened)
            outcome, detail, latency = self._run(config, survivor, pairs, integrity, opened, d,
                                                 mp)
        except BaseException as e:  # the front ends failed as a whole: say how
            obs = cells.classify(e)
            outcome, detail = obs.outcome, obs.detail
        finally:
            if self._victim is not None:
                _reap(self._victim, signal.SIGCONT)  # a stopped one resumes to its end
                self._victim = None
            for cut in opened:
                with contextlib.suppress(Exception):
                    cut.shutdown()
            _reap(engine, signal.SIGTERM)
        leaks = left_behind(before)
        wall = time.monotonic() - start
        passed = outcome is self.expected and not leaks and wall <= cells.CELL_BOUND_S
        if passed and latency is not None and latency > GONE_BOUND_S * 1000.0:
            passed = False
            detail = f"victim's work ended {latency:.0f} ms after the fault (bound" \
                     f" {GONE_BOUND_S * 1000:.0f})"
        return cells.CellResult(
            cell=self.name, client=self.client, scenario="front ends 2", point="front end 1",
            action=self.how, expected=self.expected.value, outcome=outcome.value,
            passed=passed, latency_ms=None if latency is None else round(latency, 1),
            wall_s=round(wall, 2), leaks=leaks, detail=detail[:300])

    @staticmethod
    def _attach(pairs: list[tuple[str, str]], index: int, kind: str, integrity: bool,
                opened: list[Any]) -> Any:
        from .conformance import open_client

        cut = open_client(kind, _config(), launch_engine=False, client_index=index,
                          input_address=pairs[index][0], output_address=pairs[index][1],
                          frame_integrity=integrity, ready_timeout_s=WAIT_S,
                          engine_heartbeat_timeout_s=VICTIM_HEARTBEAT_TIMEOUT_S * 2)
        opened.append(cut)
        return cut

    def _run(self, config: Any, survivor: Any, pairs: list[tuple[str, str]], integrity: bool,
             opened: list[Any], workdir: str, mp: Any) -> tuple[Outcome, str, float | None]:
        expected = null_tokens(SEED, len(PROMPT), SURVIVOR_TOKENS, _vocab())
        tokens: list[int] = []
        ended: list[FinishReason] = []

        def read(timeout: float) -> None:
            for o in survivor.get_output(timeout=timeout).outputs:
                if o.request_id != "s0":
                    raise cells.Observed(Outcome.SILENT_CORRUPTION,
                                         f"the survivor received {o.request_id!r}, not its own")
                if ended:
                    raise cells.Observed(Outcome.SILENT_CORRUPTION,
                                         "the survivor's request ended twice")
                tokens.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    ended.append(FinishReason(o.finish_reason))

        def engine_live() -> int:
            return int(survivor.call_utility("get_stats", timeout=WAIT_S).num_live)

        verdict_path = os.path.join(workdir, "victim-verdict")
        resumed_said = ""
        victim_cut = None
        if self.how in ("kill", "stop"):
            ready, resumed = mp.Event(), mp.Event()
            proc = mp.Process(target=_victim_main, name="fe-cell-victim", daemon=True, args=(
                msgspec.msgpack.encode(config), *pairs[1], integrity, ready, resumed,
                verdict_path))
            self._victim = proc
            proc.start()
            if not ready.wait(WAIT_S * 2):
                return Outcome.HARNESS_ERROR, "the victim front end never started", None
        else:
            resumed = None
            victim_cut = self._attach(pairs, 1, "sync", integrity, opened)
            for i in range(VICTIM_REQUESTS):
                victim_cut.add_request(_request(f"v{i}", VICTIM_TOKENS if integrity
                                                else GARBAGE_TOKENS))
        # Once the victim is up (a process start takes seconds): streaming from now on.
        survivor.add_request(_request("s0", SURVIVOR_TOKENS))
        all_live = 1 + VICTIM_REQUESTS
        if not wait_until(lambda: engine_live() == all_live, WAIT_S, poll=0.01):
            return Outcome.HARNESS_ERROR, f"never {all_live} live requests in the engine", None
        read(0.05)
        before_fault = len(tokens)
        struck = time.monotonic()
        if self.how == "kill":
            os.kill(self._victim.pid, signal.SIGKILL)
        elif self.how == "stop":
            os.kill(self._victim.pid, signal.SIGSTOP)
        else:
            from .stateful_client import MALFORMED

            assert victim_cut is not None
            for frames in MALFORMED:
                victim_cut.client.send_raw_frames(list(frames))
        if self.how == "garbage":
            return self._garbage_served(survivor, victim_cut, read, tokens, ended, expected)
        # The victim's work ends in the engine; the survivor streams on meanwhile.
        gone_at = None
        while gone_at is None:
            if time.monotonic() - struck > GONE_BOUND_S + 1.0:
                return (Outcome.HANG, f"{engine_live() - 1} victim request(s) still live"
                        f" {GONE_BOUND_S + 1.0:.0f} s after the fault", None)
            read(0.02)
            if engine_live() == 1:
                gone_at = time.monotonic()
        latency = (gone_at - struck) * 1000.0
        if len(tokens) <= before_fault:
            return Outcome.DEAD, "the survivor received nothing while the victim went", latency
        if self.how == "stop":
            # Stopped past its deadline, then resumed: it must be told it is not served.
            time.sleep(max(0.0, struck + FE_TIMEOUT_S + 0.5 - time.monotonic()))
            os.kill(self._victim.pid, signal.SIGCONT)
            assert resumed is not None
            resumed.set()
            self._victim.join(2 * VICTIM_HEARTBEAT_TIMEOUT_S + 5.0 + WAIT_S)
            verdict = Path(verdict_path).read_text() if os.path.exists(verdict_path) else (
                "no verdict")
            if verdict.startswith("served") or verdict == "no verdict":
                return Outcome.SILENT_CORRUPTION, f"the resumed victim: {verdict}", latency
            if not verdict.startswith("dead"):
                # spec/session.py: a gone session is told (the engine's ended notice), so
                # a front end only stopped learns it on resuming, never waits on dropped calls.
                return Outcome.HANG, f"the resumed victim: {verdict}", latency
            resumed_said = f"resumed victim {verdict}"
        elif self.how == "garbage_integrity":
            assert victim_cut is not None
            try:
                victim_cut.call_utility("echo", 1, timeout=WAIT_S)
                return (Outcome.SILENT_CORRUPTION, "the victim whose input failed the integrity"
                        " check is still served", latency)
            except EngineDeadError:
                pass  # told: its session ended
            victim_cut.shutdown()  # its addresses, for the front end attaching after it
        outcome, detail = self._survivor_finishes(read, tokens, ended, expected)
        if outcome is not Outcome.OK:
            return outcome, detail, latency
        # Index 1 is served again by a new front end, which sees nothing of the old one's.
        again = self._attach(pairs, 1, self.client, integrity, opened)
        again.add_request(_request("v0", 5))
        got = cells_collect(again, "v0")["v0"]
        if got != (null_tokens(SEED, len(PROMPT), 5, _vocab()), FinishReason.LENGTH):
            return Outcome.SILENT_CORRUPTION, f"the new front end 1's v0 gave {got}", latency
        if engine_live() != 0:
            return Outcome.HANG, "requests left live in the engine at the end", latency
        return Outcome.FRONT_END_GONE, resumed_said, latency

    def _garbage_served(self, survivor: Any, victim: Any, read: Any, tokens: list[int],
                        ended: list[FinishReason], expected: list[int]
                        ) -> tuple[Outcome, str, float | None]:
        """Without integrity the engine drops what it cannot decode: both front ends serve."""
        if victim.call_utility("echo", "victim", timeout=WAIT_S) != "victim":
            return Outcome.UTILITY_ERROR, "the victim's echo came back wrong", None
        want = null_tokens(SEED, len(PROMPT), GARBAGE_TOKENS, _vocab())
        for rid, got in cells_collect(victim, *(f"v{i}" for i in range(VICTIM_REQUESTS))).items():
            if got != (want, FinishReason.LENGTH):
                return (Outcome.ERROR_OUTPUT, f"the victim's {rid} ended {got[1]} after"
                        f" {len(got[0])} tokens", None)
        outcome, detail = self._survivor_finishes(read, tokens, ended, expected)
        return outcome, detail, None

    @staticmethod
    def _survivor_finishes(read: Any, tokens: list[int], ended: list[FinishReason],
                           expected: list[int]) -> tuple[Outcome, str]:
        deadline = time.monotonic() + WAIT_S + SURVIVOR_TOKENS * STEP_DELAY_S * 2
        while not ended:
            if time.monotonic() > deadline:
                return Outcome.HANG, "the survivor's request did not finish"
            read(0.2)
        if ended[0] is not FinishReason.LENGTH:
            return Outcome.ERROR_OUTPUT, f"the survivor's request ended {ended[0].name}"
        if tokens != expected:
            return Outcome.SILENT_CORRUPTION, "the survivor's tokens differ from a clean run's"
        return Outcome.OK, ""


def _reap(proc: Any, sig: int) -> None:
    """Send ``proc`` ``sig`` if it runs, wait for its end (SIGKILL past ``WAIT_S``), and
    release its handle."""
    if proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        proc.join(WAIT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(WAIT_S)
    with contextlib.suppress(ValueError):
        proc.close()


def cells_collect(cut: Any, *rids: str) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Each of ``rids``' tokens and ending on ``cut`` (bounded: None when it did not end); an
    output of another id is an isolation failure."""
    got: dict[str, tuple[list[int], FinishReason | None]] = {r: ([], None) for r in rids}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and any(end is None for _, end in got.values()):
        for o in cut.get_output(timeout=0.5).outputs:
            if o.request_id not in got or got[o.request_id][1] is not None:
                raise cells.Observed(Outcome.SILENT_CORRUPTION,
                                     f"an output for {o.request_id!r} while reading {rids}")
            tokens = got[o.request_id][0] + list(o.new_token_ids)
            end = None if o.finish_reason is None else FinishReason(o.finish_reason)
            got[o.request_id] = (tokens, end)
    return got


def fe_cells(clients: list[str], quick: bool) -> list[FECell]:
    """Every fault on the victim per survivor kind; ``quick``: the kill (sync) and the
    integrity failure (async), one front-end loss each way the engine sees it."""
    kinds = [c for c in clients if c in ("sync", "async")]
    if quick:
        return [FECell(k, how) for k, how in (("sync", "kill"), ("async", "garbage_integrity"))
                if k in kinds]
    return [FECell(k, how) for k in kinds for how in FE_HOWS]
