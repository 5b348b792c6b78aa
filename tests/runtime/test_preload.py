"""runtime/preload.py: ``ENGINEWIRE_ENGINE_PRELOAD`` runs code in every engine process before
its engine is built; an entry that cannot run fails the start in one clear line."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from enginewire.cli import main
from enginewire.runtime import make_client, preload
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.preload import PRELOAD_ENV, run_preloads
from enginewire.spec import EngineStartupError
from enginewire.testing._harness import ResourceSnapshot, describe_leaks, left_behind

NULL = EngineConfig(model="null")
BOUND_S = 60

# Imported by the engine (the front end's sys.path travels to it): records, in the file
# PRELOAD_TEST_OUT names, the process it ran in and whether the parent watch ran before it.
HOOK = """\
import os
import threading

calls = []


def record():
    calls.append(os.getpid())
    watched = any(t.name == "EngineParentWatchdog" for t in threading.enumerate())
    with open(os.environ["PRELOAD_TEST_OUT"], "a") as fh:
        fh.write(f"{os.getpid()} {watched}\\n")


def boom():
    raise KeyError("the hook's own failure")


not_callable = 3
"""


@pytest.fixture
def hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The name of a fresh hook module on the import path; preloads start uncalled."""
    name = f"preload_hook_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(HOOK))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PRELOAD_TEST_OUT", str(tmp_path / "calls.txt"))
    monkeypatch.setattr(preload, "_done", set())
    return name


def test_entries_run_in_order_once_per_process(hook: str, tmp_path: Path) -> None:
    import importlib

    mod = importlib.import_module(hook)
    run_preloads(f"{hook}:record, {hook}:calls.clear")
    assert mod.calls == [] and (tmp_path / "calls.txt").read_text().count("\n") == 1
    run_preloads(f"{hook}:record")  # called already in this process
    assert (tmp_path / "calls.txt").read_text().count("\n") == 1
    run_preloads("")  # nothing to do


@pytest.mark.parametrize(("entry", "says"), [
    ("no_colon_here", "is not 'module:callable'"),
    ("enginewire_no_such_module:f", "cannot import 'enginewire_no_such_module'"),
    ("{hook}:missing", "no attribute 'missing'"),
    ("{hook}:not_callable", "is a int, not a callable"),
    ("{hook}:boom", "raised KeyError: \"the hook's own failure\""),
])
def test_a_bad_entry_is_a_startup_error_naming_it(hook: str, entry: str, says: str) -> None:
    entry = entry.format(hook=hook)
    with pytest.raises(EngineStartupError) as info:
        run_preloads(entry)
    assert str(info.value).startswith(f"{PRELOAD_ENV}: ") and says in str(info.value)
    assert entry.split(":")[0] in str(info.value)


def test_a_spawned_engine_runs_the_hook_before_its_engine(
        hook: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PRELOAD_ENV, f"{hook}:record")
    client = make_client(NULL, multiprocess=True, asyncio=False)
    try:
        assert client.echo("hi") == "hi"
        pid = client.engine_pid
    finally:
        client.shutdown()
    # The hook ran once, in the engine's process, before its parent watch started.
    assert (tmp_path / "calls.txt").read_text().split() == [str(pid), "False"]
    assert pid != os.getpid()


def test_a_bad_entry_fails_a_spawned_engine_at_once_and_leaves_nothing(
        hook: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PRELOAD_ENV, f"{hook}:record,enginewire_no_such_module:f")
    before = ResourceSnapshot.take()
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError,
                       match=rf"{PRELOAD_ENV}: cannot import 'enginewire_no_such_module'"):
        make_client(NULL, multiprocess=True, asyncio=False, ready_timeout_s=BOUND_S)
    assert time.monotonic() - t0 < BOUND_S / 2  # the engine's exit said so: no deadline ran out
    leaks = left_behind(before, kinds=("processes", "threads", "fds", "ipc_dirs"))
    assert not leaks, describe_leaks(leaks, before)


def test_the_engine_command_says_a_bad_entry_in_one_line(
        hook: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(PRELOAD_ENV, f"{hook}:boom")
    rc = main(["engine", "--model", "null", "--input-address", f"ipc://{tmp_path}/in",
               "--output-address", f"ipc://{tmp_path}/out"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc != 0 and len(lines) == 1, lines
    assert "could not start" in lines[0] and "the hook's own failure" in lines[0]
