"""The command line's plumbing, shared by ``enginewire`` (cli.py) and the commands that also run
as modules of their own (``python -m enginewire.benchmarks.run``): the exit codes, the two
errors a handler raises for them, the parser that says a bad flag in one line, the checks of
output paths made before a long job starts, and ``run_handler``, which turns what a handler
raised into its exit status. It imports nothing of the project, so a command module that the
CLI imports can use it without importing the CLI back.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "EXIT_ENV",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "EXTRAS",
    "Handler",
    "MissingError",
    "Parser",
    "UsageError",
    "missing_line",
    "require",
    "run_handler",
    "writable_dir",
    "writable_file",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENV = 0, 1, 2, 3

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad usage found by a handler: ``run_handler`` prints it as one line and exits 2."""


class MissingError(Exception):
    """Something the job needs is not installed: ``run_handler`` prints it as one line, exit 3."""


# Optional packages -> the extra that installs them (pyproject's optional-dependencies).
EXTRAS = {"hypothesis": "test", "transitions": "test", "matplotlib": "docs",
          "gguf": "gguf", "tokenizers": "gguf", "ray": "ray"}


def require(package: str, purpose: str) -> None:
    """Import ``package`` now, so a job that needs it fails before it starts, in one line."""
    import importlib

    try:
        importlib.import_module(package)
    except ImportError:
        raise MissingError(missing_line(package, purpose)) from None


def missing_line(package: str, purpose: str) -> str:
    extra = EXTRAS.get(package)
    how = f"pip install 'enginewire[{extra}]'" if extra else f"pip install {package}"
    return f"{purpose} needs the `{package}` package, which is not installed: {how}"


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless it already names its default;
    flags (False) and options without one (None) get nothing (docs/index.md promises every
    default in --help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (argparse prints the usage block first), and every
    option's help ends with its default (subcommand parsers are Parsers too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def writable_dir(flag: str, path: str) -> Path:
    """``path`` as a directory this process can write, created if missing; else UsageError."""
    d = Path(path).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create it ({exc.strerror})") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory is not writable")
    return d


def writable_file(flag: str, path: str) -> None:
    """``path`` can be written as a file: its directory exists and is writable."""
    f = Path(path).expanduser()
    parent = f.parent
    if f.is_dir():
        raise UsageError(f"{flag} {path}: is a directory, expected a file name")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {str(parent)!r} does not exist")
    # Tried, not asked: os.access says yes to root for /proc, where the write fails only after
    # the whole run. An existing file is opened for append (not truncated), a new one made
    # and removed again.
    existed = f.exists()
    try:
        with open(f, "ab" if existed else "xb"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: not writable ({exc.strerror})") from None
    if not existed:
        f.unlink(missing_ok=True)


def run_handler(handler: Handler, args: argparse.Namespace, prog: str) -> int:
    """``handler(args)``'s exit status; what it raised, as the exit codes say (cli.py's
    docstring), with one line on stderr that starts ``<prog>: error:``; any exception not
    named below is exit 1 with that line (``_unexpected``), never a traceback."""
    try:
        return handler(args)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MissingError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_ENV
    except ModuleNotFoundError as exc:
        # The safety net behind require: an optional package a job reached for late.
        if exc.name is None or exc.name.partition(".")[0] not in EXTRAS:
            return _unexpected(prog, exc)
        print(f"{prog}: error: {missing_line(exc.name.partition('.')[0], 'this command')}",
              file=sys.stderr)
        return EXIT_ENV
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read stdout has gone (`enginewire ... | head`): stop quietly, as a Unix
        # tool does; stdout goes to /dev/null so the exit's flush cannot raise it again.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool that SIGPIPE ended
    except Exception as exc:
        return _unexpected(prog, exc)


def _unexpected(prog: str, exc: BaseException) -> int:
    """An exception no handler expected (a bug, ours or a dependency's): one line that names
    it and where its traceback went, and exit 1, the job failed. The exit codes are the
    contract a script or CI reads, and a traceback on stderr is not one; the traceback goes to
    a private file (mkstemp: 0600, a name no other user can predict) for the bug report."""
    import tempfile
    import traceback

    text = " ".join(str(exc).split())  # one line, whatever the message holds
    if len(text) > 300:
        text = text[:297] + "..."
    where = "its traceback could not be saved"
    try:
        fd, path = tempfile.mkstemp(prefix="enginewire-traceback-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{prog}\n")
            traceback.print_exception(exc, file=f)
        where = f"traceback in {path}"
    except OSError:
        pass
    print(f"{prog}: error: unexpected {type(exc).__name__}"
          f"{': ' + text if text else ''} (a bug: please report it; {where})", file=sys.stderr)
    return EXIT_FAILED
