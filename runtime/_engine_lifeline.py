"""The engine process's lifeline: shutdown signals and the parent-death watch.

``ShutdownSignals`` turns SIGTERM/SIGINT/SIGHUP into ``EngineShutdownRequested`` during
construction and into a shutdown item on the input queue once the busy loop runs;
``watch_parent`` makes the process exit within ``PARENT_DEATH_EXIT_S`` of its parent's death.
Separate from runtime/engine_proc.py because neither touches the engine or its sockets: they
only decide when the process goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from ._engine_shared import Control

# One logger for the engine process, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.engine_proc")

# Seconds the whole process may take to go once its parent is gone (brief: within 5 s).
PARENT_DEATH_EXIT_S = 3.0


class EngineShutdownRequested(SystemExit):
    """A signal asked the engine to stop before its busy loop ran; exits with status 0."""

    def __init__(self) -> None:
        super().__init__(0)


_SHUTDOWN_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP")
                          if hasattr(signal, name))


class ShutdownSignals:
    """SIGTERM/SIGINT/SIGHUP handling that is safe both during construction and in the loop.

    Before the loop is armed a signal raises ``EngineShutdownRequested`` in the main thread, so
    a long construction is interrupted at once. Once armed, the handler only sets an event: a
    helper thread puts the shutdown item on the input queue (a handler must not take the
    queue's lock, which the interrupted main thread may hold).
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._armed: queue.SimpleQueue[Any] | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        # SIGHUP too: a hang-up (the operator's terminal or ssh session closing) otherwise
        # kills the engine without the last outputs or the word to its front end.
        for sig in _SHUTDOWN_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, prev)
        self._previous.clear()

    def arm(self, input_queue: queue.SimpleQueue[Any]) -> None:
        self._armed = input_queue
        threading.Thread(target=self._waker, name="EngineSignalWaker", daemon=True).start()
        if self.requested.is_set():
            raise EngineShutdownRequested()

    def _waker(self) -> None:
        self.requested.wait()
        if self._armed is not None:
            self._armed.put((Control.SHUTDOWN, None))

    def _handle(self, signum: int, _frame: object) -> None:
        first = not self.requested.is_set()
        self.requested.set()
        if first:
            logger.info("engine core received %s; shutting down", signal.Signals(signum).name)
        if self._armed is None:
            raise EngineShutdownRequested()


def watch_parent(parent_pid: int, lifeline: int | None = None) -> None:
    """Exit within a bound once ``parent_pid`` is gone, even if it was SIGKILLed.
    ``lifeline``: an fd whose write end only the parent holds (EOF: it is gone)."""
    if sys.platform.startswith("linux"):
        # Delivered when the parent *thread* that spawned us exits, which may happen while the
        # parent process lives on: the handler checks the real parent before acting.
        def on_pdeathsig(_signum: int, _frame: object) -> None:
            if os.getppid() != parent_pid:
                _parent_gone("PR_SET_PDEATHSIG")

        with contextlib.suppress(Exception):
            signal.signal(signal.SIGUSR1, on_pdeathsig)
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGUSR1), 0, 0, 0)

    def watchdog() -> None:
        parent = multiprocessing.parent_process()
        sentinel = lifeline if lifeline is not None else (
            getattr(parent, "sentinel", None) if parent is not None else None)
        while True:
            if sentinel is not None:
                # The spawn parent holds the write end of this pipe: EOF means it is gone.
                if multiprocessing.connection.wait([sentinel], timeout=0.5):
                    break
            elif not _pid_alive(parent_pid):
                break
            else:
                time.sleep(0.5)
            if os.getppid() != parent_pid:
                break
        _parent_gone("watchdog")

    threading.Thread(target=watchdog, name="EngineParentWatchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        _parent_gone("startup check")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_parent_gone_once = threading.Lock()


def _parent_gone(how: str) -> None:
    if not _parent_gone_once.acquire(blocking=False):
        return
    logger.warning("engine core: parent process is gone (%s); exiting", how)

    def hard_exit() -> None:
        time.sleep(PARENT_DEATH_EXIT_S)
        os._exit(1)

    threading.Thread(target=hard_exit, name="EngineHardExit", daemon=True).start()
    # Route through the SIGTERM handler so a clean shutdown is tried first.
    os.kill(os.getpid(), signal.SIGTERM)
