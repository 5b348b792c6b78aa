"""A spawned process the bench drives over a pipe (a front end of the frontends section, the
monitor of the monitor section): every reply awaited with a bound, the process reaped
however it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["Child", "child_side"]


@contextlib.contextmanager
def child_side(conn: Connection, who: str) -> Iterator[None]:
    """The child's end of the pipe, around its work: a failure is sent to the bench as
    ``("error", "WHO: Type: text")`` and ends the child; the bench gone (its end closed)
    ends it quietly; the pipe is closed however it ends."""
    try:
        yield
    except (EOFError, BrokenPipeError):
        return  # the bench is gone: nothing to report to
    except Exception as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{who}: {type(exc).__name__}: {exc}"))
    finally:
        conn.close()


class Child:
    """``target(conn, *args)`` in a process of ``mp``'s kind. The child answers each command
    with ``(tag, value)``; ``("error", text)`` is its failure, raised here as ``error(text)``
    (the child says who it is in ``text``); ``label`` names it in this side's own errors."""

    def __init__(self, mp: Any, target: Callable[..., None], args: tuple[Any, ...], *,
                 name: str, label: str, error: type[Exception]) -> None:
        self.label = label
        self.error = error
        self.conn, child = mp.Pipe()
        self.proc: BaseProcess = mp.Process(target=target, daemon=True, name=name,
                                            args=(child, *args))
        self.proc.start()
        child.close()

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def reply(self, what: str, bound: float) -> Any:
        if not self.conn.poll(bound):
            raise TimeoutError(f"{self.label}: no {what!r} within {bound:g} s")
        try:
            tag, value = self.conn.recv()
        except EOFError:
            raise self.error(f"{self.label} exited (code {self.proc.exitcode})"
                             f" before its {what!r}") from None
        if tag == "error":
            raise self.error(value)
        if tag != what:
            raise self.error(f"{self.label}: {tag!r}, expected {what!r}")
        return value

    def finish(self, bye: str, answer: str, quiet: tuple[type[BaseException], ...],
              bound: float = 10.0) -> Any:
        """Send ``bye``, await ``answer`` (its value, or None where one of ``quiet`` was
        raised), then reap the process, killed if it is still there."""
        value = None
        with contextlib.suppress(*quiet):
            self.send(bye)
            value = self.reply(answer, bound)
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10.0)
        self.conn.close()
        return value
