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
enginewire.testing.generate``; the freshness check in CI fails until the last step is done.

Pure text generation, no I/O (``enginewire.testing.generate`` writes the files).
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from dataclasses import dataclass

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
    "render_utilities_page",
    "render_wrappers",
]


# The argument domains of pause_scheduler and sleep (the modes are the engine machine's pause
# events, spec/engine.py).
PAUSE_MODES: tuple[str, ...] = tuple(PAUSE_EVENTS)
SLEEP_LEVELS: tuple[int, ...] = (0, 1, 2)


@dataclass(frozen=True)
class Param:
    """One argument of a wrapper, as its signature spells it."""

    name: str
    annotation: str
    default: str | None = None  # the default's source text; None: required


@dataclass(frozen=True)
class Utility:
    """One utility method. ``wire`` is the argument list sent (an expression over the
    parameters; checks that raise before sending go there too), ``convert`` the wrapper's
    return value as an expression over ``result``."""

    name: str
    params: tuple[Param, ...]
    returns: str
    doc: str
    wire: str = ""
    convert: str = "result"
    check: str | None = None  # a statement run before the call (it raises on bad input)
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
            wire="value", timeout_positional=True, example=(1,)),
    Utility("collective_rpc", (
        Param("method", "str"),
        Param("args", "tuple[Any, ...] | list[Any]", "()"),
        Param("kwargs", "dict[str, Any] | None", "None"),
    ), "list[Any]", "Call a worker RPC method on every worker; one result per worker.",
        wire="method, list(args), dict(kwargs or {})", example=("report_memory",)),
    Utility("profile", (
        Param("is_start", "bool", "True"), Param("path", "str | None", "None"),
    ), "str | None", "Start the engine's profiler, or stop it and get the trace file's path;"
        " without a path, traces go to a 0700 directory of the engine's user, and a directory"
        " another user owns or can write is refused (docs/security.md).",
        wire="*profile_args(is_start, path)",
        convert="None if result is None else str(result)", example=None, loop_thread=True,
        every_engine="first"),
    Utility("reset_prefix_cache", (), "bool",
            "Drop every cached prefix block; True when the cache was reset.",
            convert="bool(result)", every_engine="all"),
    Utility("save_sharded_state", (Param("path", "str"),), "list[str]",
            "Write the weights under ``path`` (on the engine's host); return the files.",
            wire="path", convert="list(result)", example=None),
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
            wire="mode", convert="None", power=SLEPT, example=("abort",),
            every_engine="none"),
    Utility("resume_scheduler", (), "None", "Resume scheduling after a pause.",
            convert="None", power=RESUMED, every_engine="none"),
    Utility("sleep", (Param("level", "int", "1"), Param("mode", "str", '"abort"')), "None",
            "Pause, then release memory: level 0 nothing, 1 weights offloaded and KV freed,"
            " 2 both freed.",
            wire="level, mode", convert="None", check="check_sleep_args(level, mode)",
            power=SLEPT, example=(0, "abort"), every_engine="none"),
    Utility("wake_up", (Param("tags", "list[str] | None", "None"),), "bool",
            "Restore the memory ``tags`` (all by default); True when fully awake.",
            wire="check_wake_tags(tags)", convert="bool(result)", power=WOKE,
            example=(None,), every_engine="all"),
    Utility("is_sleeping", (), "bool",
            "Whether the engine is paused, draining for a pause, or any memory is asleep.",
            # A data-parallel client sleeps while any serving engine does (CLIENT_ASLEEP).
            convert="bool(result)", every_engine="any"),
)

BY_NAME: dict[str, Utility] = {u.name: u for u in UTILITIES}
for _u in UTILITIES:
    if _u.every_engine is not None and _u.every_engine not in COMBINERS:
        raise ValueError(f"utility {_u.name}: every_engine={_u.every_engine!r} is not one of"
                         f" {sorted(COMBINERS)}")
    if _u.power is not None and _u.every_engine is None:
        # One engine asleep and the others awake is no state the client machine has.
        raise ValueError(f"utility {_u.name}: a power utility must apply to every engine")
REMOTE_METHODS: frozenset[str] = frozenset(u.name for u in UTILITIES if u.remote)
POWER_METHODS: frozenset[str] = frozenset(u.name for u in UTILITIES if u.power is not None)
LOOP_THREAD_METHODS: frozenset[str] = frozenset(u.name for u in UTILITIES if u.loop_thread)


_WIDTH = 100  # ruff's line length: the generated file is linted like the rest


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
    if u.check:
        lines.append(f"        {u.check}")
    call = "await self.call_utility_async" if is_async else "self.call_utility"
    args = f'"{u.name}", {u.wire}, timeout=timeout' if u.wire else f'"{u.name}", timeout=timeout'
    if u.convert == "result":
        lines += _statement(f"result: {u.returns} = ", call, args)
        lines.append("        return result")
    elif u.convert == "None":
        lines += _statement("", call, args)
    else:
        lines += _statement("result = ", call, args)
        lines.append(f"        return {u.convert}")
    return lines


def _records_named() -> list[str]:
    """The record types (protocol/records.py) some utility's result names, sorted."""
    return [name for name in sorted(records.__all__)
            if any(re.search(rf"\b{name}\b", u.returns) for u in UTILITIES)]


def fingerprint() -> str:
    """A stable hash of the declarations: the generated files carry it as their stamp."""
    return hashlib.sha256(repr(UTILITIES).encode()).hexdigest()[:16]


def render_wrappers() -> str:
    """The text of ``runtime/_utilities.py``: the sync and the async wrapper sets."""
    out = [
        "# AUTOGENERATED by `python -m enginewire.testing.generate` from protocol/utilities.py.",
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
        "from ..protocol.records import " + ", ".join(_records_named()),
        "from .args import check_sleep_args, check_wake_tags, profile_args",
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
    # ``check_*`` helpers are referenced only where a declaration uses them.
    text = "\n".join(out).rstrip("\n") + "\n"
    for helper in ("check_sleep_args", "check_wake_tags", "profile_args"):
        if text.count(helper) == 1:
            raise ValueError(f"render_wrappers: {helper} is imported but no utility uses it")
    return text


def render_utilities_page() -> str:
    """The text of ``docs/utilities.md``: one row per utility."""
    rows = [
        "<!-- AUTOGENERATED by `python -m enginewire.testing.generate` from"
        " protocol/utilities.py; do not edit. -->",
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
