"""The subprocess clients' options as one typed object, checked once, before anything starts.

``ClientOptions`` holds every option of ``MPClient`` (and so of ``SyncMPClient``,
``AsyncMPClient`` and each engine of a data-parallel client). It is built from keyword
arguments (``make_client(cfg, multiprocess=True, asyncio=False, shutdown_timeout_s=5)``) or
passed whole (``options=ClientOptions(...)``, keywords then override its fields); either way
each field is checked in ``__post_init__``: a wrong type or an impossible value is a
``ValueError`` naming the option, an unknown name a ``TypeError`` as for any keyword, so a
typo never costs an engine start. Values are normalised there too (seconds as floats, a fault
spec as a ``FaultPlan``, the ready deadline resolved from the environment), so the client
reads them without checking again.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..protocol.limits import Limits
from .args import check_option_flag, check_option_seconds
from .faults import as_plan
from .security import CurveConfig

if TYPE_CHECKING:
    from .mp_client import EngineLauncher

__all__ = ["DEFAULT_READY_TIMEOUT_S", "READY_TIMEOUT_ENV", "ClientOptions"]

READY_TIMEOUT_ENV = "ENGINEWIRE_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 120.0
_TRANSPORTS = ("ipc", "tcp")


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """Every option of a subprocess client; docs/runtime.md ("Client options") says each."""

    ready_timeout_s: float | None = None  # None: $ENGINEWIRE_ENGINE_READY_TIMEOUT_S or 120 s
    engine_index: int = 0
    client_index: int = 0
    input_address: str | None = None
    output_address: str | None = None
    launch_engine: bool = True
    engine_heartbeat_timeout_s: float | None = None
    engine_heartbeat_interval_s: float | None = None
    engine_startup_delay_s: float = 0.0
    engine_fault: Any = None  # str | Fault | FaultPlan (runtime/faults.py); a FaultPlan after
    # (input, output) the launched engine connects to instead of the client's own
    # addresses: a proxy in between (model_tests/interposer.py) binds these.
    engine_connect: tuple[str, str] | None = None
    # seq/ack/CRC trailer on every message; a launched engine is told (runtime/integrity.py)
    frame_integrity: bool = False
    # get_output returns batches with token-only outputs left in their columns
    # (EngineCoreOutputs.stream_ids/stream_tokens) instead of one struct per token.
    columnar_outputs: bool = False
    shutdown_timeout_s: float | None = None
    transport: str = "ipc"
    curve: CurveConfig | None = None
    engine_curve: CurveConfig | None = None
    allow_insecure_tcp: bool = False
    engine_limits: Limits | None = None  # bounds on the launched engine's input
    # Starts the engine instead of a local one: (config type, encoded config, the engine's
    # keyword arguments, process name) -> a started process-like handle (``EngineLauncher``,
    # runtime/mp_client.py). The Ray backend places engines with one (ray_backend.py).
    engine_launcher: EngineLauncher | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        # A deadline the waits cannot hold (inf, nan, a negative one) would otherwise surface
        # later as a dead monitor or a hang.
        for name in ("engine_heartbeat_timeout_s", "engine_heartbeat_interval_s"):
            put(name, check_option_seconds(getattr(self, name), name))
        put("shutdown_timeout_s", check_option_seconds(
            self.shutdown_timeout_s, "shutdown_timeout_s", allow_zero=True))
        put("engine_startup_delay_s", check_option_seconds(
            self.engine_startup_delay_s, "engine_startup_delay_s", allow_zero=True) or 0.0)
        put("ready_timeout_s", _ready_timeout(self.ready_timeout_s))
        # Parsed here, not first in the spawned engine: a typo is a ValueError from the
        # constructor instead of an engine that dies while starting.
        put("engine_fault", as_plan(self.engine_fault))
        for name in ("launch_engine", "frame_integrity", "allow_insecure_tcp", "columnar_outputs"):
            check_option_flag(getattr(self, name), name)  # a str for a bool read as True
        for name in ("input_address", "output_address"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}={value!r}: must be an address str or None")
        connect = self.engine_connect
        if connect is not None and not (
                isinstance(connect, tuple | list) and len(connect) == 2
                and all(isinstance(a, str) for a in connect)):
            raise ValueError(f"engine_connect={connect!r}: must be an (input, output) pair of"
                             " address strs or None")
        for name in ("curve", "engine_curve"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, CurveConfig):
                raise ValueError(f"{name}={value!r}: must be a CurveConfig or None")
        if self.engine_limits is not None and not isinstance(self.engine_limits, Limits):
            raise ValueError(f"engine_limits={self.engine_limits!r}: must be a"
                             " protocol.codec.Limits or None")
        for name in ("engine_index", "client_index"):
            index = getattr(self, name)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 16:
                raise ValueError(f"{name}={index!r}: must be an integer in [0, 65535]")
        if self.engine_launcher is not None and not callable(self.engine_launcher):
            raise ValueError(f"engine_launcher={self.engine_launcher!r}: must be callable")
        if self.transport not in _TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: must be 'ipc' or 'tcp'")

    @property
    def ready_timeout(self) -> float:
        """The ready deadline in seconds (resolved at construction)."""
        assert self.ready_timeout_s is not None
        return self.ready_timeout_s

    @classmethod
    def of(cls, options: ClientOptions | None, overrides: dict[str, Any]) -> ClientOptions:
        """``options`` (or the defaults) with ``overrides`` applied; an unknown name is a
        TypeError, as for an unknown keyword argument."""
        if options is not None and not isinstance(options, ClientOptions):
            raise TypeError(f"options={options!r}: expected a ClientOptions")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected client option(s) {', '.join(unknown)}")
        if options is None:
            return cls(**overrides)
        return dataclasses.replace(options, **overrides) if overrides else options

    def given(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


def _ready_timeout(option: float | None) -> float:
    if option is not None:
        seconds = check_option_seconds(option, "ready_timeout_s")
        assert seconds is not None
        return seconds
    raw = os.environ.get(READY_TIMEOUT_ENV)
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(f"{READY_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"{READY_TIMEOUT_ENV}={raw!r}: must be a finite number of "
                             "seconds > 0")
        return seconds
    return DEFAULT_READY_TIMEOUT_S
