"""The campaign machines' judgement of a client after its end (engine dead, or client shut
down): every call owes the spec's error, a read first returns what was queued, and a read that
only blocks where the error is owed is a failure. ``CampaignMachine._check_calls_refused``
(stateful_base.py) calls ``check_calls_refused``; the declarations of the factory
(``Declared.CLOSED_IS_DEAD``, ``DEAD_DELIVERED_ONCE``) change what is owed, as said there."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol.messages import EngineCoreRequest, SamplingParams
from ._conformance_driver import Declared
from .bounds import READ_AFTER_DEATH_S, RULE_DEATH_BOUND_S
from .oracle import OracleViolation, Phase

if TYPE_CHECKING:
    from .stateful_base import CampaignMachine

__all__ = ["check_calls_refused", "names"]


def names(kinds: tuple[type[BaseException], ...]) -> str:
    """``kinds`` as a message says them: ``ClientClosedError or EngineDeadError``."""
    return " or ".join(k.__name__ for k in kinds)


def check_calls_refused(m: CampaignMachine) -> None:
    """``call_after_end``'s checks (also run by every rule that ended the client). A
    client whose factory declares CLOSED_IS_DEAD has its aborts and reads after shutdown
    judged as a dead one's; one that declares DEAD_DELIVERED_ONCE owes no second
    EngineDeadError once a read had one (``_read_after_delivered_death``)."""
    closed = m.oracle.phase is Phase.CLOSED
    as_dead = not closed or m._closed_as_dead()
    refusal = m._refusal()
    end = "closed" if closed else "dead"
    calls: dict[str, Callable[[], Any]] = {
        "add": lambda: m.cut.add_request(EngineCoreRequest(
            m._fresh_id(), [3, 4], SamplingParams(max_tokens=2))),
        "pause": lambda: m.cut._call("pause_scheduler", "abort"),
        "resume": lambda: m.cut._call("resume_scheduler"),
        "is_sleeping": lambda: m.cut.is_sleeping(),
        "call_utility_all": lambda: m.cut._call("call_utility_all", "echo", 1),
    }
    for name, call in calls.items():
        m._expect_raises(refusal, call, f"{name} on a {end} client")
    if not as_dead:
        m._expect_raises(refusal, lambda: m.cut.abort_requests(["x"]),
                         "abort on a closed client")
    elif closed:  # CLOSED_IS_DEAD: the no-op it is on a dead engine, or refused
        with contextlib.suppress(*refusal):
            m.cut.abort_requests(["x"])
    else:
        m.cut.abort_requests([*m.oracle.live_ids(), "x"])  # silent
    if m.oracle.death_delivered and Declared.DEAD_DELIVERED_ONCE in m.contract:
        _read_after_delivered_death(m, end, refusal)
        return
    with_outputs = 0
    silent_since: float | None = None
    for _ in range(1000):  # the batches queued before the death, then the error
        try:
            batch = m._poll(0.05)
        except refusal:
            return
        except BaseException as e:
            raise OracleViolation(f"get_output on a {end} client: raised"
                                  f" {type(e).__name__}: {e}; expected"
                                  f" {names(refusal)}") from e
        if not as_dead:
            raise OracleViolation("get_output on a closed client: returned a batch")
        with_outputs += bool(batch.outputs)
        # Queued batches come at once; reads that find nothing for longer than a death
        # may take to be seen are a read that blocks where the error is owed.
        now = time.monotonic()
        if batch.outputs:
            silent_since = None
        elif silent_since is None:
            silent_since = now
        elif now - silent_since > RULE_DEATH_BOUND_S + 3:
            raise OracleViolation(
                f"get_output on a {end} client: no outputs and no error for"
                f" {now - silent_since:.1f} s ({with_outputs} batches with outputs"
                f" before); expected {names(refusal)}: the read blocks")
    raise OracleViolation(f"get_output on a {end} client: still returning batches"
                          f" after 1000 reads ({with_outputs} with outputs), none"
                          f" raised {names(refusal)}")

def _read_after_delivered_death(m: CampaignMachine, end: str,
                                refusal: tuple[type[BaseException], ...]) -> None:
    """DEAD_DELIVERED_ONCE, and a read already had the EngineDeadError: no second one is
    owed, and the client's read would block for good. One read bounded by
    READ_AFTER_DEATH_S returns no outputs (nothing follows a death), or raises again."""
    try:
        batch = m.cut.get_output(timeout=READ_AFTER_DEATH_S)
    except refusal:
        return
    except BaseException as e:
        raise OracleViolation(f"get_output on a {end} client, its death delivered: raised"
                              f" {type(e).__name__}: {e}; expected nothing or"
                              f" {names(refusal)}") from e
    if batch.outputs:
        raise OracleViolation(
            f"get_output on a {end} client returned outputs for"
            f" {sorted({o.request_id for o in batch.outputs})} after its death was"
            " delivered")
