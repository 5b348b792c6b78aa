"""The utility methods, each declared once: name, arguments, result, power effect.

Theory of operation
-------------------
A utility is a remote call on the engine (``UTILITY`` message, one reply). Everything that
names one comes from the ``UTILITIES`` tuple below: the engine's allow-list and dispatch
(``EngineCore.UTILITY_METHODS``, by method name), the typed wrappers of every client, sync
and async (generated into ``runtime/_utilities.py`` by ``render_wrappers``), the methods whose
reply moves the client's lifecycle (``power``, a ``spec.client.PowerReply``), the table in
``docs/utilities.md`` and the tests that call every wrapper (``example``). Adding a utility is
one entry here, the engine method of the same name, and ``python -m
enginewire._tools.generate``; the freshness check in CI fails until the last step is done.

A declaration holds data and functions, never source text. What a wrapper does beyond sending
its parameters is a module-level function declared here (``check``, ``wire``) or a type
(``convert``); the generated wrapper imports it by name and calls it, once, so the common
path (``echo``: nothing to check or convert) has no call beyond the send. The parameters'
annotations and defaults are the generated ``def`` line's text, nothing more.

Pure data, checks and text generation, no I/O (``enginewire._tools.generate`` writes the
files).
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from os import PathLike, fspath
from types import FunctionType
from typing import Any, get_args, get_origin, get_type_hints

from ..spec.client import RESUMED, SLEPT, WOKE, PowerReply
from ..spec.engine import PAUSE_EVENTS

# Imported here so that every peer that knows the utilities has registered their records.
from . import records

__all__ = [
    "BY_NAME",
    "COMBINERS",
    "LOOP_THREAD_METHODS",
    "PAUSE_MODES",
    "POWER_METHODS",
    "REMOTE_METHODS",
    "SLEEP_LEVELS",
    "UTILITIES",
    "Param",
    "Utility",
    "check_sleep_args",
    "collective_rpc_args",
    "optional_str",
    "profile_args",
    "render_utilities_page",
    "render_wrappers",
    "wake_up_args",
]


# The argument domains of pause_scheduler and sleep (the modes are the engine machine's pause
# events, spec/engine.py).
PAUSE_MODES: tuple[str, ...] = tuple(PAUSE_EVENTS)
SLEEP_LEVELS: tuple[int, ...] = (0, 1, 2)


# --- what the wrappers call: checks, wire arguments, results -------------------------------
# A bad argument is refused here, by every client alike, with a ``TypeError`` or
# ``ValueError`` that names it, before anything is sent or any state changes; the engine would
# refuse most of them too, but only after a round trip and as a ``UtilityError`` blaming the
# call. Each takes the wrapper's parameters, by the declared names (checked below).


def check_sleep_args(level: int, mode: str) -> None:
    """``sleep``'s check: a level of ``SLEEP_LEVELS`` and a mode of ``PAUSE_MODES``."""
    # type(): True and 1.0 compare equal to 1 but are not levels (sleep(True) reached the
    # engine and came back as a UtilityError).
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
    if mode not in PAUSE_MODES:
        raise ValueError(f"sleep mode must be one of {PAUSE_MODES}, got {mode!r}")


def collective_rpc_args(method: str, args: Iterable[Any], kwargs: dict[str, Any] | None
                        ) -> tuple[str, list[Any], dict[str, Any]]:
    """``collective_rpc``'s wire arguments: the positional ones as a list, the keyword ones as
    a dict (``None``: none)."""
    return method, list(args), dict(kwargs or {})


def profile_args(is_start: Any, path: Any) -> tuple[str, str | None]:
    """``profile``'s wire arguments; a non-bool start flag (profile("stop") would start it)
    or a path that is not a str/PathLike is refused before anything is sent."""
    if not isinstance(is_start, bool):
        raise TypeError(f"profile(is_start) must be True or False, got {is_start!r}")
    if path is not None and not isinstance(path, (str, PathLike)):
        raise TypeError(f"profile(path) must be a str, a PathLike or None, got {path!r}")
    return ("start" if is_start else "stop"), (None if path is None else fspath(path))


def wake_up_args(tags: Any) -> tuple[list[str] | None]:
    """``wake_up``'s wire argument: ``None`` (everything) or a list of memory tags; a bare str
    is refused, not split."""
    if tags is None:
        return (None,)
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise TypeError(f"wake_up tags must be a list such as ['weights'] or None, got {tags!r}")
    return (list(tags),)


def optional_str(result: Any) -> str | None:
    """A reply that is a str or None (``profile``: the trace file's path when it stopped)."""
    return None if result is None else str(result)


@dataclass(frozen=True)
class Param:
    """One argument of a wrapper, as its signature spells it: the generated ``def`` line's
    text (a literal default, never an expression that computes)."""

    name: str
    annotation: str
    default: str | None = None  # the default's source text; None: required


@dataclass(frozen=True)
class Utility:
    """One utility method.

    ``check`` and ``wire`` are module-level functions of the wrapper's parameters (by the
    declared names): ``check`` raises on a bad argument before anything is sent; ``wire``
    returns the arguments sent, in order, annotated as a tuple of a fixed length (checks that
    need the converted value raise there too), and without it the parameters are sent as
    given. ``convert`` makes the wrapper's
    return value from the reply (a type such as ``bool``, or a function); without it the reply
    is returned as it came, and a wrapper that ``returns`` ``"None"`` returns nothing."""

    name: str
    params: tuple[Param, ...]
    returns: str
    doc: str
    wire: Callable[..., tuple[Any, ...]] | None = None
    convert: Callable[[Any], Any] | None = None
    check: Callable[..., None] | None = None
    power: PowerReply | None = None
    remote: bool = True  # on the engine's allow-list
    # Served on the engine's loop thread only, never on the idle fast path of its input
    # thread: torch's profiler must start, stop and export on one thread (else SIGSEGV).
    loop_thread: bool = False
    timeout_positional: bool = False  # echo(value, timeout): kept as it always was
    # On a data-parallel client (runtime/dp_client.py): None goes to one serving engine; a
    # name sends it to every serving engine and combines the replies (in index order) as
    # ``COMBINERS`` says: "all" their truth, "any" whether one is true, "none" nothing,
    # "first" the first one, "each" the list of them.
    every_engine: str | None = None
    example: tuple[object, ...] | None = ()  # arguments safe on any engine; None: none are


# How a reply per engine becomes one (see ``Utility.every_engine``).
COMBINERS: frozenset[str] = frozenset({"all", "any", "none", "first", "each"})

UTILITIES: tuple[Utility, ...] = (
    Utility("echo", (Param("value", "Any"),), "Any",
            "Send ``value`` to the engine and back (a round trip, for liveness and tests).",
            timeout_positional=True, example=(1,)),
    Utility("collective_rpc", (
        Param("method", "str"),
        Param("args", "tuple[Any, ...] | list[Any]", "()"),
        Param("kwargs", "dict[str, Any] | None", "None"),
    ), "list[Any]", "Call a worker RPC method on every worker; one result per worker.",
        wire=collective_rpc_args, example=("report_memory",)),
    Utility("profile", (
        Param("is_start", "bool", "True"), Param("path", "str | None", "None"),
    ), "str | None", "Start the engine's profiler, or stop it and get the trace file's path;"
        " without a path, traces go to a 0700 directory of the engine's user, and a directory"
        " another user owns or can write is refused (docs/security.md).",
        wire=profile_args, convert=optional_str, example=None, loop_thread=True,
        every_engine="first"),
    Utility("reset_prefix_cache", (), "bool",
            "Drop every cached prefix block; True when the cache was reset.",
            convert=bool, every_engine="all"),
    Utility("save_sharded_state", (Param("path", "str"),), "list[str]",
            "Write the weights under ``path`` (on the engine's host); return the files.",
            convert=list, example=None),
    Utility("get_stats", (), "EngineStats",
            "The scheduler's counters, the KV cache's usage and the engine's state."),
    Utility("audit_resources", (), "ResourceAudit | list[ResourceAudit]",
            "Read-only: the engine's resource accounting recounted (KV blocks, queues, pending"
            " outputs and replies, memory asleep), for a campaign's quiescence check; one per"
            " engine, in index order, on a data-parallel client.",
            every_engine="each"),
    Utility("drain_trace", (), "TraceDrain | list[TraceDrain]",
            "Trace mode only: the engine's lifecycle records (engine, engine_request, session)"
            " since the last call, in its order, as columns, with how many were dropped past"
            " its bound and its state now (one per engine, in index order, on a data-parallel"
            " client); a UtilityError when the engine records no trace.",
            example=None, every_engine="each"),
    Utility("pause_scheduler", (Param("mode", "str", '"abort"'),), "None",
            "Stop scheduling; ``mode`` says what happens to requests in flight.",
            power=SLEPT, example=("abort",),
            every_engine="none"),
    Utility("resume_scheduler", (), "None", "Resume scheduling after a pause.",
            power=RESUMED, every_engine="none"),
    Utility("sleep", (Param("level", "int", "1"), Param("mode", "str", '"abort"')), "None",
            "Pause, then release memory: level 0 nothing, 1 weights offloaded and KV freed,"
            " 2 both freed.",
            check=check_sleep_args, power=SLEPT, example=(0, "abort"), every_engine="none"),
    Utility("wake_up", (Param("tags", "list[str] | None", "None"),), "bool",
            "Restore the memory ``tags`` (all by default); True when fully awake.",
            wire=wake_up_args, convert=bool, power=WOKE,
            example=(None,), every_engine="all"),
    Utility("is_sleeping", (), "bool",
            "Whether the engine is paused, draining for a pause, or any memory is asleep.",
            # A data-parallel client sleeps while any serving engine does (CLIENT_ASLEEP).
            convert=bool, every_engine="any"),
)

BY_NAME: dict[str, Utility] = {u.name: u for u in UTILITIES}


def _declaration_errors(u: Utility) -> list[str]:
    """What is wrong with ``u``, each as a sentence that names the fix (none: it is sound)."""
    errors: list[str] = []
    if u.every_engine is not None and u.every_engine not in COMBINERS:
        errors.append(f"every_engine={u.every_engine!r} is not one of {sorted(COMBINERS)}")
    if u.power is not None and u.every_engine is None:
        # One engine asleep and the others awake is no state the client machine has.
        errors.append("a power utility must apply to every engine")
    if u.returns == "None" and u.convert is not None:
        errors.append("a wrapper that returns None converts nothing: drop convert")
    names = [p.name for p in u.params]
    for role in ("check", "wire"):
        fn = getattr(u, role)
        if fn is None:
            continue
        if not (isinstance(fn, FunctionType) and fn.__qualname__ == fn.__name__):
            errors.append(f"{role}={fn!r} must be a module-level function (the generated"
                          " wrapper imports it by name)")
            continue
        got = list(inspect.signature(fn).parameters)
        if got != names:
            errors.append(f"{role} {fn.__name__}{tuple(got)} must take the wrapper's"
                          f" parameters {tuple(names)}, in order")
        elif role == "wire" and wire_arity(fn) is None:
            errors.append(f"wire {fn.__name__} must be annotated to return a tuple of a fixed"
                          " length, such as -> tuple[str, str | None]")
    return errors


def wire_arity(wire: Callable[..., tuple[Any, ...]]) -> int | None:
    """How many arguments ``wire`` sends, from its return annotation ``tuple[A, B, ...]``
    (None: not a tuple of a fixed length). The generated wrapper unpacks that many into the
    call: a ``*``-call with ``timeout=`` costs a dict and a tuple more on every call."""
    try:
        hint = get_type_hints(wire).get("return")
    except (NameError, TypeError):
        return None
    args = get_args(hint)
    if get_origin(hint) is not tuple or not args or Ellipsis in args or args == ((),):
        return None
    return len(args)


for _u in UTILITIES:
    for _error in _declaration_errors(_u):
        raise ValueError(f"utility {_u.name}: {_error}")
REMOTE_METHODS: frozenset[str] = frozenset(u.name for u in UTILITIES if u.remote)
POWER_METHODS: frozenset[str] = frozenset(u.name for u in UTILITIES if u.power is not None)
LOOP_THREAD_METHODS: frozenset[str] = frozenset(u.name for u in UTILITIES if u.loop_thread)


# --- the generated wrappers (runtime/_utilities.py) ----------------------------------------

_GENERATOR = "python -m enginewire._tools.generate"
_WIDTH = 100  # ruff's line length: the generated file is linted like the rest
# Where the generated module sits: a function of ours is imported relative to it.
_WRAPPERS_PACKAGE = "enginewire.runtime"


def _reference(fn: Callable[..., Any]) -> tuple[str | None, str]:
    """The module the generated wrappers import ``fn`` from (None: a builtin) and its name
    there; a ValueError unless that module's attribute of that name is ``fn`` itself."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "builtins" and getattr(builtins, name, None) is fn:
        return None, name
    found = sys.modules.get(module or "")
    if not (module and module.startswith("enginewire.") and getattr(found, name, None) is fn):
        raise ValueError(f"render_wrappers: {fn!r} is not a builtin or a module-level name of"
                         " an enginewire module; declare it at the top level of one")
    return module, name


def _relative(module: str) -> str:
    """``module`` as the generated module (in ``_WRAPPERS_PACKAGE``) imports it."""
    here = _WRAPPERS_PACKAGE.split(".")
    there = module.split(".")
    common = 0
    while common < min(len(here), len(there)) and here[common] == there[common]:
        common += 1
    return "." * (len(here) - common + 1) + ".".join(there[common:])


def _imports(module: str, names: list[str]) -> list[str]:
    """``from module import names``, wrapped one name a line when too long (as isort does)."""
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= _WIDTH:
        return [line]
    return [f"from {module} import (", *(f"    {n}," for n in names), ")"]


def _signature(u: Utility, *, is_async: bool) -> list[str]:
    parts = ["self"]
    for p in u.params:
        parts.append(f"{p.name}: {p.annotation}" + ("" if p.default is None else f" = {p.default}"))
    if not u.timeout_positional:
        parts.append("*")
    parts.append("timeout: float | None = None")
    name = f"{u.name}_async" if is_async else u.name
    prefix = "async def" if is_async else "def"
    line = f"    {prefix} {name}({', '.join(parts)}) -> {u.returns}:"
    if len(line) <= _WIDTH:
        return [line]
    return [f"    {prefix} {name}(", *(f"        {p}," for p in parts), f"    ) -> {u.returns}:"]


def _statement(head: str, call: str, args: str) -> list[str]:
    """``head + call(args)``, broken after the opening parenthesis when too long."""
    line = f"        {head}{call}({args})"
    if len(line) <= _WIDTH:
        return [line]
    return [f"        {head}{call}(", f"            {args}", "        )"]


def _body(u: Utility, *, is_async: bool) -> list[str]:
    doc = textwrap.wrap(u.doc, _WIDTH - 11)
    if len(doc) == 1:
        lines = [f'        """{doc[0]}"""']
    else:
        lines = [f'        """{doc[0]}', *(f"        {d}" for d in doc[1:]), '        """']
    params = ", ".join(p.name for p in u.params)
    if u.check is not None:
        lines.append(f"        {_reference(u.check)[1]}({params})")
    call = "await self.call_utility_async" if is_async else "self.call_utility"
    if u.wire is not None:
        arity = wire_arity(u.wire)
        assert arity is not None, u.name  # _declaration_errors
        names = [f"sent{i}" for i in range(arity)]
        if set(names) & {p.name for p in u.params}:
            raise ValueError(f"render_wrappers: {u.name}: a parameter named sent<N> would be"
                             " overwritten by the wire arguments; rename it")
        target = ", ".join(names) if arity > 1 else f"({names[0]},)"
        lines.append(f"        {target} = {_reference(u.wire)[1]}({params})")
        sent = ", ".join(names)
    else:
        sent = params
    args = ", ".join(a for a in (f'"{u.name}"', sent, "timeout=timeout") if a)
    if u.returns == "None":
        lines += _statement("", call, args)
    elif u.convert is None:
        lines += _statement(f"result: {u.returns} = ", call, args)
        lines.append("        return result")
    else:
        lines += _statement("result = ", call, args)
        lines.append(f"        return {_reference(u.convert)[1]}(result)")
    return lines


def _records_named() -> list[str]:
    """The record types (protocol/records.py) some utility's result names, sorted."""
    return [name for name in sorted(records.__all__)
            if any(re.search(rf"\b{name}\b", u.returns) for u in UTILITIES)]


def _functions_named() -> dict[str, list[str]]:
    """The modules (as the generated module imports them) of the functions the declarations
    name, each with those names, sorted."""
    found: dict[str, set[str]] = {}
    for u in UTILITIES:
        for fn in (u.check, u.wire, u.convert):
            if fn is None:
                continue
            module, name = _reference(fn)
            if module is not None:
                found.setdefault(_relative(module), set()).add(name)
    return {module: sorted(names) for module, names in sorted(found.items())}


def _stable(value: object) -> str:
    """``repr(value)``, with a function named by where it lives (its repr holds an address)."""
    if isinstance(value, FunctionType):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def fingerprint() -> str:
    """A stable hash of the declarations: the generated files carry it as their stamp."""
    text = repr([[f"{f.name}={_stable(getattr(u, f.name))}" for f in fields(u)]
                 for u in UTILITIES])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def render_wrappers() -> str:
    """The text of ``runtime/_utilities.py``: the sync and the async wrapper sets."""
    imports = {"..protocol.records": _records_named(), **_functions_named()}
    out = [
        f"# AUTOGENERATED by `{_GENERATOR}` from protocol/utilities.py.",
        "# ALL EDITS WILL BE LOST.",
        f"# stamp {fingerprint()}",
        '"""The typed utility wrappers of every client, generated from the one declaration of'
        " each\nutility (``protocol/utilities.py``): ``SyncUtilityMethods`` over ``call_utility``"
        " and\n``AsyncUtilityMethods`` over ``call_utility_async``. The client's lifecycle"
        " follows the\nreplies of the power utilities where replies are routed"
        ' (``_on_power_reply``)."""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Any",
        "",
        *(line for module in sorted(imports) for line in _imports(module, imports[module])),
        "",
        '__all__ = ["AsyncUtilityMethods", "SyncUtilityMethods"]',
        "",
    ]
    for is_async in (False, True):
        cls = "AsyncUtilityMethods" if is_async else "SyncUtilityMethods"
        out += ["", f"class {cls}:"]
        out.append(f'    """Every utility wrapper, {"async" if is_async else "sync"}."""')
        out.append("")
        base = "call_utility_async" if is_async else "call_utility"
        prefix = "async def" if is_async else "def"
        out.append(f"    {prefix} {base}(")
        out.append("        self, method: str, *args: Any, timeout: float | None = None")
        out.append("    ) -> Any:")
        out.append("        raise NotImplementedError")
        for u in UTILITIES:
            out += ["", *_signature(u, is_async=is_async), *_body(u, is_async=is_async)]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def render_utilities_page() -> str:
    """The text of ``docs/utilities.md``: one row per utility."""
    rows = [
        f"<!-- AUTOGENERATED by `{_GENERATOR}` from protocol/utilities.py; do not edit. -->",
        "# Utility methods",
        "",
        "Each is a remote call on the engine with exactly one reply; every client has the",
        "sync wrapper (`client.NAME(...)`) and the async client its twin",
        "(`await client.NAME_async(...)`), each taking `timeout=` too. `call_utility(name,"
        " *args)`",
        "reaches the same methods untyped. A *power* utility's reply moves the client's"
        " lifecycle",
        "(`docs/spec.md`, machine `client`).",
        "",
        "On a data-parallel client a call goes to one serving engine, or, where *engines* says",
        "how the replies combine, to every serving engine (`call_utility_all` returns each).",
        "",
        "| method | arguments | returns | power effect | engines | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for u in UTILITIES:
        args = ", ".join(f"`{p.name}: {p.annotation}`" + ("" if p.default is None else
                                                          f" = `{p.default}`")
                         for p in u.params) or "none"
        if u.power is None:
            power = "none"
        elif u.power.guard_from_result:
            power = f"`{u.power.event.name}` (guard from the result)"
        else:
            power = f"`{u.power.event.name}`" + (f" [{u.power.guard}]" if u.power.guard else "")
        doc = u.doc.replace("``", "`")
        engines = "one" if u.every_engine is None else f"every ({u.every_engine})"
        cells = (f"`{u.name}`", args, f"`{u.returns}`", power, engines, doc)
        # A union's bar would end the cell: escaped, GitHub shows it (code spans too).
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
