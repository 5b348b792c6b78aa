"""The composed models' full explorations, shared by every test that asserts on them.

An exploration is a pure function of the spec's source (the models are data and code in
``spec/``, no I/O, no randomness), and the three take most of a minute on two cores. With
``-n 2`` (whole files per worker) each worker explored every model a file of its own needed, and the
slow tier explored them all again: four explorations of each model per CI run. The result
is computed once per source and kept in the temporary directory under a key made of the
spec's source and the interpreter (a changed model, a changed explorer: a new key); a file
lock makes a second worker wait for the first one's result instead of exploring too."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

import enginewire.spec
from enginewire.spec.explore import ExploreResult, explore, explore_dp, explore_fe

_CACHE = Path(tempfile.gettempdir()) / f"enginewire-explorations-{os.getuid()}"


def _source_key() -> str:
    digest = hashlib.sha256(sys.version.encode())
    root = Path(enginewire.spec.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


def shared_exploration(name: str, compute: Callable[[], ExploreResult]) -> ExploreResult:
    """``compute()``, or the result an earlier run of the same spec source kept. A cache
    that cannot be read or written is no cache: the exploration runs here."""
    try:
        _CACHE.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return compute()
    path = _CACHE / f"{name}-{_source_key()}.pickle"
    with open(_CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError, AttributeError):
            kept = pickle.loads(path.read_bytes())
            if isinstance(kept, ExploreResult):
                return kept
        result = compute()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_bytes(pickle.dumps(result))
            os.replace(tmp, path)  # whole or absent: a reader never sees half a file
        return result


@pytest.fixture(scope="session")
def composed() -> ExploreResult:
    """The full exploration of the real composed model (once per spec source)."""
    return shared_exploration("composed", explore)


@pytest.fixture(scope="session")
def composed_dp() -> ExploreResult:
    """The full exploration of the two-engine model (once per spec source)."""
    return shared_exploration("composed_dp", explore_dp)


@pytest.fixture(scope="session")
def composed_fe() -> ExploreResult:
    """The full exploration of the front-end model (once per spec source)."""
    return shared_exploration("composed_fe", explore_fe)
