"""runtime/engine_launch.py: the engine as a program of its own, not multiprocessing's spawn.

A script without a ``__main__`` guard, a ``python -c`` line, a script fed on stdin (how a
notebook kernel's main looks to multiprocessing) and a front end in another directory with a
relative ``sys.path`` all get a working subprocess client; the boot pipe refuses what is not
a boot message; the handle behaves as ``multiprocessing.Process`` where the client relies on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from enginewire.runtime import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_launch import (
    _BOOTSTRAP,
    BOOT_MAX_BYTES,
    EngineBoot,
    StartupReport,
    launch_engine_process,
)
from enginewire.spec import EngineStartupError

NULL = EngineConfig(model="null")
BOUND_S = 60

# No guard: under multiprocessing's spawn the engine re-ran this and built a second client.
SCRIPT = """\
from enginewire.runtime import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.protocol.messages import EngineCoreRequest, SamplingParams

client = make_client(EngineConfig(model="null"), multiprocess=True, asyncio=False)
client.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=4)))
tokens = 0
while tokens < 4:
    for out in client.get_output(timeout=30).outputs:
        tokens += len(out.new_token_ids)
print("OK", tokens, client.echo("hi"))
client.shutdown()
"""


def _python(args: list[str], cwd: Path, stdin: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, *args], cwd=cwd, input=stdin, env=env,
                          capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_script_without_a_main_guard_works_from_a_file_from_c_and_from_stdin(
        tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT)
    assert _python([str(script)], tmp_path).split() == ["OK", "4", "hi"]
    assert _python(["-c", SCRIPT], tmp_path).split() == ["OK", "4", "hi"]
    assert _python(["-"], tmp_path, stdin=SCRIPT).split() == ["OK", "4", "hi"]


def test_a_front_end_elsewhere_with_a_relative_path_finds_its_own_config_class(
        tmp_path: Path) -> None:
    """The engine imports the config's class by name through the front end's sys.path,
    relative entries resolved against the front end's working directory."""
    pkg = tmp_path / "work" / "mine"
    pkg.mkdir(parents=True)
    (pkg / "mycfg.py").write_text(textwrap.dedent("""\
        from enginewire.runtime.config import EngineConfig

        class MyConfig(EngineConfig):
            note: str = "mine"
        """))
    (tmp_path / "work" / "run.py").write_text(textwrap.dedent("""\
        import sys
        sys.path.insert(0, "mine")  # relative, as a project's script might
        from mycfg import MyConfig
        from enginewire.runtime import make_client
        client = make_client(MyConfig(model="null"), multiprocess=True, asyncio=False)
        print("OK", client.echo(5))
        client.shutdown()
        """))
    assert _python(["run.py"], tmp_path / "work").split() == ["OK", "5"]


def test_the_engine_runs_our_entry_point_only() -> None:
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        pid = client.engine_pid
        assert pid is not None
        cmd = psutil.Process(pid).cmdline()
        assert cmd[0] == sys.executable and cmd[1] == "-c" and cmd[2] == _BOOTSTRAP
        assert not any("multiprocessing" in part for part in cmd)
        # The CURVE secret, the config and the fault plan travel over the boot pipe.
        assert len(cmd) == 7


class _Local(EngineConfig):
    pass


def test_a_config_class_the_engine_cannot_import_is_refused_before_any_start() -> None:
    def local() -> type:
        class Inner(EngineConfig):
            pass
        return Inner

    before = {p.pid for p in psutil.Process().children()}
    for cls in (local(),):
        with pytest.raises(TypeError, match="importable by name"):
            make_client(cls(model="null"), multiprocess=True, asyncio=False)
    assert {p.pid for p in psutil.Process().children()} <= before
    with pytest.raises(TypeError, match="cannot pass"):
        EngineBoot.build(EngineConfig, b"", {"input_address": "x", "output_address": "y",
                                             "bogus": 1}, "e")
    # A module-level class elsewhere is fine (this test module is importable by name).
    boot = EngineBoot.build(_Local, msgspec.msgpack.encode(_Local(model="null")),
                            {"input_address": "x", "output_address": "y"}, "e")
    assert boot.config_type.endswith(":_Local")


def _bare_engine(payload: bytes) -> tuple[int, str]:
    """The bootstrap fed ``payload`` on its boot pipe: (exit code, its start-up report)."""
    boot_r, boot_w = os.pipe()
    life_r, life_w = os.pipe()
    report_r, report_w = os.pipe()
    import json

    from enginewire.runtime.engine_launch import _import_path

    proc = subprocess.Popen(
        [sys.executable, "-c", _BOOTSTRAP, json.dumps(_import_path()), str(boot_r),
         str(life_w), str(report_w)], pass_fds=[boot_r, life_w, report_w])
    for fd in (boot_r, life_w, report_w):
        os.close(fd)
    try:
        with os.fdopen(boot_w, "wb") as f:
            f.write(payload)
    except BrokenPipeError:
        pass
    code = proc.wait(BOUND_S)
    report = StartupReport(report_r)
    try:
        return code, report.recv()
    finally:
        report.close()
        os.close(life_r)


def test_the_boot_pipe_refuses_what_is_not_a_boot_message() -> None:
    code, why = _bare_engine((BOOT_MAX_BYTES + 1).to_bytes(8, "big"))
    assert code == 1 and "bad engine boot message" in why and "bound" in why
    code, why = _bare_engine((5).to_bytes(8, "big") + b"\xc1\xc1\xc1\xc1\xc1")
    assert code == 1 and "bad engine boot message" in why
    code, why = _bare_engine(b"\x00\x00")  # the front end went away mid-message
    assert code == 1 and "went away" in why


def test_a_start_up_failure_names_its_reason() -> None:
    with pytest.raises(EngineStartupError,
                       match=r"initialization failed: ValueError: .*unknown model.*exit code 1"):
        make_client(EngineConfig(model="no-such-model"), multiprocess=True, asyncio=False)


def test_the_handle_reports_exits_as_multiprocessing_does(tmp_path: Path) -> None:
    report_r, report_w = os.pipe()
    proc = launch_engine_process(
        EngineConfig, msgspec.msgpack.encode(NULL),
        {"input_address": f"ipc://{tmp_path}/in", "output_address": f"ipc://{tmp_path}/out",
         "parent_pid": os.getpid(), "startup_report": report_w}, "EngineCore_test")
    os.close(report_w)
    try:
        assert proc.is_alive() and proc.exitcode is None
        with pytest.raises(ValueError, match="still running"):
            proc.close()
        proc.kill()
        proc.join(BOUND_S)
        assert proc.exitcode == -signal.SIGKILL and not proc.is_alive()
        import select

        assert select.select([proc.sentinel], [], [], 5)[0]  # readable once it exited
        proc.kill()  # a reaped engine is never signalled again
    finally:
        proc.close()
        os.close(report_r)
    with pytest.raises(ValueError, match="closed"):
        proc.is_alive()


def test_the_engine_exits_once_its_front_end_is_killed(tmp_path: Path) -> None:
    """The boot pipe is the engine's lifeline: a SIGKILLed front end's engine goes."""
    code = SCRIPT.split("print(")[0] + "print(client.engine_pid, flush=True)\nimport time\n" \
        "time.sleep(600)\n"
    front = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert front.stdout is not None
        engine = psutil.Process(int(front.stdout.readline()))
        front.kill()
        front.wait(BOUND_S)
        t0 = time.monotonic()
        engine.wait(15)
        assert time.monotonic() - t0 < 10
    finally:
        front.kill()


def test_a_front_end_whose_working_directory_was_removed_still_starts_an_engine(
        tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    code = f"import os\nos.chdir({str(gone)!r})\nos.rmdir({str(gone)!r})\n" + SCRIPT
    assert _python(["-c", code], tmp_path).split() == ["OK", "4", "hi"]
