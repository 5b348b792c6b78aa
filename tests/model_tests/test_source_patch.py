"""model_tests/source_patch.py: a function's code swapped in place for an edited copy of its
source, seen through every reference, put back by revert, and refused when a snippet drifted."""

from __future__ import annotations

import importlib
import textwrap
import traceback
from pathlib import Path
from types import ModuleType

import pytest

from enginewire.testing.source_patch import (
    PatchDriftError,
    SourcePatch,
    apply_patches,
    compile_patch,
)

TOY = '''\
from __future__ import annotations

import functools


class Base:
    def greet(self) -> str:
        return "base"


class Child(Base):
    def greet(self) -> str:
        note: list[str] = ["child"]
        return super().greet() + "-" + note[0]

    @property
    def size(self) -> int:
        return 1

    @staticmethod
    def two() -> int:
        return 2


def counter():
    step = 1

    def bump(n: int) -> int:
        return n + step
    return bump


def logged(f):
    @functools.wraps(f)
    def wrapper(*args):
        return f(*args)
    return wrapper


@logged
def top(a: int) -> int:
    """Docstring whose second line sits
at column 0."""
    if a:
        return 1
    return 0
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    name = f"toy_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def _p(toy: ModuleType, target: str, *edits: tuple[str, str]) -> SourcePatch:
    return SourcePatch(f"{toy.__name__}:{target}", edits)


def test_every_reference_sees_the_patch_and_revert_restores_the_code(toy: ModuleType) -> None:
    child = toy.Child()
    bound, bump = child.greet, toy.counter()
    originals = [f.__code__ for f in (toy.Child.greet, toy.Child.size.fget,
                                      vars(toy.Child)["two"].__func__, toy.top.__wrapped__)]
    applied = apply_patches((
        _p(toy, "Child.greet", ('+ "-" + note[0]', '+ "-mutated"')),  # super() and __class__
        _p(toy, "Child.size", ("return 1", "return 10")),  # under a property
        _p(toy, "Child.two", ("return 2", "return 20")),  # under a staticmethod
        _p(toy, "counter", ("return n + step", "return n + 2 * step")),  # a closure's cell
        # functools.wraps is looked through; a line becomes a block
        _p(toy, "top", ("if a:\n    return 1", "if a:\n    doubled = 2\n    return doubled")),
    ), "toy mutant")
    try:
        assert (bound(), child.size, toy.Child.two(), toy.top(1), toy.top(0)) == (
            "base-mutated", 10, 20, 2, 0)
        assert bump(1) == 2  # a closure made before the patch: it runs the old inner code
        assert toy.counter()(1) == 3  # the one made now: the patched outer made the new one
        assert toy.Child.greet.__qualname__ == "Child.greet"
    finally:
        applied.revert()
    assert (bound(), child.size, toy.Child.two(), toy.top(1)) == ("base-child", 1, 2, 1)
    assert [f.__code__ for f in (toy.Child.greet, toy.Child.size.fget,
                                 vars(toy.Child)["two"].__func__,
                                 toy.top.__wrapped__)] == originals
    assert all(a is b for a, b in zip(originals, [
        toy.Child.greet.__code__, toy.Child.size.fget.__code__,
        vars(toy.Child)["two"].__func__.__code__, toy.top.__wrapped__.__code__], strict=True))


def test_a_traceback_points_at_the_file_and_line(toy: ModuleType) -> None:
    applied = apply_patches((_p(toy, "top", ("return 0", "raise ValueError('seeded')")),), "m")
    try:
        with pytest.raises(ValueError) as info:
            toy.top(0)
    finally:
        applied.revert()
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename == toy.__file__ and frame.name == "top"
    assert frame.lineno == TOY.splitlines().index("    return 0") + 1


@pytest.mark.parametrize(("target", "edit", "says"), [
    ("Child.greet", ("no such code", "x"), "occurs 0 times"),
    ("Child.greet", ("e", "x"), "times in the function, not once"),
    ("Base.greet", ('return "base"', "return ("), "does not compile"),
    ("Child.greet", ('return super().greet() + "-" + note[0]', 'return "no super"'),
     "changes the free variables"),
    ("Child.nothing", ("a", "b"), "cannot be read"),
    ("Base.greet", ("def greet(self)", "def other(self)"), "no longer the def of greet"),
])
def test_a_drifted_patch_is_refused_naming_owner_and_target(
        toy: ModuleType, target: str, edit: tuple[str, str], says: str) -> None:
    with pytest.raises(PatchDriftError, match=says) as info:
        compile_patch(_p(toy, target, edit), "mutant m")
    assert str(info.value).startswith(f"mutant m: patch of {toy.__name__}:{target}: ")


def test_a_method_named_through_a_subclass_is_refused(toy: ModuleType) -> None:
    class Sub(toy.Child):  # type: ignore[name-defined,misc]
        pass

    toy.Sub = Sub
    with pytest.raises(PatchDriftError, match=r"is Child.greet"):
        compile_patch(_p(toy, "Sub.greet", ("base", "x")), "m")


def test_patches_apply_all_or_none(toy: ModuleType) -> None:
    before = toy.Child.size.fget.__code__
    with pytest.raises(PatchDriftError):
        apply_patches((_p(toy, "Child.size", ("return 1", "return 10")),
                       _p(toy, "Child.two", ("return 3", "return 30"))), "m")
    assert toy.Child.size.fget.__code__ is before and toy.Child().size == 1


def test_snippet_indentation_follows_the_line_it_replaces() -> None:
    from enginewire.testing.source_patch import _edit

    src = textwrap.dedent("""\
        def f(x):
            for i in x:
                if i:
                    g(i)
            return x
        """)
    out, n = _edit(src, "if i:\n    g(i)", "if i:\n    g(i)\nelse:\n    break")
    assert n == 1 and "        else:\n            break\n" in out
    assert _edit(src, "if i:\ng(i)", "x") == (src, 0)  # the block's own indentation matters
