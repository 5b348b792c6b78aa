"""Named fault points and fault plans: how the harness breaks an engine on purpose.

Theory of operation
-------------------
A ``FaultPlan`` is data: a list of ``Fault(point=..., action=..., at=N, arg=..., method=...)``,
every field checked (and a string converted to its enum member) when built, so a bad plan fails
in the caller, never inside an engine. It travels to the engine process at launch (the client
option ``engine_fault``, which also still takes the legacy ``"forward:3"`` string) and, only
when the plan says ``allow_arm=True``, more faults can be armed at run time through the
``arm_fault`` utility. Without that flag the utility does not exist: a production engine never
exposes a way to kill itself.

Inside the engine a ``FaultInjector`` is called at every named point (``FaultPoint``); each
fault counts the hits of its point and fires once, on hit number ``at``. What firing does is
the ``FaultAction``: raise, ``os._exit`` without the dead sentinel, SIGKILL, SIGSTOP (a live
but silent engine; the harness sends SIGCONT or SIGKILL), a delay, or a simulated
out-of-memory (``torch.cuda.OutOfMemoryError`` on a CUDA engine, a ``MemoryError`` that reads
as KV-cache exhaustion on CPU). Points in the IO threads turn a raise into the thread's own
failure, so an injected raise is always fatal, never swallowed as a bad frame.

No I/O at import; ``fire`` is the only place that touches the process.
"""

from __future__ import annotations

import enum
import math
import os
import signal
import threading
import time
from typing import Any, TypeVar

import msgspec
from msgspec.structs import force_setattr

from .fault_points import FaultAction, FaultPoint

__all__ = [
    "ARM_FAULT_UTILITY",
    "Fault",
    "FaultAction",
    "FaultInjector",
    "FaultPlan",
    "FaultPoint",
    "InjectedFault",
    "InjectedOOM",
    "as_member",
    "as_plan",
    "check_count",
    "check_real",
]

ARM_FAULT_UTILITY = "arm_fault"
# Exit status of an injected os._exit: distinct from 1 (fatal error) so a report can tell.
INJECTED_EXIT_CODE = 17
DEFAULT_DELAY_S = 1.0


E = TypeVar("E", bound=enum.Enum)


def as_member(kind: type[E], value: object, name: str) -> E:
    """``value`` as a member of ``kind``: the member itself or its string value.

    Every harness struct converts its enum fields through this at construction, so a rule
    written with strings matches exactly like one written with members (the hot paths then
    compare members and never see a bare string).
    """
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in kind)
            raise ValueError(f"{name}={value!r}: not a {kind.__name__}; one of {allowed}"
                             ) from None
    raise TypeError(f"{name} must be a {kind.__name__} or its string value,"
                    f" got {type(value).__name__} {value!r}")


def check_count(value: object, name: str, *, least: int = 0) -> int:
    """An int (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{name}={value}: must be >= {least}")
    return value


def check_real(value: object, name: str, *, low: float = 0.0,
               high: float = math.inf) -> float:
    """A finite real number (not a bool) in ``[low, high]``, as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or not low <= value <= high:
        bound = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise ValueError(f"{name}={value!r}: must be finite and {bound}")
    return float(value)


class InjectedFault(RuntimeError):
    """The exception a RAISE fault throws."""


class InjectedOOM(MemoryError):
    """Simulated out-of-memory on a CPU engine: the KV cache cannot grow."""


class Fault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One fault: fire ``action`` on the ``at``-th time ``point`` is reached."""

    point: FaultPoint
    action: FaultAction = FaultAction.RAISE
    at: int = 1
    # DELAY: seconds; EXIT: exit status; otherwise unused.
    arg: float | None = None
    # UTILITY point only: the utility's name (None: any utility).
    method: str | None = None

    def __post_init__(self) -> None:
        # Checked and converted here, once: the injector's per-hit check then compares
        # members only. (Frozen, hence force_setattr; msgspec decoding runs this too.)
        point = as_member(FaultPoint, self.point, "Fault.point")
        action = as_member(FaultAction, self.action, "Fault.action")
        force_setattr(self, "point", point)
        force_setattr(self, "action", action)
        check_count(self.at, "Fault.at", least=1)  # hits count from 1
        if self.arg is not None:
            if action is FaultAction.EXIT:
                status = check_real(self.arg, "Fault.arg (exit status)", high=255)
                if not status.is_integer():
                    raise ValueError(f"Fault.arg={self.arg!r}: an exit status is an integer")
            else:
                # DELAY: seconds (time.sleep refuses negatives, and nan/inf never return).
                check_real(self.arg, "Fault.arg")
        if self.method is not None:
            if not isinstance(self.method, str) or not self.method:
                raise TypeError(f"Fault.method must be a utility name, got {self.method!r}")
            if point is not FaultPoint.UTILITY:
                raise ValueError("Fault.method only narrows the UTILITY point")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``point[:method][:at][:action][:arg]``, e.g. ``forward:3``, ``utility:echo:2``,
        ``step:5:sigkill``, ``output_send:1:delay:0.5``. The legacy ``"<point>:<n>"`` test hook
        strings parse to a RAISE."""
        if not isinstance(text, str):
            raise TypeError(f"a fault spec is a str, got {type(text).__name__} {text!r}")
        parts = text.split(":")
        try:
            point = as_member(FaultPoint, parts.pop(0), "point")
            method = None
            if point is FaultPoint.UTILITY and parts and not parts[0].isdigit():
                method = parts.pop(0)
            at = parts.pop(0) if parts else "1"
            if not at.isdigit():
                raise ValueError(f"at={at!r}: the hit count is a whole number")
            action = as_member(FaultAction, parts.pop(0), "action") if parts else (
                FaultAction.RAISE)
            arg = float(parts.pop(0)) if parts else None
            if parts:
                raise ValueError(f"unexpected trailing {parts!r}")
            return cls(point=point, action=action, at=int(at), arg=arg, method=method)
        except (ValueError, TypeError) as e:
            raise ValueError(f"fault spec {text!r} (point[:method][:at][:action][:arg]): {e}"
                             ) from None

    def __str__(self) -> str:
        head = self.point.value if self.method is None else f"{self.point.value}:{self.method}"
        tail = "" if self.arg is None else f":{self.arg:g}"
        return f"{head}:{self.at}:{self.action.value}{tail}"


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Faults armed at engine start; ``allow_arm`` adds the ``arm_fault`` utility."""

    faults: list[Fault] = []
    allow_arm: bool = False
    # A file that gets one line ``<time.monotonic()> <fault>`` as each fault fires, so a
    # harness can measure detection latency (CLOCK_MONOTONIC is shared by all processes).
    record_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.faults, tuple):
            force_setattr(self, "faults", list(self.faults))
        if not isinstance(self.faults, list):
            hint = " (a spec string: use FaultPlan.parse)" if isinstance(self.faults, str) else ""
            raise TypeError(f"FaultPlan.faults must be a list of Fault,"
                            f" got {type(self.faults).__name__} {self.faults!r}{hint}")
        for i, f in enumerate(self.faults):
            if not isinstance(f, Fault):
                raise TypeError(f"FaultPlan.faults[{i}] must be a Fault (Fault.parse reads a"
                                f" spec string), got {type(f).__name__} {f!r}")
        if not isinstance(self.allow_arm, bool):
            raise TypeError(f"FaultPlan.allow_arm must be a bool, got {self.allow_arm!r}")
        if self.record_path is not None:
            if isinstance(self.record_path, os.PathLike):
                force_setattr(self, "record_path", os.fspath(self.record_path))
            if not isinstance(self.record_path, str) or not self.record_path:
                raise TypeError(f"FaultPlan.record_path must be a path, got {self.record_path!r}")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """Comma-separated ``Fault.parse`` specs."""
        if not isinstance(text, str):
            raise TypeError(f"a fault plan spec is a str, got {type(text).__name__} {text!r}")
        return cls(faults=[Fault.parse(p.strip()) for p in text.split(",") if p.strip()])


def as_plan(option: str | Fault | FaultPlan | None) -> FaultPlan | None:
    """The ``engine_fault`` client option, whatever form it came in, fully checked.

    Raises ``ValueError`` (an unknown point or action, a bad count or argument: the message
    names it and lists what is allowed) or ``TypeError`` (not a plan, a fault or a spec string)
    here, in the caller's process: a client calls it before it spawns an engine, so a bad
    option never costs an engine start. A ``FaultPlan`` is checked again (its ``faults`` list
    may have been changed since it was built); the result is a new plan, never the argument.
    """
    if option is None:
        return None
    if isinstance(option, FaultPlan):
        return FaultPlan(faults=[_recheck(f) for f in _faults_of(option)],
                         allow_arm=option.allow_arm, record_path=option.record_path)
    if isinstance(option, Fault):
        return FaultPlan(faults=[_recheck(option)])
    if isinstance(option, str):
        return FaultPlan.parse(option)
    raise TypeError(f"engine_fault must be a FaultPlan, Fault or str spec,"
                    f" got {type(option).__name__} {option!r}")


def _faults_of(plan: FaultPlan) -> list[Any]:
    if not isinstance(plan.faults, list | tuple):
        raise TypeError(f"FaultPlan.faults must be a list of Fault, got {plan.faults!r}")
    return list(plan.faults)


def _recheck(fault: object) -> Fault:
    if not isinstance(fault, Fault):
        raise TypeError(f"a FaultPlan holds Fault values, got {type(fault).__name__} {fault!r}")
    return Fault(point=fault.point, action=fault.action, at=fault.at, arg=fault.arg,
                 method=fault.method)


class FaultInjector:
    """Callable at every fault point; fires the armed faults. Thread-safe (IO threads call it).

    ``device`` decides what an OOM is ("cuda..." raises torch's CUDA OOM type).
    """

    def __init__(self, plan: FaultPlan | None = None, *, device: str = "cpu") -> None:
        self._lock = threading.Lock()
        self._armed: list[list[Any]] = []  # [fault, hits so far]
        self.device = device
        self.allow_arm = bool(plan and plan.allow_arm)
        self.record_path = plan.record_path if plan else None
        self.fired: list[Fault] = []
        for f in plan.faults if plan else ():
            self.arm(f)

    def arm(self, fault: Fault | str | dict[str, Any]) -> str:
        """Add a fault (the ``arm_fault`` utility calls this); returns its spec string.

        Anything else raises here, in the utility (a ``UtilityError`` for the caller): an
        unchecked value would only fail later, at a fault point inside an engine thread.
        """
        if isinstance(fault, str):
            fault = Fault.parse(fault)
        elif isinstance(fault, dict):
            fault = msgspec.convert(fault, Fault)
        elif isinstance(fault, Fault):
            fault = _recheck(fault)
        else:
            raise TypeError(f"arm_fault takes a Fault, a spec string or a dict,"
                            f" got {type(fault).__name__} {fault!r}")
        with self._lock:
            self._armed.append([fault, 0])
        return str(fault)

    def armed(self) -> list[Fault]:
        with self._lock:
            return [f for f, _ in self._armed]

    def __call__(self, point: FaultPoint | str, method: str | None = None) -> None:
        """Point ``point`` is reached (``method``: the utility's name at ``UTILITY``). The
        engine passes members; a string (``"step"``, ``"utility:echo"``) is still read, for
        hooks of users' own that call the injector."""
        if not self._armed:  # the common case, every step: nothing armed, no lock taken
            return
        if type(point) is not FaultPoint:
            head, _, named = str(point).partition(":")
            point, method = as_member(FaultPoint, head, "fault point"), named or method
        due: list[Fault] = []
        with self._lock:
            for entry in self._armed:
                fault: Fault = entry[0]
                if fault.point != point:
                    continue
                if fault.method is not None and fault.method != method:
                    continue
                entry[1] += 1
                if entry[1] == fault.at:
                    due.append(fault)
            if due:
                gone = {id(f) for f in due}
                self._armed = [e for e in self._armed if id(e[0]) not in gone]
                self.fired.extend(due)
        for fault in due:
            self.fire(fault)

    def fire(self, fault: Fault) -> None:
        action = fault.action
        what = f"injected fault {fault}"
        if self.record_path:
            line = f"{time.monotonic()!r} {fault}\n".encode()
            fd = os.open(self.record_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        if action is FaultAction.RAISE:
            raise InjectedFault(what)
        if action is FaultAction.DELAY:
            time.sleep(DEFAULT_DELAY_S if fault.arg is None else float(fault.arg))
            return
        if action is FaultAction.OOM:
            if self.device.startswith("cuda"):
                import torch

                raise torch.cuda.OutOfMemoryError(f"{what}: CUDA out of memory (simulated)")
            raise InjectedOOM(f"{what}: no free KV-cache blocks (simulated)")
        if action is FaultAction.EXIT:
            os._exit(INJECTED_EXIT_CODE if fault.arg is None else int(fault.arg))
        if action is FaultAction.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # the signal is asynchronous; never return into the engine
            return
        if action is FaultAction.SIGSTOP:
            # Aimed at this thread, not the process: a process-directed stop may be taken by
            # another thread, and until it is this one runs on (an echo reply got out after
            # its SIGSTOP fault had fired). A stop signal still stops every thread.
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return  # resumed by SIGCONT: carry on as if nothing happened
        raise ValueError(f"unknown fault action {action!r}")
