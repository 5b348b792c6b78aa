"""``enginewire monitor``: live between raw sockets (a seeded bug gives exit 1 and the
violation on stderr, the traffic forwarded), then ``--replay`` of its capture to the same
verdict and a report; bad usage and a corrupt capture are clear one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from enginewire.cli import main
from enginewire.protocol.messages import FinishReason
from tests.model_tests.test_monitor import IDENT, add, out, ready

BOUND_S = 30


def test_live_then_replay(tmp_path: Path) -> None:
    front = (f"ipc://{tmp_path}/fi", f"ipc://{tmp_path}/fo")
    engine = (f"ipc://{tmp_path}/ei", f"ipc://{tmp_path}/eo")
    cap = tmp_path / "cap"
    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    socks = (router, pull, dealer, push)
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, BOUND_S * 1000)
    dealer.setsockopt(zmq.IDENTITY, IDENT)
    router.bind(front[0])
    pull.bind(front[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "enginewire", "monitor", "--front", ",".join(front),
         "--engine", ",".join(engine), "--capture", str(cap), "--fail-fast",
         "--duration", str(BOUND_S)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        dealer.connect(engine[0])
        push.connect(engine[1])
        dealer.send_multipart(ready())
        assert router.recv_multipart() == [IDENT, *ready()]
        router.send_multipart([IDENT, *add("a")])
        assert dealer.recv_multipart() == add("a")
        done = out(("a", FinishReason.STOP))
        for _ in range(2):  # a finish delivered twice
            push.send_multipart(done)
            assert pull.recv_multipart() == done
        stdout, stderr = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for s in socks:
            s.close(linger=0)
        ctx.term()
    assert proc.returncode == 1, (stdout, stderr)
    assert "VIOLATION client_request: FINISH_STOP in UNKNOWN" in stderr
    assert "1 violation(s)" in stdout
    # The capture replays to the same verdict, with a report.
    rc = main(["monitor", "--replay", str(cap), "--report", str(tmp_path / "rep")])
    assert rc == 1
    (report_path,) = (tmp_path / "rep").glob("monitor-*.json")
    report = json.loads(report_path.read_text())
    assert [(v["machine"], v["state"], v["event"]) for v in report["violations"]] == [
        ("client_request", "UNKNOWN", "FINISH_STOP")]
    assert report_path.with_suffix(".html").exists()


@pytest.mark.parametrize(("argv", "says"), [
    (["monitor"], "give --front IN,OUT and --engine IN,OUT"),
    (["monitor", "--front", "ipc:///tmp/a", "--engine", "ipc:///tmp/b,ipc:///tmp/c"],
     "expected IN_ADDR,OUT_ADDR"),
    (["monitor", "--front", "tcp://127.0.0.1:1,ipc:///tmp/a", "--engine",
      "ipc:///tmp/b,ipc:///tmp/c"], "does not pass CURVE through"),
    (["monitor", "--replay", "x", "--front", "ipc:///tmp/a,ipc:///tmp/b"], "--replay judges"),
])
def test_bad_usage_is_one_line_and_exit_2(argv: list[str], says: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_a_corrupt_capture_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a capture")
    assert main(["monitor", "--replay", str(bad)]) == 1
    assert "not a monitor capture" in capsys.readouterr().err
