"""The clients' options as typed objects, checked once, before anything starts.

``ClientOptions`` holds every option of ``MPClient`` (and so of ``SyncMPClient``,
``AsyncMPClient`` and each engine of a data-parallel client). It is built from keyword
arguments (``make_client(cfg, multiprocess=True, asyncio=False, shutdown_timeout_s=5)``) or
passed whole (``options=ClientOptions(...)``, keywords then override its fields); either way
each field is checked in ``__post_init__``: a wrong type or an impossible value is a
``ValueError`` naming the option, an unknown name a ``TypeError`` as for any keyword, so a
typo never costs an engine start. Values are normalised there too (seconds as floats, a fault
spec as a ``FaultPlan``, the ready deadline resolved from the environment), so the client
reads them without checking again.

``DataParallelOptions`` is the same for the data-parallel client: its own options (restarts,
Ray placement, the per-engine addresses and faults) and the ``ClientOptions`` it gives every
engine, built from the same keywords (``DataParallelOptions.of``).

Each field carries a one-line doc (``_doc``); docs/options.md is generated from them
(``render_options_page``), so the page cannot drift from the records.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..protocol.limits import Limits
from .args import check_option_flag, check_option_seconds
from .faults import as_plan
from .ray_backend import STRATEGIES
from .security import CurveConfig

if TYPE_CHECKING:
    from .mp_client import EngineLauncher

__all__ = [
    "DEFAULT_READY_TIMEOUT_S",
    "DEFAULT_RESTART_LIMIT",
    "PER_ENGINE",
    "READY_TIMEOUT_ENV",
    "ClientOptions",
    "DataParallelOptions",
    "render_options_page",
]

READY_TIMEOUT_ENV = "ENGINEWIRE_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 120.0
_TRANSPORTS = ("ipc", "tcp")
DEFAULT_RESTART_LIMIT = 5


def _doc(text: str) -> dict[str, str]:
    """A field's one-line doc, as its metadata: the generated options table (docs/options.md)
    reads it, so a new option cannot be left out of the page."""
    return {"doc": text}


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """Every option of a subprocess client; docs/options.md (generated from these fields)
    says each."""

    ready_timeout_s: float | None = field(default=None, metadata=_doc(
        "the start-up deadline in seconds; `None` reads"
        f" `{READY_TIMEOUT_ENV}`, else {DEFAULT_READY_TIMEOUT_S:g} s"))
    engine_index: int = field(default=0, metadata=_doc(
        "the engine's rank in [0, 65535]: its identity on the ROUTER"))
    client_index: int = field(default=0, metadata=_doc(
        "this client's rank in [0, 65535], stamped on its requests"))
    input_address: str | None = field(default=None, metadata=_doc(
        "an address to bind the ROUTER (requests) on instead of a fresh one"))
    output_address: str | None = field(default=None, metadata=_doc(
        "an address to bind the PULL (outputs) on instead of a fresh one"))
    launch_engine: bool = field(default=True, metadata=_doc(
        "`False`: attach to an engine started elsewhere (runtime.md, \"Engines started"
        " elsewhere\")"))
    engine_heartbeat_timeout_s: float | None = field(default=None, metadata=_doc(
        "declare the engine dead after this long without a message; `None`: no deadline"
        " (death is seen from the process or the sentinel frame)"))
    engine_heartbeat_interval_s: float | None = field(default=None, metadata=_doc(
        "a launched engine's idle heartbeat period; `None`: a quarter of the timeout, or"
        " no heartbeat without one"))
    engine_startup_delay_s: float = field(default=0.0, metadata=_doc(
        "a test hook: the launched engine waits this long before its handshake"))
    engine_fault: Any = field(default=None, metadata=_doc(
        "a `FaultPlan`, `Fault` or `\"point:n\"` spec for the launched engine, parsed to a"
        " `FaultPlan` here (faults.md)"))
    # A proxy in between (model_tests/interposer.py) binds these.
    engine_connect: tuple[str, str] | None = field(default=None, metadata=_doc(
        "`(input, output)` the launched engine connects to instead of the client's own"
        " addresses, for a proxy in between (faults.md)"))
    frame_integrity: bool = field(default=False, metadata=_doc(
        "a sequence number and CRC-32 trailer on every message; a launched engine is"
        " told (runtime/integrity.py, faults.md)"))
    columnar_outputs: bool = field(default=False, metadata=_doc(
        "`get_output` returns token-only outputs in the batch's columns"
        " (`stream_ids`/`stream_tokens`) instead of one `EngineCoreOutput` each;"
        " presentation only: the engine runs the same either way (runtime.md)"))
    shutdown_timeout_s: float | None = field(default=None, metadata=_doc(
        "grace between SIGTERM and SIGKILL for `shutdown()` without a timeout; finite,"
        " `>= 0`; `None`: 5 s"))
    transport: str = field(default="ipc", metadata=_doc(
        "`\"ipc\"` (a private 0700 directory) or `\"tcp\"` (binds `127.0.0.1` unless"
        " addresses are given)"))
    curve: CurveConfig | None = field(default=None, metadata=_doc(
        "this side's `CurveConfig`; tcp is refused without it unless"
        " `allow_insecure_tcp` (security.md)"))
    engine_curve: CurveConfig | None = field(default=None, metadata=_doc(
        "the launched engine's `CurveConfig`; by default a launched engine over CURVE or"
        " tcp gets a fresh key pair"))
    allow_insecure_tcp: bool = field(default=False, metadata=_doc(
        "permit plain tcp (logged as a warning); never on an untrusted network"))
    engine_limits: Limits | None = field(default=None, metadata=_doc(
        "`protocol.codec.Limits` for the launched engine's input; `None`:"
        " `DEFAULT_LIMITS`"))
    # The Ray backend places engines with one (ray_backend.py).
    engine_launcher: EngineLauncher | None = field(default=None, metadata=_doc(
        "starts the engine instead of a local process: (config type, encoded config,"
        " the engine's keyword arguments, process name) -> a started process-like handle"
        " (`EngineLauncher`, runtime/mp_client.py)"))

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


# Options that name one engine's identity or launcher: the data-parallel client assigns them
# per engine (engine i gets engine_index i, and is started by the client's backend).
_ASSIGNED = ("engine_index", "engine_launcher")
# Options that name one engine's channel: a data-parallel client takes one per engine, in
# index order (engines started on their own, e.g. ``enginewire engine --engine-index i``).
PER_ENGINE = ("input_address", "output_address", "engine_connect")


@dataclass(frozen=True, kw_only=True)
class DataParallelOptions:
    """Every option of a data-parallel client (runtime/dp_client.py), checked at construction.

    Its own options, and ``engine_options``: the ``ClientOptions`` every engine's client gets,
    less what the client gives each engine itself (its index and launcher, its entry of the
    per-engine lists and of the per-engine ``engine_fault``). What depends on the engine
    count (the lists' lengths, the fault map's keys) is checked by ``check_engines``.
    """

    restart_dead_engines: bool = field(default=False, metadata=_doc(
        "start a replacement under a dead engine's index (`RESTARTING`, then `SERVING`"
        " after its handshake); requests that died are not replayed"))
    restart_limit: int = field(default=DEFAULT_RESTART_LIMIT, metadata=_doc(
        "an int >= 1: after this many replacements of one index in a row"
        " died soon after their start (crash-loop backoff between them), the index stays"
        " `DEAD`"))
    ray_placement_strategy: str = field(default="SPREAD", metadata=_doc(
        "the `\"ray\"` backend's placement group strategy: "
        + ", ".join(f"`\"{s}\"`" for s in STRATEGIES)))
    ray_address: str | None = field(default=None, metadata=_doc(
        "the Ray cluster the `\"ray\"` backend joins when this process has not joined"
        " one; `None`: `RAY_ADDRESS`, else a local one started for the client"))
    input_address: tuple[str, ...] | None = field(default=None, metadata=_doc(
        "one ROUTER address to bind per engine, in engine index order"))
    output_address: tuple[str, ...] | None = field(default=None, metadata=_doc(
        "one PULL address to bind per engine, in engine index order"))
    engine_connect: tuple[tuple[str, str] | None, ...] | None = field(
        default=None, metadata=_doc(
            "one `(input, output)` pair or `None` per engine, in engine index order: where"
            " that engine connects instead of its client's addresses (a proxy in between)"))
    engine_fault: Mapping[int, Any] | None = field(default=None, metadata=_doc(
        "`{index: fault}`: a fault for some engines only (the others get none), each"
        " parsed to a `FaultPlan` here; an index at or past `data_parallel_size` is the"
        " engine a `scale` adds there; one fault for every engine is"
        " `engine_options.engine_fault`"))
    engine_options: ClientOptions | None = field(default=None, metadata=_doc(
        "the `ClientOptions` of every engine's client; `None`: the defaults"))

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        check_option_flag(self.restart_dead_engines, "restart_dead_engines")
        limit = self.restart_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"restart_limit={limit!r}: the number of replacements of one"
                             " engine that may die at once in a row, an int >= 1")
        if self.ray_placement_strategy not in STRATEGIES:
            raise ValueError(f"ray_placement_strategy={self.ray_placement_strategy!r}: must be"
                             f" one of {', '.join(STRATEGIES)}")
        if self.ray_address is not None and not isinstance(self.ray_address, str):
            raise ValueError(f"ray_address={self.ray_address!r}: must be an address str or None")
        for name in PER_ENGINE:
            value = getattr(self, name)
            if value is None:
                continue
            pair = name == "engine_connect"
            if not isinstance(value, list | tuple) or not all(
                    (v is None or _is_pair(v)) if pair else isinstance(v, str) for v in value):
                each = "(input, output) pairs of address strs or None" if pair else "address strs"
                raise ValueError(
                    f"{name}={value!r}: a data-parallel client takes one per engine, a list"
                    f" of {each} in engine index order")
            put(name, tuple(None if v is None else tuple(v) for v in value) if pair
                else tuple(value))
        faults = self.engine_fault
        if faults is not None:
            if not isinstance(faults, Mapping):
                raise ValueError(f"engine_fault={faults!r}: the per-engine form is a mapping"
                                 " {index: fault}; one fault for every engine is"
                                 " engine_options.engine_fault")
            bad = sorted((k for k in faults if not isinstance(k, int) or isinstance(k, bool)
                          or k < 0), key=repr)
            if bad:
                raise ValueError(f"engine_fault: keys {bad!r} are not engine indexes")
            # Parsed here, as ClientOptions parses its own: a typo costs no engine start.
            put("engine_fault", MappingProxyType({k: as_plan(faults[k]) for k in sorted(faults)}))
        engine = self.engine_options
        if engine is None:
            return
        if not isinstance(engine, ClientOptions):
            raise TypeError(f"engine_options={engine!r}: expected a ClientOptions")
        _refuse_assigned(engine.given())
        for name in PER_ENGINE:
            value = getattr(engine, name)
            if value is not None:
                raise ValueError(
                    f"{name}={value!r}: a data-parallel client takes one per engine, a list"
                    " in engine index order")
        if faults is not None and engine.engine_fault is not None:
            raise ValueError("engine_fault: given for every engine (engine_options) and per"
                             " engine; give one of them")

    @classmethod
    def of(cls, options: ClientOptions | DataParallelOptions | None,
           overrides: dict[str, Any]) -> DataParallelOptions:
        """``options`` (or the defaults) with ``overrides`` applied: the keywords of a
        data-parallel client. A ``ClientOptions`` given whole is every engine's; a keyword
        that names a field of this record sets it (``engine_fault`` only in its per-engine
        mapping form), every other one a field of ``engine_options``, so an unknown name is
        ``ClientOptions``' TypeError."""
        if options is not None and not isinstance(options, ClientOptions | DataParallelOptions):
            raise TypeError(
                f"options={options!r}: expected a ClientOptions or a DataParallelOptions")
        _refuse_assigned(overrides)  # before ClientOptions checks them: say why they are refused
        base = options if isinstance(options, DataParallelOptions) else cls(
            engine_options=options)
        own = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in overrides.items() if k in own}
        rest = {k: v for k, v in overrides.items() if k not in own}
        engine = mine.pop("engine_options", base.engine_options)
        if "engine_fault" in mine and not isinstance(mine["engine_fault"], Mapping):
            rest["engine_fault"] = mine.pop("engine_fault")  # one fault for every engine
        # A keyword overrides the object: the per-engine form replaces the common one and
        # the other way round, as any other keyword replaces a field.
        if "engine_fault" in mine and engine is not None:
            rest.setdefault("engine_fault", None)
        if "engine_fault" in rest:
            mine.setdefault("engine_fault", None)
        if rest:
            engine = ClientOptions.of(engine, rest)
        if not mine and engine is base.engine_options:
            return base
        return dataclasses.replace(base, **mine, engine_options=engine)

    def check_engines(self, n: int) -> None:
        """``ValueError`` unless every per-engine list fits ``n`` engines (the fault map may
        name indexes a scale adds later)."""
        for name in PER_ENGINE:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"{name}={list(value)!r}: a data-parallel client takes one per engine, a"
                    f" list of {n} in engine index order")

    def for_engine(self, index: int) -> dict[str, Any]:
        """What engine ``index``'s client gets beside ``engine_options``: its entries of the
        per-engine options."""
        given: dict[str, Any] = {name: getattr(self, name)[index] for name in PER_ENGINE
                                 if getattr(self, name) is not None}
        if self.engine_fault is not None:
            given["engine_fault"] = self.engine_fault.get(index)
        return given

    def given(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


def _refuse_assigned(options: Mapping[str, Any]) -> None:
    for name in _ASSIGNED:
        if name in options:
            raise ValueError(
                f"{name}: a data-parallel client assigns each engine its own (engine i gets"
                " engine_index i, and is started by the client's backend)")


def _is_pair(value: object) -> bool:
    return (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(a, str) for a in value))


def _cell(text: str) -> str:
    # A "|" splits a table cell even inside a code span (GitHub's tables): escape it.
    return text.replace("|", "\\|")


def _default(value: Any) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def render_options_page() -> str:
    """The text of ``docs/options.md``: one row per field of each options record, its type,
    default and doc as the record declares them."""
    rows = [
        "<!-- AUTOGENERATED by `python -m enginewire._tools.generate` from runtime/options.py;"
        " do not edit. -->",
        "# Client options",
        "",
        "`make_client(cfg, multiprocess=..., asyncio=..., **options)` passes the options to the",
        "client; docs/runtime.md (\"Client options\") says how they are given and checked. Each",
        "row is a field of an options record in `enginewire.runtime` (runtime/options.py), with",
        "the type, default and doc the record declares.",
    ]
    for cls, intro in (
        (ClientOptions, "Every option of a subprocess client (`SyncMPClient`,"
                        " `AsyncMPClient`),\nand of each engine's client of a data-parallel"
                        " one."),
        (DataParallelOptions, "The data-parallel client's own (`EngineConfig.data_parallel_size"
                              " > 1`, or\n`restart_dead_engines=True`); any other keyword"
                              " sets a field of its `engine_options`."),
    ):
        rows += ["", f"## `{cls.__name__}`", "", intro, "",
                 "| option | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            rows.append(f"| `{f.name}` | `{_cell(str(f.type))}` | {_cell(_default(f.default))}"
                        f" | {_cell(f.metadata['doc'])} |")
    return "\n".join(rows) + "\n"


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
