"""The steps docs/maintainers.md lists for a new fault point, checked: each member is fired
somewhere in the runtime, by member (never by string)."""

from __future__ import annotations

import re
from pathlib import Path

from enginewire.runtime.fault_points import FaultPoint

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "maintainers.md").read_text(encoding="utf-8")


def _runtime_source() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "runtime").glob("*.py"))
                     if p.name != "fault_points.py")


def test_every_fault_point_is_reached_by_the_runtime() -> None:
    src = _runtime_source()
    fired = set(re.findall(r"(?:fault_hook|_fault|faults)\(FaultPoint\.([A-Z_]+)", src))
    missing = sorted(p.name for p in FaultPoint if p.name not in fired)
    assert not missing, f"declared but never fired: {missing}"


def test_the_engine_core_never_names_a_fault_point_by_string() -> None:
    for name in ("engine.py", "scheduler.py", "executor.py", "kv_cache.py", "model.py"):
        src = (ROOT / "runtime" / name).read_text(encoding="utf-8")
        assert not re.search(r"fault_hook\(\s*f?[\"']", src), name


def test_the_page_names_tests_that_exist() -> None:
    for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", DOC):
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), (path, name)
