"""What a multi-process client owns outside Python objects, and the threads that watch it.

``BackgroundResources`` holds the engine process, sockets, context, ipc directory and
monitor thread, and tears them down once (``weakref.finalize``); ``monitor_engine``
watches the process sentinel, the heartbeat deadline and the attach marker's deadline;
``SigintHold`` keeps a Ctrl-C from cutting a send in half.
"""

from __future__ import annotations

import _signal
import asyncio
import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from .ipc import IpcDir
from .security import TransportGuard

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "BackgroundResources", "EngineProcessDied"]

# One logger for the multi-process client, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.mp_client")


# Grace between SIGTERM and SIGKILL when shutting the engine down.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0

# How often the monitor polls an engine's exit once its sentinel proved unreliable.
_SENTINEL_POLL_S = 0.1

# Interrupts (Ctrl-C) a teardown absorbs before it skips the stage they keep landing in.
_TEARDOWN_RETRIES = 3

def describe_exit(pid: int | None, code: int | None) -> str:
    if code is None:
        return f"engine core process {pid} stopped responding"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine core process {pid} was killed by {name} (exit code {code})"
    return f"engine core process {pid} exited with exit code {code}"


class EngineProcessDied(RuntimeError):
    """Cause attached to ``EngineDeadError`` when the engine process went away."""


def file_id(st: os.stat_result) -> tuple[int, int, int]:
    """A file's identity: the inode of an unlinked file is soon reused, its ctime is not."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


# --- background resources --------------------------------------------------------------------


@dataclass
class BackgroundResources:
    """What a client owns outside Python objects. Calling it tears everything down, once.

    It holds no reference to the client, so ``weakref.finalize(client, resources)`` runs it
    when the client is dropped, at interpreter exit, or explicitly from ``shutdown()``.
    """

    ctx: zmq.Context[Any] | None = None
    ipc_dir: IpcDir | None = None
    proc: Any = None  # multiprocessing.Process
    input_socket: zmq.Socket[Any] | None = None
    # Owned by the reader once it runs (then None here).
    output_socket: zmq.Socket[Any] | None = None
    sync_reader: Any = None  # sync_mp_client._SyncReader
    reader_loop: asyncio.AbstractEventLoop | None = None
    # The async client's PULL socket, read by a loop callback (add_reader on its FD).
    async_output_socket: zmq.Socket[Any] | None = None
    reader_fd: int | None = None
    monitor_thread: threading.Thread | None = None
    monitor_pipe: tuple[int, int] | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    shutdown_timeout: float | None = None
    # Kept above 0 only to deliver the ABORT a front end sends an attached engine at shutdown.
    input_linger_ms: int = 0
    guard: TransportGuard | None = None  # ZAP handler and socket monitors (security.py)
    last_seen: list[float] = field(default_factory=lambda: [time.monotonic()])
    # When the attach marker is overdue (monotonic); inf once the reader has accepted it.
    # Shared like ``last_seen``: the monitor wakes at it, the reader disarms it.
    attach_deadline: list[float] = field(default_factory=lambda: [math.inf])
    # ipc socket files bound at addresses the caller gave (ours live in ipc_dir), with what
    # identifies the file (``file_id``): removed once the context is gone, so a later bind
    # there is not refused or confused, unless another front end bound the path since (a
    # handover to it).
    bound_ipc_paths: list[tuple[str, tuple[int, int, int]]] = field(default_factory=list)
    done: bool = False
    # Set when a teardown has run to its end; ``torn_by`` is the thread running it.
    finished: threading.Event = field(default_factory=threading.Event)
    torn_by: int = 0
    # The reader loop's thread is blocked in ``wait_finished`` (a sync shutdown() there while
    # a shutdown_async() tears down): the teardown then cannot hand the socket's close to
    # the loop and does it itself. ``loop_gate`` wakes a teardown already waiting for the loop.
    loop_blocked: bool = False
    loop_gate: threading.Event | None = None

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.torn_by = threading.get_ident()
        try:
            self._tear_down()
        finally:
            self.finished.set()

    def wait_finished(self, timeout: float) -> None:
        """Return once the teardown another thread started has ended (bounded); at once on
        the tearing thread itself (a signal handler there must not wait for itself)."""
        if self.torn_by == threading.get_ident():
            return
        loop = self.reader_loop
        try:
            on_loop = loop is not None and asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            self.finished.wait(timeout)
            return
        self.loop_blocked = True  # before reading the gate: see _close_async
        gate = self.loop_gate
        if gate is not None:
            gate.set()
        try:
            self.finished.wait(timeout)
        finally:
            self.loop_blocked = False

    def _tear_down(self) -> None:
        stages: list[Callable[[], None]] = [
            self._stop_monitor, self._stop_process, self._close_sockets, self._close_guard,
            self._term_context, self._remove_ipc_dir]
        # Every stage runs whatever an earlier one raised: a failure in one must not leak
        # what the others hold. The first failure is raised once all ran.
        first: Exception | None = None
        interrupt: BaseException | None = None
        retries = 0
        i = 0
        while i < len(stages):
            try:
                stages[i]()
            except Exception as e:
                logger.exception("client teardown: %s failed", stages[i].__name__)
                first = first or e
            except BaseException as e:
                # Ctrl-C, most likely while waiting out the grace for a hung engine: the
                # caller wants to stop waiting, not to leak the engine, sockets and threads
                # (a later shutdown() finds the teardown done). End the grace (SIGKILL now),
                # run this stage again and the rest, then raise the interrupt. Each stage is
                # bounded and can be run again; a few interrupts at most, so it ends.
                interrupt = interrupt or e
                self.shutdown_timeout = 0.0
                retries += 1
                if retries <= _TEARDOWN_RETRIES:
                    continue
                logger.warning("client teardown: %s interrupted; skipped", stages[i].__name__)
            i += 1
        if interrupt is not None:
            raise interrupt
        if first is not None:
            raise first

    def _close_guard(self) -> None:
        if self.guard is not None:  # before term(): its authenticator holds a socket
            guard, self.guard = self.guard, None
            guard.close()

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None:
            self.ipc_dir.remove()  # idempotent: cleared after, so an interrupted one reruns
            self.ipc_dir = None
        while self.bound_ipc_paths:  # one at a time: an interrupted teardown resumes here
            path, ours = self.bound_ipc_paths[-1]
            with contextlib.suppress(OSError):  # already gone
                st = os.lstat(path)
                if stat.S_ISSOCK(st.st_mode) and file_id(st) == ours:
                    os.unlink(path)
            self.bound_ipc_paths.pop()

    def _stop_monitor(self) -> None:
        if self.monitor_pipe is not None:
            try:
                os.write(self.monitor_pipe[1], b"x")
            except OSError:
                pass
        monitor = self.monitor_thread
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(2.0)
        if self.monitor_pipe is not None:
            # Forgotten before they are closed: an interrupted teardown runs this again, and
            # a second close could hit a number reused by another file.
            fds, self.monitor_pipe = self.monitor_pipe, None
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _stop_process(self) -> None:
        proc = self.proc
        if proc is None:
            return
        timeout = self.shutdown_timeout
        if timeout is None:
            timeout = DEFAULT_SHUTDOWN_TIMEOUT_S
        try:
            if proc.is_alive():
                proc.terminate()
                # A stopped engine (SIGSTOP, a debugger) would hold SIGTERM pending and cost
                # the whole grace: let it run to handle it (only a pid on this host).
                if getattr(proc, "local", True) and proc.pid is not None:
                    with contextlib.suppress(OSError):
                        os.kill(proc.pid, signal.SIGCONT)
                proc.join(None if math.isinf(timeout) else timeout)
            if proc.is_alive():
                logger.warning("engine core did not stop within %.1f s; killing it", timeout)
                proc.kill()
                proc.join(5.0)
            proc.join(0)
            proc.close()
        except ValueError:
            pass  # already closed
        # Only now: an interrupted join leaves it here for the teardown to run this again.
        self.proc = None

    def _close_sockets(self) -> None:
        with self.send_lock:
            if self.input_socket is not None:
                self.input_socket.close(linger=self.input_linger_ms)
                self.input_socket = None
        if self.output_socket is not None:  # never handed to a reader
            self.output_socket.close(linger=0)
            self.output_socket = None
        if self.sync_reader is not None:
            self.sync_reader.close()  # runs again if interrupted: cleared only after
            self.sync_reader = None
        if self.async_output_socket is not None:
            self._close_async()

    def _close_async(self) -> None:
        sock, fd, loop = self.async_output_socket, self.reader_fd, self.reader_loop
        self.async_output_socket = None
        self.reader_fd = None
        assert sock is not None

        once = threading.Lock()
        closed = False

        def close() -> None:
            # Once only: a second remove_reader could hit the fd reused by another socket.
            nonlocal closed
            with once:
                if closed:
                    return
                closed = True
            if fd is not None and loop is not None and not loop.is_closed():
                loop.remove_reader(fd)
            sock.close(linger=0)

        on_loop = False
        try:
            on_loop = loop is not None and asyncio.get_running_loop() is loop
        except RuntimeError:
            pass
        if loop is None or on_loop or loop.is_closed() or not loop.is_running():
            close()
            return
        done = self.loop_gate = threading.Event()
        if self.loop_blocked:  # after setting the gate: see wait_finished
            close()  # the loop's thread waits for this teardown: it cannot run a callback
            return

        def close_and_signal() -> None:
            try:
                close()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(close_and_signal)
        except RuntimeError:  # loop closed in between
            close()
            return
        if not done.wait(5.0):
            logger.warning("event loop did not close the output socket; closing it here")
        close()  # a no-op once the loop did; else the loop's thread is blocked (or stuck)

    def _term_context(self) -> None:
        ctx = self.ctx
        self.ctx = None
        if ctx is None:
            return
        # term() blocks until every socket is closed; bound it so a stuck reader cannot
        # hang shutdown (the context then leaks, which is logged).
        t = threading.Thread(target=ctx.term, name="EngineClientCtxTerm", daemon=True)
        t.start()
        t.join(5.0)
        if t.is_alive():
            logger.warning("zmq context did not terminate; a socket was left open")


class _MarkerOverdue(Exception):
    """What ``_watch_engine`` returns when the attach marker is overdue: the client words
    the cause (``MPClient._marker_overdue``, which knows what it dropped meanwhile)."""


def monitor_engine(
    client_ref: weakref.ReferenceType[Any],  # an MPClient
    proc: Any,
    stop_fd: int,
    heartbeat_timeout_s: float | None,
    last_seen: list[float],
    attach_deadline: Sequence[float] = (math.inf,),
    beat_s: float | None = None,
) -> None:
    """Wait for the engine process to exit (or go silent, or leave the ATTACH unanswered)
    and report it to the client. ``beat_s``: every so often, the client's
    ``_send_front_end_beat()`` (an engine serving several front ends deems a silent one
    gone: ``ReadyResponse.front_end_timeout_s``).

    If the watch itself fails, death could no longer be seen and every wait on the engine
    could hang: the client is told the engine is dead, with the failure as the cause."""
    while True:
        try:
            cause = _watch_engine(proc, stop_fd, heartbeat_timeout_s, last_seen,
                                  attach_deadline, beat_s, client_ref)
        except Exception as e:
            logger.exception("engine monitor failed")
            cause = EngineProcessDied(f"the engine monitor failed ({e!r}): death can no"
                                      " longer be detected, so the engine is treated as dead")
        if cause is None:
            return
        client = client_ref()
        if client is None:
            return
        if isinstance(cause, _MarkerOverdue):
            if not client._deadline_still_due():
                # The reader took the marker, but an exception raised into its thread cut
                # short its store of the deadline (now done): keep watching.
                del client
                continue
            cause = client._marker_overdue()
        client._on_engine_dead(cause)
        return


def _watch_engine(
    proc: Any,
    stop_fd: int,
    heartbeat_timeout_s: float | None,
    last_seen: list[float],
    attach_deadline: Sequence[float],
    beat_s: float | None = None,
    client_ref: weakref.ReferenceType[Any] | None = None,
) -> BaseException | None:
    """Block until the engine exits or goes silent or its attach marker is overdue (the
    cause), or the client stops or nothing is left to watch (None)."""
    waitables: list[Any] = [stop_fd]
    if proc is not None:
        waitables.append(proc.sentinel)
    # Set when the sentinel proved unreliable (readable, process alive): it stays readable,
    # so waiting on it again would spin; the exit is then polled instead.
    poll_exit_s: float | None = None
    next_beat = math.inf if beat_s is None else time.monotonic() + beat_s
    while True:
        # Wake at the deadlines themselves rather than on a polling grid: a silent engine is
        # then declared dead at its last message + heartbeat_timeout_s (plus scheduling), not
        # up to a poll period later (timeout/4 polling measured 0.8-1.25 s with a 1 s
        # deadline). The reader disarms the marker's deadline without waking this thread:
        # it wakes once more at the old deadline, finds it gone, and goes on.
        now = time.monotonic()
        wait_s = attach_deadline[0] - now
        if heartbeat_timeout_s:
            wait_s = min(wait_s, last_seen[0] + heartbeat_timeout_s - now)
        wait_s = min(wait_s, next_beat - now)
        if math.isinf(wait_s) and proc is None:
            return None  # an attached engine without a heartbeat: only the marker was due
        if poll_exit_s is not None:
            wait_s = min(wait_s, poll_exit_s)
        ready = multiprocessing.connection.wait(
            waitables, timeout=None if math.isinf(wait_s) else max(0.0, wait_s))
        if stop_fd in ready:
            return None
        if beat_s is not None and time.monotonic() >= next_beat:
            next_beat = time.monotonic() + beat_s
            client = client_ref() if client_ref is not None else None
            if client is None:
                return None
            client._send_front_end_beat()
            del client
        if proc is not None and (proc.sentinel in ready or poll_exit_s is not None):
            # A readable sentinel with a live process would be a false alarm (vLLM #54184):
            # require a real exit code.
            if poll_exit_s is None:
                proc.join(1.0)
            if proc.exitcode is not None:
                return EngineProcessDied(describe_exit(proc.pid, proc.exitcode))
            if poll_exit_s is None:
                logger.warning("engine process %s: its sentinel is readable but it has not "
                               "exited; polling its exit instead", proc.pid)
                waitables.remove(proc.sentinel)
                poll_exit_s = _SENTINEL_POLL_S
        if time.monotonic() >= attach_deadline[0]:  # inf once the reader took the marker
            return _MarkerOverdue()
        if heartbeat_timeout_s and time.monotonic() - last_seen[0] >= heartbeat_timeout_s:
            return EngineProcessDied(
                f"no message from the engine for {heartbeat_timeout_s:g} s"
                " (engine_heartbeat_timeout_s)"
            )


class SigintHold:
    """Hold a Ctrl-C (SIGINT with Python's default handler, main thread) until the block
    ends, then raise it. For an ADD's send: interrupted right after its last part went, the
    request was forgotten while the engine ran it, and its outputs were SpecViolations in
    every later get_output (losing the batches they came in). Held, the ADD goes out whole
    and the caller gets its KeyboardInterrupt with the request live and tracked. The C-level
    _signal calls cost ~0.3 us each (signal's enum wrappers: ~4.5 us, per add_request)."""

    __slots__ = ("held", "previous")

    def __enter__(self) -> None:
        self.previous: Any = None
        if (_signal.getsignal(_SIGINT) is not _signal.default_int_handler
                or threading.current_thread() is not _MAIN_THREAD):
            return  # another handler is the application's to honour; threads get no signal
        self.held = False
        self.previous = _signal.signal(_SIGINT, self._hold)

    def _hold(self, _signum: int, _frame: Any) -> None:
        self.held = True

    def __exit__(self, *exc: object) -> None:
        if self.previous is None:
            return
        _signal.signal(_SIGINT, self.previous)
        if self.held:
            raise KeyboardInterrupt


_SIGINT = int(signal.SIGINT)
_MAIN_THREAD = threading.main_thread()


def end_message(sock: zmq.Socket[Any]) -> None:
    """A send interrupted part-way (Ctrl-C is raised inside a send, possibly after the part
    went): end the message with an empty part, so the next message is not read as its
    continuation. The engine rejects the stub as malformed and nothing else is lost; if no
    message was open, the empty part names no peer and the ROUTER drops it."""
    with contextlib.suppress(Exception):
        sock.send(b"")


