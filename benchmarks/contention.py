"""A fixed background load for ``enginewire bench --contended``.

A serving host shares its cores with tokenizers, detokenizers and HTTP workers, and a design
that wins on a quiet machine can lose there (issue 31 measured our K = 1024 delivery lead over
vLLM turn into a deficit at load 2-6). So the contended mode runs the same measurements, ours
and their floors alike, beside ``n`` CPU-bound processes (default: one per core) that live for
the whole run. They are plain ``python -c`` spin loops: no I/O, no memory to speak of, so what
they take is CPU time and nothing else, the same for every row.

The processes are a context manager's: they are killed and reaped on exit, however the run
ends (a failed measurement, Ctrl-C), and each is its own process group's leader so a Ctrl-C at
the terminal reaches the benchmark, which then stops them, rather than racing it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import TracebackType

__all__ = ["BackgroundLoad", "default_procs"]

# Spins on the interpreter, not in C: a busy loop that the scheduler treats as any Python
# worker (it yields at the end of its time slice, never blocks).
_SPIN = "while True:\n    pass\n"


def default_procs() -> int:
    """One spinning process per core the benchmark may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class BackgroundLoad:
    """``n`` CPU-bound processes, started on ``__enter__`` and killed and reaped on exit."""

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"a background load needs at least one process, got {n!r}")
        self.n = n
        self._procs: list[subprocess.Popen[bytes]] = []
        self.load_before: float | None = None
        self.load_after: float | None = None

    def __enter__(self) -> BackgroundLoad:
        self.load_before = os.getloadavg()[0]
        try:
            for _ in range(self.n):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-S", "-c", _SPIN], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True))
        except BaseException:
            self.stop()
            raise
        time.sleep(0.2)  # let them reach their loops before the first measurement
        for p in self._procs:
            if p.poll() is not None:
                code = p.returncode
                self.stop()
                raise RuntimeError(f"a background load process exited at start (code {code})")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill and reap every process (idempotent)."""
        if self._procs:
            self.load_after = os.getloadavg()[0]
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait()
        self._procs.clear()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def describe(self) -> dict[str, object]:
        """What the JSON records of the load."""
        return {"procs": self.n, "load_before": self.load_before, "load_after": self.load_after}
