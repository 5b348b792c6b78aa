"""Code an engine process runs before it builds its engine: ``ENGINEWIRE_ENGINE_PRELOAD``.

Why
---
An engine runs in a process its client starts (``python -c``, runtime/engine_launch.py), in
one ``enginewire engine`` starts, in a ``multiprocessing`` child or under a Ray actor. Code
that must run inside every one of them (a profiler, a tracer, instrumentation; the testing
package's seeded bugs) cannot be passed as an argument through all of those launchers, but an
environment variable reaches each: engine processes inherit it.

``ENGINEWIRE_ENGINE_PRELOAD`` holds comma-separated ``module:callable`` entries (the callable
may be dotted: ``package.module:Class.method``). ``run_engine_core`` imports and calls each,
in order, with no arguments, before it builds the engine (and before the parent watch starts),
once per process. An entry that cannot be imported or is not callable, or one that raises,
fails the start with ``EngineStartupError`` naming the entry, which the launching client
raises (or ``enginewire engine`` prints) like any other start-up failure. A Ray actor's engine
sees the environment of Ray's workers: a local cluster the client starts inherits this
process's; a remote one needs the variable set in its own.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

from ..spec.errors import EngineStartupError

__all__ = ["PRELOAD_ENV", "run_preloads"]

PRELOAD_ENV = "ENGINEWIRE_ENGINE_PRELOAD"

# Entries already called in this process: an engine served in a thread of a process that
# ran one before (tests, an embedding program) does not run its preloads twice.
_done: set[str] = set()
_lock = threading.Lock()


def _resolve(entry: str) -> Any:
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise EngineStartupError(f"{PRELOAD_ENV}: {entry!r} is not 'module:callable'")
    try:
        obj: Any = importlib.import_module(module_name.strip())
    except ImportError as e:
        # Not chained: a one-line report shows the root cause, which would lose the entry.
        raise EngineStartupError(
            f"{PRELOAD_ENV}: cannot import {module_name.strip()!r} ({entry!r}): {e}") from None
    for part in attr.strip().split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EngineStartupError(
                f"{PRELOAD_ENV}: {entry!r}: no attribute {part!r}") from None
    if not callable(obj):
        raise EngineStartupError(
            f"{PRELOAD_ENV}: {entry!r} is a {type(obj).__name__}, not a callable")
    return obj


def run_preloads(value: str | None = None) -> None:
    """Import and call every entry of ``value`` (default: ``ENGINEWIRE_ENGINE_PRELOAD``) not
    yet called in this process; ``EngineStartupError`` on the first that fails."""
    if value is None:
        value = os.environ.get(PRELOAD_ENV, "")
    entries = [e.strip() for e in value.split(",") if e.strip()]
    with _lock:
        for entry in entries:
            if entry in _done:
                continue
            func = _resolve(entry)
            try:
                func()
            except Exception as e:
                raise EngineStartupError(
                    f"{PRELOAD_ENV}: {entry!r} raised {type(e).__name__}: {e}") from e
            _done.add(entry)
