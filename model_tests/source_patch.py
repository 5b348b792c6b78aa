"""Source patches: a function's code replaced, in place, by an edited copy of its own source.

Theory of operation
-------------------
A ``SourcePatch`` names a function (``"package.module:Class.method"``) and edits its source
as ``(old, new)`` snippet pairs. ``compile_patch`` reads the function's source (``inspect``),
requires each old snippet exactly once (else ``PatchDriftError``, naming the patch's owner and
target: the code moved under the patch), and compiles the edited ``def`` on its own;
``apply_patches`` then assigns each new code object to its function's ``__code__``. Every
reference to the function (a bound method, an alias, a thread target or callback already
registered) runs the edited code from its next call on, and ``AppliedPatches.revert`` puts the
original code objects back.

Snippets are written dedented. An old snippet's first line may start anywhere in a line; its
further lines are matched with the indentation of the line it starts on, and a new snippet's
further lines are indented the same way, so a replacement can add a block (an ``if`` and its
body) where a single line stood.

The edited ``def`` is compiled inside an outer function that binds the original's free
variables (``__class__`` for a zero-argument ``super()``, a closure's cells) as its own
locals, so the new code has the same free variables and fits the function's closure. It keeps
the file's name and the ``def``'s line number (a traceback points at the file; lines after a
multi-line edit shift by the lines it added). Decorators are not re-applied: the function
under a ``property``, ``staticmethod``, ``classmethod`` or ``functools.wraps`` wrapper is the
one patched.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from types import CodeType, FunctionType
from typing import Any

__all__ = ["AppliedPatches", "PatchDriftError", "SourcePatch", "apply_patches", "compile_patch"]

_OUTER = "__source_patch_outer__"
# The future features a code object records in its flags: the edited copy is compiled
# under the same ones as its module (``from __future__ import annotations`` and the like).
_FUTURE_FLAGS = [getattr(__future__, f).compiler_flag for f in __future__.all_feature_names]


class PatchDriftError(Exception):
    """A patch no longer fits its target: a snippet is missing or ambiguous, the target is
    gone, or the edited source does not compile. The message names the owner and target."""


@dataclass(frozen=True)
class SourcePatch:
    target: str  # "package.module:Qualified.name" of a function, method or property
    edits: tuple[tuple[str, str], ...]  # (old snippet, new snippet), applied in order

    def resolve(self) -> FunctionType:
        """The plain function object the target names (decorators looked through)."""
        module_name, sep, qualname = self.target.partition(":")
        if not sep or not module_name or not qualname:
            raise ValueError(f"patch target {self.target!r} is not 'module:qualified.name'")
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            # The class's own attribute, not what a descriptor returns for it.
            obj = vars(obj)[part] if part in vars(obj) else getattr(obj, part)
        if isinstance(obj, property):
            obj = obj.fget
        elif isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        obj = inspect.unwrap(obj)
        if not isinstance(obj, FunctionType):
            raise TypeError(f"patch target {self.target!r} is a {type(obj).__name__},"
                            " not a function defined in Python")
        if obj.__qualname__ != qualname:  # found through a subclass: name where it is defined
            raise ValueError(f"patch target {self.target!r} is {obj.__qualname__}")
        return obj


def _edit(source: str, old: str, new: str) -> tuple[str, int]:
    """``source`` with ``old`` replaced by ``new`` if it occurs exactly once; the count."""
    first, *rest = old.split("\n")
    found: list[tuple[int, str, str]] = []
    at = source.find(first)
    while at >= 0:
        line_start = source.rfind("\n", 0, at) + 1
        indent = re.match(r"[ \t]*", source[line_start:])
        assert indent is not None
        pad = indent.group()
        expected = "\n".join([first, *(pad + r if r else r for r in rest)])
        if source.startswith(expected, at):
            found.append((at, pad, expected))
        at = source.find(first, at + 1)
    if len(found) != 1:
        return source, len(found)
    at, pad, expected = found[0]
    new_first, *new_rest = new.split("\n")
    replacement = "\n".join([new_first, *(pad + r if r else r for r in new_rest)])
    return source[:at] + replacement + source[at + len(expected):], 1


def compile_patch(patch: SourcePatch, owner: str) -> tuple[FunctionType, CodeType]:
    """The target and its edited code object, checked to fit it (``PatchDriftError``)."""
    where = f"{owner}: patch of {patch.target}"
    try:
        func = patch.resolve()
        lines, first_line = inspect.getsourcelines(func)
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, OSError) as e:
        raise PatchDriftError(f"{where}: the target cannot be read ({e})") from e
    source = "".join(lines)
    for old, new in patch.edits:
        source, count = _edit(source, old, new)
        if count != 1:
            raise PatchDriftError(
                f"{where}: the snippet {old!r} occurs {count} times in the function, not once"
                " (the runtime changed under the patch: update the snippet)")
    code = func.__code__
    try:
        # "if 1:" takes an indented method as it stands: no dedent, which would rewrite the
        # indentation inside multi-line strings.
        # Blank lines first, so every line number (a syntax error's too) is the file's.
        indented = source[:1] in (" ", "\t")
        head = "\n" * (first_line - 2) + "if 1:\n" if indented else "\n" * (first_line - 1)
        tree = ast.parse(head + source, filename=code.co_filename)
        body = tree.body
        if indented and isinstance(body[0], ast.If):
            body = body[0].body
        inner = body[0]
        if len(body) != 1 or not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                inner.name != code.co_name):
            raise SyntaxError(f"the edited source is no longer the def of {code.co_name} alone")
        inner.decorator_list = []
        cells: list[ast.stmt] = [
            ast.Assign(targets=[ast.Name(v, ast.Store())], value=ast.Constant(None))
            for v in code.co_freevars]
        # Parsed, not built, so the node has every field this Python's grammar gives a def.
        module = ast.parse(f"def {_OUTER}(): pass")
        (outer,) = module.body
        assert isinstance(outer, ast.FunctionDef)
        outer.body = [*cells, inner]
        ast.copy_location(outer, inner)  # the cells take its place (fix_missing_locations)
        ast.fix_missing_locations(module)
        flags = sum(f for f in _FUTURE_FLAGS if code.co_flags & f)
        compiled = compile(module, code.co_filename, "exec", flags=flags, dont_inherit=True)
    except SyntaxError as e:
        raise PatchDriftError(f"{where}: the edited source does not compile ({e})") from e
    outer_code = next(c for c in compiled.co_consts if isinstance(c, CodeType))
    edited = next(c for c in outer_code.co_consts
                  if isinstance(c, CodeType) and c.co_name == code.co_name)
    if edited.co_freevars != code.co_freevars:  # __code__ must fit the closure as it is
        raise PatchDriftError(f"{where}: the edit changes the free variables"
                              f" {code.co_freevars} to {edited.co_freevars}")
    return func, edited.replace(co_qualname=code.co_qualname)


@dataclass
class AppliedPatches:
    """What ``apply_patches`` changed, to put back."""

    originals: list[tuple[FunctionType, CodeType]]

    def revert(self) -> None:
        for func, code in reversed(self.originals):
            func.__code__ = code
        self.originals.clear()


def apply_patches(patches: tuple[SourcePatch, ...], owner: str) -> AppliedPatches:
    """Apply every patch, or none: all are compiled and checked before any is assigned."""
    compiled = [compile_patch(p, owner) for p in patches]
    applied = AppliedPatches([])
    for func, code in compiled:
        applied.originals.append((func, func.__code__))
        func.__code__ = code
    return applied
