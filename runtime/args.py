"""Argument checks every client runs before anything is sent or any state changes.

A bad argument is refused here with a ``TypeError`` or ``ValueError`` that names it, the
same on every client; the engine would refuse most of them too, but only after a round trip
and as a ``UtilityError`` blaming the call. The checks of a utility's own arguments live with
its declaration (``protocol/utilities.py``), where the generated wrappers find them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

# The longest wait handed to a blocking primitive at once: pyzmq's poll and RCVTIMEO take
# int32 milliseconds and Condition.wait overflows past threading.TIMEOUT_MAX, so a longer
# wait is served in slices of this.
MAX_WAIT_SLICE_S = 1 << 20
__all__ = [
    "MAX_WAIT_SLICE_S",
    "check_method",
    "check_option_seconds",
    "check_request_ids",
    "check_timeout",
]


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """A caller's timeout in seconds: ``None`` and ``inf`` wait without end, a negative one is
    0 (look once, do not wait). Anything else is refused before any state changes."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds or None, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds):
        raise ValueError(f"{name} must be a number of seconds or None, got nan")
    if math.isinf(seconds):
        return None if seconds > 0 else 0.0
    return max(0.0, seconds)


def check_option_seconds(value: Any, name: str, *, allow_zero: bool = False) -> float | None:
    """A client option in seconds (a deadline, an interval): None, or finite and positive
    (or zero where ``allow_zero``); ``ValueError`` naming the option otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r}: must be a number of seconds or None")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r}: must be a finite number of seconds "
                         f"{'>= 0' if allow_zero else '> 0'}")
    return seconds


def check_option_flag(value: Any, name: str) -> bool:
    """A client option that is a flag: True or False, nothing that merely reads as one (a
    str "no" is truthy); ``ValueError`` naming the option otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be True or False")
    return value


def check_request_ids(request_ids: Any, what: str = "abort_requests") -> list[str]:
    """A list of request ids, each a str; a bare str is refused (iterating it would abort
    one-letter ids), and so is any other element, before anything is sent."""
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
        raise TypeError(f"{what} expects a list of request ids (str), got {request_ids!r}")
    ids = list(request_ids)
    for rid in ids:
        if not isinstance(rid, str):
            raise TypeError(f"{what}: every request id must be a str, got {rid!r}")
    return ids


def check_method(method: Any) -> str:
    """A utility's name, refused here when it is not a str (it was sent, and came back as a
    UtilityError blaming a "malformed call")."""
    if not isinstance(method, str):
        raise TypeError(f"a utility method is named by a str, got {method!r}")
    return method
