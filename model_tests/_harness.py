"""The harness's two shared primitives: one bounded wait, and one definition of what a test
leaves behind.

Theory of operation
-------------------
``wait_until(predicate, bound)`` is the harness's one poll loop. It asks ``predicate`` until it
holds or ``bound`` seconds have passed (and once more at the end, so a slow poll never costs
a result that came in time): ``True`` or ``False``; given ``what``, a timeout is an
``AssertionError`` saying ``"<what> not seen within <bound> s"`` instead. The conformance
suite, the oracle's teardown checks, the fault matrix and the stateful machines wait with it.

``ResourceSnapshot.take()`` records what this process holds before a test builds a client,
and ``left_behind(before)`` what is still there, ``bound`` seconds after the test ended,
that was not there before (it waits for things to go, then reports what stayed). The
oracle's ``check_released`` and ``check_reaped``, the fault matrix's cells and
``check_construction_failure_leaks_nothing`` all judge by it. What counts, once:

* a *process*: a child of this process at any depth, running or a zombie of ours (it exited
  and nobody reaped it; a zombie grandchild is its own parent's to reap, not ours), except
  multiprocessing's resource tracker, which is started once per process and kept;
* a *thread*: a live Python thread (``threading.active_count()``), the kind our code starts.
  Native pools a library keeps for the process's life (OpenMP's, torch's) are not threads
  of a test; a native thread that comes with a leaked resource (a ZMQ context's I/O thread)
  shows as that resource's fds;
* an *fd*: an open descriptor of this process; a leak message names what the new ones point
  to (``/proc/self/fd``);
* an *ipc directory*: one of this process's under the runtime root (``enginewire-<pid>-*``,
  runtime/ipc.py), where a client binds its socket files.

Counts are compared, not identities: a thread that ended and another one started are even.
A caller picks which kinds it judges (``kinds``): Ray's driver keeps threads and
connections of its own, so a Ray campaign judges processes only.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import psutil

__all__ = [
    "LEAK_KINDS",
    "RELEASE_BOUND_S",
    "ResourceSnapshot",
    "assert_released",
    "describe_leaks",
    "exited",
    "left_behind",
    "new_processes",
    "reaped",
    "wait_until",
]

# How long a test's leftovers get to go once it ended: a SIGTERMed engine is reaped and the
# client's threads joined well within it on a loaded 2-core machine.
RELEASE_BOUND_S = 5.0
LEAK_KINDS = ("processes", "threads", "fds", "ipc_dirs")
# A snapshot reads /proc for every descendant: poll for leftovers less often than for a flag.
_LEAK_POLL_S = 0.02


def wait_until(predicate: Callable[[], object], bound: float, what: str | None = None, *,
               poll: float = 0.005) -> bool:
    """Whether ``predicate()`` held within ``bound`` seconds, asking every ``poll`` seconds;
    with ``what``, a timeout raises ``AssertionError("<what> not seen within <bound> s")``."""
    deadline = time.monotonic() + bound
    while not predicate():
        if time.monotonic() > deadline:
            if predicate():  # came in while the last poll slept
                return True
            if what is not None:
                raise AssertionError(f"{what} not seen within {bound} s")
            return False
        time.sleep(poll)
    return True


# --- processes --------------------------------------------------------------------------------


def reaped(pid: int) -> bool:
    """``pid`` is gone: exited and reaped (a zombie is not)."""
    try:
        psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    return False


def exited(pid: int) -> bool:
    """``pid`` has exited: gone, or a zombie waiting for its parent."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _children() -> frozenset[int]:
    me = os.getpid()
    found = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() == psutil.STATUS_ZOMBIE:
                if p.ppid() == me:
                    found.add(p.pid)  # ours to reap, and not reaped
                continue
            if "resource_tracker" not in " ".join(p.cmdline()):
                found.add(p.pid)
    return frozenset(found)


# --- fds and ipc directories ------------------------------------------------------------------


def fd_targets() -> Counter[str]:
    """What this process's open fds point to (``/proc/self/fd``), counted by target; empty
    where there is no ``/proc`` (the count check still runs, without the names)."""
    targets: Counter[str] = Counter()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return targets
    for fd in fds:
        try:
            targets[os.readlink(f"/proc/self/fd/{fd}")] += 1
        except OSError:  # the fd listdir itself held, closed since
            continue
    return targets


def _describe_new_fds(before: Counter[str], limit: int = 8) -> str:
    # Pipes and sockets carry an inode number; group them by kind so that 40 CUDA driver
    # handles read as one line, not 40.
    new = fd_targets() - before
    kinds: Counter[str] = Counter()
    for target, n in new.items():
        kinds[re.sub(r":\[\d+\]$", "", target)] += n
    if not kinds:
        return ""
    shown = ", ".join(f"{t} x{n}" for t, n in kinds.most_common(limit))
    more = len(kinds) - limit
    return f" (new: {shown}{f', and {more} more kinds' if more > 0 else ''})"


def _ipc_dirs() -> frozenset[str]:
    from ..runtime.ipc import runtime_root

    mine = f"enginewire-{os.getpid()}-"
    with contextlib.suppress(OSError):
        return frozenset(p.name for p in runtime_root().iterdir() if p.name.startswith(mine))
    return frozenset()


# --- the snapshot and the comparison ----------------------------------------------------------


@dataclass
class ResourceSnapshot:
    """This process's threads, fds, child processes and ipc directories before a test built
    its client (module docstring: what each one counts)."""

    threads: int
    fds: int
    children: frozenset[int]
    # What the fds pointed to, for the leak message only (the check compares counts).
    fd_targets: Counter[str] = field(default_factory=Counter)
    ipc_dirs: frozenset[str] = frozenset()

    @classmethod
    def take(cls) -> ResourceSnapshot:
        return cls(threading.active_count(), psutil.Process().num_fds(), _children(),
                   fd_targets(), _ipc_dirs())


def new_processes(before: ResourceSnapshot) -> list[int]:
    """The child processes there now that were not in ``before``, at once (no wait)."""
    return sorted(_children() - before.children)


def _compare(before: ResourceSnapshot, kinds: Collection[str]) -> dict[str, Any]:
    leaks: dict[str, Any] = {}
    if "processes" in kinds and (new := new_processes(before)):
        leaks["processes"] = new
    if "threads" in kinds and (more := threading.active_count() - before.threads) > 0:
        leaks["threads"] = more
    if "fds" in kinds and (more := psutil.Process().num_fds() - before.fds) > 0:
        leaks["fds"] = more
    if "ipc_dirs" in kinds and (made := _ipc_dirs() - before.ipc_dirs):
        leaks["ipc_dirs"] = sorted(made)
    return leaks


def left_behind(before: ResourceSnapshot, *, bound: float = RELEASE_BOUND_S,
                kinds: Collection[str] = LEAK_KINDS) -> dict[str, Any]:
    """Of ``kinds``, what is still there ``bound`` seconds after a test ended that was not in
    ``before``: ``{"processes": pids, "threads": how many more, "fds": how many more,
    "ipc_dirs": names}``, each only when there is one; empty when nothing was left."""
    unknown = sorted(set(kinds) - set(LEAK_KINDS))
    if unknown:
        raise ValueError(f"left_behind: unknown kinds {unknown}; choose from {LEAK_KINDS}")
    leaks: dict[str, Any] = {}

    def released() -> bool:
        nonlocal leaks
        leaks = _compare(before, kinds)
        return not leaks

    wait_until(released, bound, poll=_LEAK_POLL_S)
    return leaks


def assert_released(before: ResourceSnapshot, what: str = "", *, bound: float = RELEASE_BOUND_S,
                    kinds: Collection[str] = LEAK_KINDS) -> None:
    """A test's form of ``left_behind``: AssertionError naming each leftover (``what`` says
    after what), so every test judges a leak by the one definition here."""
    leaks = left_behind(before, bound=bound, kinds=kinds)
    if leaks:
        raise AssertionError((f"{what}: " if what else "") + "; ".join(
            describe_leaks(leaks, before)))


def describe_leaks(leaks: dict[str, Any], before: ResourceSnapshot) -> list[str]:
    """``left_behind``'s answer in words, one problem each, saying what the leftovers are."""
    out = []
    if "processes" in leaks:
        out.append(f"child processes left: {leaks['processes']}")
    if "threads" in leaks:
        names = sorted(t.name for t in threading.enumerate())
        out.append(f"threads leaked: {before.threads + leaks['threads']} > {before.threads}:"
                   f" {names}")
    if "fds" in leaks:
        out.append(f"fds leaked: {before.fds + leaks['fds']} > {before.fds}"
                   f"{_describe_new_fds(before.fd_targets)}")
    if "ipc_dirs" in leaks:
        out.append(f"ipc directories left: {leaks['ipc_dirs']}")
    return out
