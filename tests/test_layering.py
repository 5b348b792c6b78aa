"""The layering, checked on every import statement (top level, inside functions, and under
``TYPE_CHECKING``) of every module of every package we install.

Theory of operation
-------------------
``_scan`` reads a module's imports from its AST, resolving relative imports and ``from
package import module`` to the module they name. ``RULES`` says, per layer, which of our
modules it may import and which modules (ours or not) it never imports; one test reads each
rule. A type-only import counts for the rules (a ``protocol`` that names ``zmq`` in a hint
knows about sockets) but not for cycles, which are about import order; a lazy import counts
for both. No import cycle is allowed. docs/maintainers.md ("The layers") is the prose of the
same table: change both together. The last section, over the same modules: no module imports
another's private name.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name under enginewire (pyproject.toml's package-dir, checked below)
LAYERS = {"spec": "spec", "protocol": "protocol", "runtime": "runtime",
          "model_tests": "testing", "benchmarks": "benchmarks", "enginewire": ""}
ENGINE_CORE = ("engine", "scheduler", "kv_cache", "model", "executor", "sampling",
               "fault_points")
# Modules that do I/O or run concurrently: sockets, event loops, threads, processes, files.
IO_MODULES = ("zmq", "socket", "select", "selectors", "ssl", "asyncio", "threading", "_thread",
              "multiprocessing", "concurrent", "subprocess", "signal", "os", "io", "pathlib",
              "shutil", "tempfile")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported; ``from pkg import mod`` of ours names ``pkg.mod``
    name: str | None  # what ``from target import name`` takes; None for ``import target``
    line: int
    typing_only: bool  # under ``if TYPE_CHECKING:``


@dataclass(frozen=True)
class Rule:
    """What the modules in ``who`` (modules, or packages with everything under them) may
    import: of ours, only ``may_import`` (None: any); of anything, never ``never``, except
    the ``module.name`` imports in ``allowed``."""

    id: str
    who: tuple[str, ...]
    may_import: tuple[str, ...] | None
    never: tuple[str, ...]
    why: str
    allowed: frozenset[str] = frozenset()


RULES = (
    Rule("spec", ("enginewire.spec",), ("enginewire.spec",), IO_MODULES,
         "spec/ is the lifecycles as data: it imports nothing of ours outside spec/ and no"
         " I/O module (tests/spec/test_purity.py also checks what importing it loads)"),
    Rule("protocol", ("enginewire.protocol",), ("enginewire.spec", "enginewire.protocol"),
         IO_MODULES,
         "protocol/ is encode and decode over bytes: it imports spec/ and itself, and no"
         " socket, thread, event-loop, process or file module (socket I/O is"
         " runtime/zmq_io.py's)",
         # Per-thread decoder caches: thread-local storage, no thread started or waited on.
         # A path argument's type and its str (profile's, protocol/utilities.py): no file
         # touched.
         allowed=frozenset({"threading.local", "os.PathLike", "os.fspath"})),
    Rule("runtime", ("enginewire.runtime",),
         ("enginewire.spec", "enginewire.protocol", "enginewire.runtime"), (),
         "runtime/ imports spec/ and protocol/, never the test harness (model_tests/, installed"
         " as enginewire.testing), the benchmarks, the CLI or the facade"),
    Rule("engine-core", tuple(f"enginewire.runtime.{m}" for m in ENGINE_CORE), None,
         ("zmq", "socket", "select", "selectors", "asyncio", "threading", "_thread",
          "multiprocessing", "subprocess"),
         "the engine core is driven by calls: no sockets, no threads, no event loop (the"
         " process wrapper, engine_proc.py and its _engine_* modules, owns those)"),
    Rule("testing", ("enginewire.testing",),
         ("enginewire.spec", "enginewire.protocol", "enginewire.runtime",
          "enginewire.testing"), (),
         "model_tests/ (enginewire.testing) imports the layers it tests, not the benchmarks,"
         " the CLI or the facade"),
    Rule("benchmarks", ("enginewire.benchmarks",), None, ("enginewire.testing",),
         "benchmarks/ may import everything but model_tests/ (enginewire.testing)",
         # The monitor (issue 48) is a product tool a deployment leaves on, not test harness:
         # its cost against a direct link is a benchmark row (benchmarks/monitor.py).
         allowed=frozenset({"enginewire.testing.monitor.Monitor"})),
)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes in the body of an ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return nodes


def _scan(name: str, source: str, is_package: bool = False,
          known: Collection[str] | None = None) -> list[Import]:
    """``name``'s imports; ``known`` (default: every module of ours) resolves ``from
    package import name`` to the module ``package.name`` where there is one."""
    known = MODULES if known is None else known
    tree = ast.parse(source)
    typing_only = _type_checking_nodes(tree)
    package = name if is_package else name.rpartition(".")[0]
    out: list[Import] = []
    for node in ast.walk(tree):
        hint = id(node) in typing_only
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, None, node.lineno, hint) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in known:
                    out.append(Import(name, sub, None, node.lineno, hint))
                else:
                    out.append(Import(name, target, a.name, node.lineno, hint))
    return out


IMPORTS = {name: _scan(name, path.read_text(encoding="utf-8"), path.name == "__init__.py")
           for name, path in MODULES.items()}


def _broken(rule: Rule, imports: dict[str, list[Import]]) -> list[str]:
    bad = []
    for source in sorted(imports):
        if not _under(source, rule.who):
            continue
        for imp in imports[source]:
            outside = (rule.may_import is not None and _under(imp.target, ("enginewire",))
                       and not _under(imp.target, rule.may_import))
            banned = (_under(imp.target, rule.never)
                      and f"{imp.target}.{imp.name}" not in rule.allowed)
            if not (outside or banned):
                continue
            where = MODULES.get(source)
            at = f"{where.relative_to(ROOT)}:{imp.line}" if where else f"{source}:{imp.line}"
            what = imp.target + (f" ({imp.name})" if imp.name else "")
            bad.append(f"  {at}: {source} imports {what}"
                       + (" under TYPE_CHECKING" if imp.typing_only else ""))
    return bad


@pytest.mark.parametrize("rule", RULES, ids=[r.id for r in RULES])
def test_no_import_crosses_the_layers(rule: Rule) -> None:
    bad = _broken(rule, IMPORTS)
    assert not bad, f"{rule.why}; docs/maintainers.md, The layers:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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
    return cycles


def _import_graph(imports: dict[str, list[Import]]) -> dict[str, set[str]]:
    return {m: {i.target for i in imps if i.target in imports and i.target != m
                and not i.typing_only} for m, imps in imports.items()}


CYCLES = _cycles(_import_graph(IMPORTS))


def test_no_import_cycle() -> None:
    # No exceptions: what two modules share goes into a third that both import (the fault
    # matrix and the interposer share testing/_cells.py; the CLI and the benchmark command
    # share enginewire/_command.py).
    found = [sorted(c) for c in CYCLES]
    assert not found, (
        "import cycles among our modules (move what they share into a module both import;"
        " docs/maintainers.md, The layers):\n"
        + "\n".join(f"  {' <-> '.join(c)}" for c in found))


def test_the_scan_covers_every_installed_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    assert {f"enginewire.{n}" if n else "enginewire" for n in LAYERS.values()} == set(
        package_dir), "LAYERS must name every package pyproject.toml installs"
    assert all(package_dir[f"enginewire.{n}" if n else "enginewire"] == folder
               for folder, n in LAYERS.items())
    for folder in LAYERS:
        assert any(p.parent == ROOT / folder for p in MODULES.values()), folder


def test_the_scan_sees_relative_and_lazy_imports() -> None:
    edges = _import_graph(IMPORTS)
    assert "enginewire.runtime.sync_mp_client" in edges["enginewire.runtime.factory"]
    assert "enginewire.runtime.gguf_loader" not in edges["enginewire.runtime.model"]


@pytest.mark.parametrize("module, source, broken", [
    ("enginewire.protocol.x", "import zmq\n", "protocol"),
    ("enginewire.protocol.x", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    import zmq\n", "protocol"),
    ("enginewire.protocol.x", "def f():\n    from threading import Thread\n", "protocol"),
    ("enginewire.protocol.x", "from threading import local\n", None),
    ("enginewire.protocol.x", "from os import PathLike, fspath\n", None),
    ("enginewire.protocol.x", "from os import remove\n", "protocol"),
    ("enginewire.protocol.x", "from ..runtime import zmq_io\n", "protocol"),
    ("enginewire.protocol.x", "from enginewire.cli import main\n", "protocol"),
    ("enginewire.protocol.x", "from ..spec.errors import ProtocolError\n", None),
    ("enginewire.spec.x", "from ..protocol import codec\n", "spec"),
    ("enginewire.spec.x", "import socket\n", "spec"),
    ("enginewire.runtime.x", "from ..testing import oracle\n", "runtime"),
    ("enginewire.runtime.engine", "import threading\n", "engine-core"),
    ("enginewire.runtime.engine_proc", "import threading\n", None),
    ("enginewire.benchmarks.x", "import enginewire.testing.campaign\n", "benchmarks"),
    ("enginewire.benchmarks.x", "from ..testing.monitor import Monitor\n", None),
    ("enginewire.benchmarks.x", "from ..testing.monitor import Judge\n", "benchmarks"),
    ("enginewire.benchmarks.x", "from ..testing import monitor\n", "benchmarks"),
])
def test_each_rule_catches_what_it_forbids(module: str, source: str, broken: str | None
                                           ) -> None:
    imports = {module: _scan(module, source)}
    got = [r.id for r in RULES if _broken(r, imports)]
    assert got == ([broken] if broken else []), got


def test_the_cycle_check_finds_a_cycle_but_not_through_type_hints() -> None:
    a, b, c = "enginewire.runtime.a", "enginewire.runtime.b", "enginewire.runtime.c"
    sources = {a: "from . import b\n", b: "from .a import x\nfrom . import c\n",
               c: "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"}
    imports = {m: _scan(m, s, known=sources) for m, s in sources.items()}
    assert _cycles(_import_graph(imports)) == [frozenset({a, b})]


def test_the_cycle_check_counts_a_lazy_import() -> None:
    # An import inside a function still makes the modules depend on each other: deferring
    # one side of a cycle does not break it.
    a, b = "enginewire.cli", "enginewire.benchmarks.run"
    sources = {a: "from .benchmarks import run\n",
               b: "def main():\n    from enginewire.cli import main as cli_main\n"}
    imports = {m: _scan(m, s, known=sources) for m, s in sources.items()}
    assert _cycles(_import_graph(imports)) == [frozenset({a, b})]


# The layers users run hold no seeded bug, not even a switched-off branch: the testing package
# patches the clean code from outside (model_tests/mutants.py, reaching engine processes
# through the generic runtime/preload.py hook).
SEEDED_BUG_FREE = ("spec", "protocol", "runtime")


def _mentions_of_mutants(root: Path = ROOT) -> list[str]:
    hits = []
    for folder in SEEDED_BUG_FREE:
        for path in sorted((root / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if "mutant" in line.lower():
                    hits.append(f"  {path.relative_to(root).as_posix()}:{n}: {line.strip()}")
    return hits


def test_no_seeded_bug_lives_in_the_layers_users_run() -> None:
    hits = _mentions_of_mutants()
    assert not hits, ("a mutant belongs to the testing package's bank (model_tests/mutants.py),"
                      " as a source patch of the clean code:\n" + "\n".join(hits))


def test_the_seeded_bug_scan_sees_a_branch(tmp_path: Path) -> None:
    for folder in SEEDED_BUG_FREE:
        (tmp_path / folder).mkdir()
    (tmp_path / "runtime" / "bad.py").write_text('if _mutants.active("x"):\n    pass\n')
    assert _mentions_of_mutants(tmp_path) == ['  runtime/bad.py:1: if _mutants.active("x"):']


# --- private names stay in their module (issue 45, item 1) ----------------------------------
# Our modules import only public names from each other (trio's ``_core`` style).
#
# A name with a leading underscore has one owner, the module that defines it, which may change
# or drop it without looking elsewhere. Where two modules share something, the seam between
# them is a public name, and the underscore goes on the module instead: the private
# ``runtime/_engine_link.py`` defines ``Link``, not ``_Link``. So no module of ours, in any
# installed package, takes a ``_name`` from another with ``from ... import`` (relative, or
# absolute from ``enginewire``), whether at the top, inside a function or under
# ``TYPE_CHECKING``. Importing a private *module* (``from . import _cells``) is the style, not a
# breach; dunders (``__version__``) are not private; tests may still reach into privates.


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(module: str, source: str, is_package: bool = False,
                    known: Collection[str] | None = None) -> list[tuple[int, str]]:
    """``(line, statement)`` for each private name ``module`` imports from a module of ours;
    ``known`` (default: every module of ours) tells an imported private module from a name."""
    known = MODULES if known is None else known
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")
            target = ".".join(base[:len(base) - node.level + 1]
                              + ([node.module] if node.module else []))
        else:
            target = node.module or ""
            if target != "enginewire" and not target.startswith("enginewire."):
                continue
        for alias in node.names:
            if _is_private(alias.name) and f"{target}.{alias.name}" not in known:
                written = "." * node.level + (node.module or "")
                found.append((node.lineno, f"from {written} import {alias.name}"))
    return found


def test_no_module_imports_a_private_name_of_another() -> None:
    bad = [f"  {path.relative_to(ROOT).as_posix()}:{line}: {statement}"
           for module, path in MODULES.items()
           for line, statement in private_imports(module, path.read_text(encoding="utf-8"),
                                                  path.name == "__init__.py")]
    assert not bad, (
        "a private name is its module's own; make it public where it is defined (drop the"
        " underscore, keep it on the module) and import that:\n" + "\n".join(bad))


KNOWN = ("enginewire.runtime.a", "enginewire.runtime._mod", "enginewire.testing._cells")


@pytest.mark.parametrize("source, flagged", [
    ("from .a import _b\n", [(1, "from .a import _b")]),
    ("from .a import b, _c as c\n", [(1, "from .a import _c")]),
    ("from ..spec.compose import _ix\n", [(1, "from ..spec.compose import _ix")]),
    ("from enginewire.runtime.a import _b\n", [(1, "from enginewire.runtime.a import _b")]),
    ("def f():\n    from ._mod import _b\n", [(2, "from ._mod import _b")]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import _T\n",
     [(3, "from .a import _T")]),
    ("from .a import b\n", []),
    ("from .a import __version__\n", []),
    ("from . import _mod\n", []),
    ("from ..testing import _cells as cells\n", []),
    ("from enginewire.runtime import _mod\n", []),
    ("from os import _exit\n", []),
])
def test_the_check_flags_a_private_name_and_nothing_else(
        source: str, flagged: list[tuple[int, str]]) -> None:
    assert private_imports("enginewire.runtime.x", source, known=KNOWN) == flagged
