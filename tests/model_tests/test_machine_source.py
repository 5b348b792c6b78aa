"""The campaign machines' source, read as a tree: every check says what failed, and every
rule choice can be replayed (Rule 1 of ``stateful_client.py``: preconditions and strategies
read only the model).

Hypothesis replays a failing example by feeding its recorded choices to the same rules. A
precondition that reads the live system (how far the engine got, a clock) lets the replay see
other rules enabled and draw otherwise (``FlakyStrategyDefinition``), and a draw made inside
a rule (``st.data()``) can take its shape from such state too; neither is replayable.
"""

from __future__ import annotations

import ast
from pathlib import Path

import enginewire.testing

ROOT = Path(enginewire.testing.__file__).parent
MACHINES = sorted(ROOT.glob("stateful*.py"))
# Where checks live: the machines, the oracle, the conformance suite.
CHECKS = [*MACHINES, ROOT / "oracle.py", ROOT / "conformance.py",
          ROOT / "conformance_breaking.py"]

# What a precondition may read of ``self``: the model of the system and the machine's own
# settings and counters, each changed only by the rules the program ran (not by what the
# engine did meanwhile). A new precondition that needs more adds its attribute here, with the
# reason it is no live state.
MODEL_ONLY = frozenset({
    "self.alive",  # the oracle's phase, and whether a client incarnation is held
    "self.live",  # held or not (compared with None): restart and new_client set it
    "self.oracle.phase", "self.oracle.paused",  # what the rules told the model
    "self.oracle.requests",  # the requests the rules added (whether any: not how far)
    "self.faults", "self.kind", "self.multiprocess", "self.restarts",  # settings, draws
    "self.limits.prefix_prompt_len",  # the client's config
    "self.client_checks_ids",  # what the factory declares (``contract``): fixed for the run
    "self._life", "self.min_life", "self._orphans", "self.orphan_min_life",
    "self.orphan_config", "self._deaths",  # counted by the rules themselves
    "self.engines",  # the data-parallel model's engine count (the oracle's set: scale rules)
    # the front-end machine: the engine's power state as its sleep and wake_up rules set it,
    # and which front ends it holds (its crash and restart rules set them)
    "self.asleep", "self.fes",
})


def _chain(node: ast.AST) -> str | None:
    """``self.a.b`` as a dotted name (None: not an attribute chain rooted at a name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _preconditions(path: Path) -> list[tuple[int, ast.Lambda]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "precondition"
                and node.args and isinstance(node.args[0], ast.Lambda)):
            out.append((node.lineno, node.args[0]))
    return out


def _reads(expr: ast.AST) -> list[str]:
    """What ``expr`` reads: the longest ``self`` chains, other names, and calls."""
    reads: list[str] = []
    for node in ast.walk(expr):
        if isinstance(node, ast.Call):
            reads.append(f"a call of {ast.unparse(node.func)}()")
        elif isinstance(node, ast.Attribute | ast.Name):
            chain = _chain(node)
            parent_is_chain = any(isinstance(p, ast.Attribute) and p.value is node
                                  for p in ast.walk(expr))
            if chain is not None and not parent_is_chain:
                reads.append(chain)
    return reads


def test_preconditions_read_only_the_model() -> None:
    found = 0
    for path in MACHINES:
        for line, fn in _preconditions(path):
            found += 1
            for read in _reads(fn.body):
                # Phase members and module constants (MAX_DEATHS) are fixed.
                ok = read in MODEL_ONLY or read.startswith("Phase.") or read.isupper()
                assert ok, (f"{path.name}:{line}: a precondition reads {read}, which is not"
                            " the model (MODEL_ONLY): a rule choice that depends on the live"
                            " system cannot be replayed; decide it inside the rule instead")
    assert found >= 30, f"only {found} preconditions found: is _preconditions still right?"


def test_no_rule_draws_inside_its_body() -> None:
    for path in MACHINES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("st.data", "data.draw"):
                raise AssertionError(
                    f"{path.name}:{node.lineno}: {ast.unparse(node)} draws inside a rule,"
                    " where the draw's shape can follow the live system; give the rule an"
                    " argument drawn by its @rule strategy instead")


def _narrowing(test: ast.expr) -> bool:
    """``x is not None`` on a name or attribute: a note to the type checker, not a check."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None and _chain(test.left) is not None)


def test_no_check_ends_in_a_bare_assert() -> None:
    bare = [f"{path.name}:{node.lineno}: assert {ast.unparse(node.test)}"
            for path in CHECKS
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Assert) and node.msg is None and not _narrowing(node.test)]
    assert not bare, ("checks without a message (a campaign or a user's suite would fail"
                      " with a bare AssertionError): " + "; ".join(bare))
