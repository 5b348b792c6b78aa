"""The layering, checked on every import statement (top level, in functions, not under
TYPE_CHECKING): spec <- protocol <- runtime <- testing, the engine core free of sockets and
threads, and no import cycle but the two docs/maintainers.md names as intentional."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name under enginewire
LAYERS = {"spec": "spec", "protocol": "protocol", "runtime": "runtime",
          "model_tests": "testing", "benchmarks": "benchmarks", "enginewire": ""}
ENGINE_CORE = ("engine", "scheduler", "kv_cache", "model", "executor", "sampling",
               "fault_points")
# docs/maintainers.md, "Intentional exceptions".
KNOWN_CYCLES = {
    frozenset({"enginewire.cli", "enginewire.benchmarks.run"}),
    frozenset({"enginewire.testing.fault_matrix", "enginewire.testing.interposer"}),
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, sub in LAYERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(["enginewire", *([sub] if sub else []), *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in MODULES else target)
    return out


EDGES = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS.values() else ""


@pytest.mark.parametrize("layer, forbidden", [
    ("spec", ("enginewire.protocol", "enginewire.runtime", "enginewire.testing", "zmq")),
    ("protocol", ("enginewire.runtime", "enginewire.testing")),
    ("runtime", ("enginewire.testing", "enginewire.benchmarks", "enginewire.cli")),
])
def test_no_import_points_up_the_layers(layer: str, forbidden: tuple[str, ...]) -> None:
    bad = sorted(f"{m} imports {t}" for m, targets in EDGES.items() if _layer(m) == layer
                 for t in targets if t.startswith(forbidden))
    assert not bad, bad


def test_the_engine_core_has_no_sockets_and_no_threads() -> None:
    for mod in ENGINE_CORE:
        name = f"enginewire.runtime.{mod}"
        bad = sorted(t for t in EDGES[name] if t.split(".")[0] in ("zmq", "threading",
                                                                   "socket", "asyncio"))
        assert not bad, f"{name} imports {bad}"


def test_no_import_cycle_but_the_documented_ones() -> None:
    graph = {m: {t for t in ts if t in MODULES and t != m} for m, ts in EDGES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    unexpected = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not unexpected, unexpected


def test_the_scan_sees_relative_and_lazy_imports() -> None:
    assert "enginewire.runtime.sync_mp_client" in EDGES["enginewire.runtime.factory"]
    assert "enginewire.runtime.gguf_loader" not in EDGES["enginewire.runtime.model"]
