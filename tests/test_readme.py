"""The README's library example runs as written: saved as a script and run as one, the way a
user would (the engine process is spawned and re-imports the script's module)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "README has no python example"
    for i, code in enumerate(blocks):
        script = tmp_path / f"example{i}.py"
        script.write_text(code, encoding="utf-8")
        env = {**os.environ, "ENGINEWIRE_ENGINE_THREADS": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        if "call_utility(\"echo\", \"hello\")" in code:
            assert "hello" in done.stdout and "r1" in done.stdout, done.stdout
