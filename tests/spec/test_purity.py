"""``spec/`` stays pure: importing it loads nothing that does I/O, threads, sockets or torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import enginewire.spec

FORBIDDEN = {"subprocess", "socket", "threading", "multiprocessing", "asyncio", "torch", "zmq",
             "os", "shutil", "tempfile", "pathlib", "io", "concurrent", "signal", "select"}


def test_spec_sources_import_nothing_that_does_io() -> None:
    root = Path(enginewire.spec.__file__).parent
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
                raise AssertionError(f"{path.name} calls open()")


def test_importing_every_spec_module_loads_no_io_module() -> None:
    code = (
        "import sys\n"
        "import enginewire.spec, enginewire.spec.compose, enginewire.spec.explore\n"
        "import enginewire.spec.promela, enginewire.spec.diagrams, enginewire.spec.properties\n"
        "print(' '.join(sorted(m for m in ('subprocess','socket','threading','torch','zmq')"
        " if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    # threading may be pulled in by the interpreter's own startup on some builds; the others
    # must never be.
    assert not set(out) - {"threading"}, out
