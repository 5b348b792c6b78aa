"""`enginewire ... | head`: when the reader of stdout leaves, the command stops quietly with
141 (what a shell reports for a tool SIGPIPE ended), no error line and no traceback, and
leaves no engine behind."""
from __future__ import annotations

import subprocess
import sys


def test_generate_into_a_closed_pipe_stops_quietly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "enginewire", "generate", "--model", "tiny", "--prompt", "hi",
         "--client", "sync", "--max-tokens", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(1)  # the stream has begun
    proc.stdout.close()  # `head -c 1` has what it wanted
    try:
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert rc == 141, (rc, err)
    assert "error" not in err and "Traceback" not in err, err
