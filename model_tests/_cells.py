"""What a fault-matrix cell is made of, whoever plants its fault: the outcomes, the result
row, the matrix's timing options, the classifier and the drivers that run a cell's request
or utility call.

The engine-side cells (``fault_matrix.py``), the frame cells the interposer's proxy carries
(``interposer.py``) and the data-parallel cells (``fault_matrix_dp.py``) all judge with
these, so a cell reads the same whichever module planted its fault; the matrix imports the
frame cells, and neither imports the other's machinery back.

A driver either returns the cell's ``Outcome`` or raises: ``Observed`` for an outcome it
classified itself (wrong tokens, an ERROR finish, no finish within the bound), anything
else for ``classify`` to name (``EngineDeadError`` is ``DEAD``, a factory's
``NotApplicable`` is ``NOT_APPLICABLE``, ...).
"""

from __future__ import annotations

import contextlib
import enum
import time
import unittest
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from ..spec.errors import (
    EngineDeadError,
    EngineStartupError,
    ProtocolError,
    UtilityError,
    UtilityTimeoutError,
)
from .bounds import DEATH_BOUND_S

if TYPE_CHECKING:
    from ._conformance_driver import ClientFactory

# A SIGSTOPped engine is declared dead by the heartbeat deadline. The client's monitor wakes
# at the deadline itself (last message + timeout), so a hang is seen within the timeout plus
# scheduling slack after the fault fired (its last message came before the fault). The
# deadline is a trade: shorter leaves more of the bound for slack, longer survives a starved
# engine or reader. 0.7 s measured 700-772 ms to detection in the full matrix (2 cores, load
# ~5); with seven beats per deadline only a stall of the whole deadline, not a late beat,
# reads as death.
HEARTBEAT_TIMEOUT_S = 0.7
HEARTBEAT_INTERVAL_S = 0.1
assert HEARTBEAT_TIMEOUT_S + 0.25 <= DEATH_BOUND_S, "the heartbeat must leave slack in the bound"
UTILITY_TIMEOUT_S = 0.5
SHUTDOWN_TIMEOUT_S = 1.0
# No cell may take longer than this, whatever happens (the "never a hang" guarantee).
CELL_BOUND_S = 60.0
MAX_TOKENS = 12
PROMPT = [1, 5, 9, 13, 17, 21]


class Outcome(enum.StrEnum):
    OK = "ok"  # served correctly (maybe later)
    DEAD = "dead"  # EngineDeadError reached the caller
    STARTUP_ERROR = "startup_error"
    UTILITY_ERROR = "utility_error"  # the call failed, the engine serves on
    ERROR_OUTPUT = "error_output"  # the request finished with ERROR
    TIMEOUT = "timeout"  # the call timed out, the engine stayed up: the caller was told
    HANG = "hang"  # the cell's bound passed with nothing detected
    SILENT_CORRUPTION = "silent_corruption"  # wrong tokens delivered without an error
    HARNESS_ERROR = "harness_error"  # the cell itself raised something unexpected
    # Data parallel (fault_matrix_dp.py): the faulty engine's work ended with ERROR, the
    # other engines served on, the client lives.
    ONE_DOWN = "one_down"
    # Scale (fault_matrix_scale.py): a joiner's fault undid the scale-up, the previous set
    # serves; a leaver's fault ended its work once and the others serve on.
    SCALE_UNDONE = "scale_undone"
    LEFT = "left"
    # Several front ends (fault_matrix_fe.py): the faulty front end's work ended in the
    # engine within the heartbeat bound, the other front end streamed on.
    FRONT_END_GONE = "front_end_gone"
    # A user's factory refused the cell's options (NotApplicable): skipped, not failed.
    NOT_APPLICABLE = "not_applicable"


@dataclass
class CellResult:
    cell: str
    client: str
    scenario: str
    point: str
    action: str
    expected: str
    outcome: str
    passed: bool
    latency_ms: float | None = None
    wall_s: float = 0.0
    leaks: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


class Observed(Exception):
    """Carries a classified outcome out of a scenario."""

    def __init__(self, outcome: Outcome, detail: str = "") -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail


def classify(exc: BaseException) -> Observed:
    """The outcome an exception out of a cell's client means."""
    if isinstance(exc, Observed):
        return exc
    if isinstance(exc, unittest.SkipTest):  # NotApplicable: a factory refused an option
        return Observed(Outcome.NOT_APPLICABLE, str(exc)[:200])
    if isinstance(exc, EngineStartupError):
        return Observed(Outcome.STARTUP_ERROR, str(exc)[:200])
    if isinstance(exc, EngineDeadError):
        cause = exc.__cause__
        detail = f"{type(cause).__name__}: {cause}" if cause else "engine dead"
        return Observed(Outcome.DEAD, detail[:200])
    if isinstance(exc, UtilityTimeoutError):
        return Observed(Outcome.HANG, "utility timed out and nothing declared the engine dead")
    if isinstance(exc, UtilityError):
        return Observed(Outcome.UTILITY_ERROR, str(exc)[:200])
    if isinstance(exc, ProtocolError):
        return Observed(Outcome.DEAD, f"ProtocolError: {exc}"[:200])
    return Observed(Outcome.HARNESS_ERROR, f"{type(exc).__name__}: {exc}"[:300])


def fired_at(record: Path) -> float | None:
    """When the fault fired: the ``time.monotonic()`` the engine wrote into its record file."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return float(record.read_text().split()[0])
    return None


# --- the request and its clean run ------------------------------------------------------------


def cell_request(rid: str) -> EngineCoreRequest:
    """The matrix's one request: ``MAX_TOKENS`` tokens of ``PROMPT``, EOS ignored."""
    return EngineCoreRequest(rid, list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS,
                                                               ignore_eos=True))


_references: dict[bytes, list[int]] = {}


def reference_tokens(config: Any) -> list[int]:
    """The clean run's tokens for the matrix's one request (greedy, so deterministic)."""
    import msgspec

    key = msgspec.msgpack.encode(config)
    if key not in _references:
        from ..runtime.client import InprocClient

        client = InprocClient(config)
        try:
            client.add_request(cell_request("reference"))
            tokens: list[int] = []
            done = False
            while not done:
                for out in client.get_output().outputs:
                    tokens += out.new_token_ids
                    done = done or out.finished
            _references[key] = tokens
        finally:
            client.shutdown()
    return _references[key]


# --- drivers ----------------------------------------------------------------------------------


def run_tokens(cut: Any, deadline: float) -> list[int]:
    """The matrix's one request, run to its end: the tokens it got."""
    cut.add_request(cell_request("cell"))
    tokens: list[int] = []
    while time.monotonic() < deadline:
        for out in cut.get_output(timeout=0.1).outputs:
            tokens += out.new_token_ids
            if out.finish_reason is FinishReason.ERROR:
                raise Observed(Outcome.ERROR_OUTPUT, out.error or "")
            if out.finished:
                return tokens
    raise Observed(Outcome.HANG, f"no finish within the cell bound ({len(tokens)} tokens)")


def generate(cut: Any, deadline: float, reference: list[int]) -> Outcome:
    """``OK`` when the request ran to its end with the clean run's tokens."""
    tokens = run_tokens(cut, deadline)
    if tokens != reference:
        raise Observed(Outcome.SILENT_CORRUPTION, f"got {tokens}, a clean run gives {reference}")
    return Outcome.OK


def await_death(cut: Any, deadline: float) -> None:
    """After a timed-out call: a silent engine must be declared dead by the heartbeat
    deadline; a live one that lost the call leaves a plain TIMEOUT."""
    deadline = min(deadline, time.monotonic() + DEATH_BOUND_S + 1.0)
    while time.monotonic() < deadline:
        cut.get_output(timeout=0.1)  # raises EngineDeadError once declared
    raise Observed(Outcome.TIMEOUT, "the call timed out; the engine still answers heartbeats")


def utility(cut: Any, deadline: float) -> Outcome:
    """``OK`` when ``echo(7)`` comes back as 7."""
    try:
        value = cut.call_utility("echo", 7, timeout=UTILITY_TIMEOUT_S * 4)
    except UtilityTimeoutError:
        await_death(cut, deadline)
        raise
    if value != 7:
        raise Observed(Outcome.SILENT_CORRUPTION, f"echo(7) returned {value!r}")
    return Outcome.OK


# --- a factory of the user's ------------------------------------------------------------------


def build_with(factory: ClientFactory, **options: Any) -> Any:
    """``factory(**options)``, a TypeError said for what it is: the ClientFactory contract has
    a factory honour each option or refuse it with NotApplicable, never choke on it."""
    try:
        return factory(**options)
    except TypeError as e:
        raise Observed(Outcome.HARNESS_ERROR,
                       f"the factory raised TypeError: {e} (a ClientFactory honours each"
                       " option or raises NotApplicable naming it)"[:300]) from e


def clean_refusal(outcome: Outcome, detail: str, leaks: dict[str, Any]) -> tuple[Outcome, str]:
    """A refusal that left something behind is the factory's failure, not a skip (as a failed
    construction must leak nothing: ``check_construction_failure_leaks_nothing``)."""
    if outcome is Outcome.NOT_APPLICABLE and leaks:
        return Outcome.HARNESS_ERROR, f"refused ({detail}) but left {sorted(leaks)} behind"
    return outcome, detail
