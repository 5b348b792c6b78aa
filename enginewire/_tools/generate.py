"""Write, or check fresh, every file generated from the spec tables.

``python -m enginewire._tools.generate`` rewrites them; ``--check`` writes nothing and exits
1 naming each stale or missing file (trio's ``_tools/gen_exports.py --test``). The generated
files are production code and docs, so their generator sits in the top package, not in the
test harness. The renderers themselves are pure functions beside their declarations
(``enginewire.spec``, ``enginewire.protocol``, ``enginewire.runtime.options``); only this
module touches files.

The generated files belong to a source checkout. In an editable install the checkout is found
from this file; in a wheel install this file sits in site-packages, so the default root is
refused (exit 3, nothing written) and ``--root PATH`` names the checkout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from enginewire.protocol.catalogue import render_protocol_page
from enginewire.protocol.utilities import render_utilities_page, render_wrappers
from enginewire.runtime.options import render_options_page
from enginewire.spec import MACHINES, compose, compose_dp, compose_fe, properties
from enginewire.spec.diagrams import render_dot, render_mermaid, render_spec_page
from enginewire.spec.machine import render_runtime_tables
from enginewire.spec.promela import render_promela
from enginewire.spec.promela_dp import render_promela_dp
from enginewire.spec.promela_fe import render_promela_fe

__all__ = [
    "ROOT",
    "NotACheckoutError",
    "check_generated",
    "generated_files",
    "is_checkout",
    "main",
    "write_diagrams",
    "write_generated",
]

# The repository root: enginewire/_tools/ sits two levels under it (editable install). In a
# wheel install this is site-packages, which is not a checkout (see _checkout_root).
ROOT = Path(__file__).resolve().parents[2]


class NotACheckoutError(FileNotFoundError):
    """The default root is not an enginewire source checkout (a wheel install)."""


def is_checkout(root: Path) -> bool:
    """``root`` holds enginewire's pyproject.toml next to spec/ and docs/."""
    try:
        pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return ('name = "enginewire"' in pyproject and (root / "spec").is_dir()
            and (root / "docs").is_dir())


def _imported_sources_differ(root: Path) -> list[str]:
    """The declaration files of checkout ``root`` that differ from the ones this process
    imported: the generated files are a function of the imported ones, so writing or checking
    them against another checkout's sources would be wrong (a wheel run against a changed
    checkout)."""
    import enginewire.protocol as protocol_pkg
    import enginewire.runtime.options as options_module
    import enginewire.spec as spec_pkg

    differ: list[str] = []
    for pkg, name in ((spec_pkg, "spec"), (protocol_pkg, "protocol")):
        here = Path(pkg.__file__ or "").resolve().parent
        there = root / name
        names = {p.name for p in here.glob("*.py")} | {p.name for p in there.glob("*.py")}
        for src in sorted(names):
            if src == "_tables.py":  # generated itself
                continue
            a, b = here / src, there / src
            if not (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()):
                differ.append(f"{name}/{src}")
    # The options records, which docs/options.md is generated from.
    a, b = Path(options_module.__file__ or ""), root / "runtime" / "options.py"
    if not (b.is_file() and a.read_bytes() == b.read_bytes()):
        differ.append("runtime/options.py")
    return differ


def _checkout_root(root: Path | None) -> Path:
    """``root`` as given, or the default ROOT when it is a checkout; never site-packages."""
    if root is not None:
        if is_checkout(root) and root.resolve() != ROOT:
            differ = _imported_sources_differ(root)
            if differ:
                raise NotACheckoutError(
                    f"{root}'s declarations differ from the imported enginewire's"
                    f" ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}): the files"
                    f" are generated from what is imported; install that checkout"
                    f" (pip install -e {root}) and run its generator")
        return root
    if not is_checkout(ROOT):
        raise NotACheckoutError(
            f"{ROOT} is not an enginewire source checkout (no pyproject.toml naming enginewire "
            "next to spec/ and docs/): the generated files live in a checkout; "
            "use --root PATH to point at one")
    return ROOT


def _diagrams() -> dict[str, str]:
    out: dict[str, str] = {}
    for mach in MACHINES:
        out[f"{mach.name}.mmd"] = render_mermaid(mach)
        out[f"{mach.name}.dot"] = render_dot(mach)
    return out


def generated_files(root: Path = ROOT) -> dict[Path, str]:
    """Every generated path (under ``root``) and the text it must hold, in a fixed order."""
    files: dict[Path, str] = {
        root / "spec" / "_tables.py": render_runtime_tables(MACHINES),
        root / "spec" / "enginewire.pml": render_promela(),
        root / "spec" / "enginewire_dp.pml": render_promela_dp(),
        root / "spec" / "enginewire_fe.pml": render_promela_fe(),
    }
    for name, text in _diagrams().items():
        files[root / "docs" / "diagrams" / name] = text
    files[root / "docs" / "spec.md"] = render_spec_page(
        MACHINES,
        composition_doc=compose.__doc__ or "",
        properties_doc=properties.__doc__ or "",
        bounds={"BUDGET": compose.BUDGET, "FAULTS": compose.FAULTS, "IN_CAP": compose.IN_CAP,
                "OUT_CAP": compose.OUT_CAP, "TOKENS": compose.TOKENS},
        controls=properties.control_targets(),
        dp_doc=compose_dp.__doc__ or "",
        dp_bounds={"N": compose_dp.N, "REQS": compose_dp.REQS, "BUDGET": compose_dp.BUDGET,
                   "FAULTS": compose_dp.FAULTS, "IN_CAP": compose_dp.IN_CAP,
                   "OUT_CAP": compose_dp.OUT_CAP},
        dp_controls=properties.dp_control_targets(),
        fe_doc=compose_fe.__doc__ or "",
        fe_bounds={"F": compose_fe.F, "N": compose_fe.N, "BUDGET": compose_fe.BUDGET,
                   "FAULTS": compose_fe.FAULTS, "IN_CAP": compose_fe.IN_CAP,
                   "OUT_CAP": compose_fe.OUT_CAP},
        fe_controls=properties.fe_control_targets(),
    )
    files[root / "docs" / "protocol.md"] = render_protocol_page()
    files[root / "runtime" / "_utilities.py"] = render_wrappers()
    files[root / "docs" / "utilities.md"] = render_utilities_page()
    files[root / "docs" / "options.md"] = render_options_page()
    return files


def check_generated(root: Path | None = None) -> list[Path]:
    """The generated files that are missing or differ from what the tables produce now.
    ``root`` defaults to the checkout this module was loaded from (NotACheckoutError if none)."""
    root = _checkout_root(root)
    stale: list[Path] = []
    for path, text in generated_files(root).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
    return stale


def write_generated(root: Path | None = None) -> list[Path]:
    """Rewrite every stale generated file; returns the paths written. ``root`` defaults as in
    ``check_generated``: nothing is ever written into an installed package."""
    root = _checkout_root(root)
    written: list[Path] = []
    for path in check_generated(root):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(generated_files(root)[path], encoding="utf-8")
        written.append(path)
    return written


def write_diagrams(out: Path) -> list[Path]:
    """``enginewire spec diagrams --out DIR``: one ``.mmd`` and one ``.dot`` per machine."""
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for name, text in _diagrams().items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m enginewire._tools.generate",
        description="Rewrite (or, with --check, verify) every file generated from the spec "
        "tables in an enginewire source checkout.",
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    parser.add_argument(
        "--root",
        type=Path,
        metavar="PATH",
        help="the source checkout to check or write (default: the checkout this module runs "
        "from; required when enginewire is installed from a wheel)",
    )
    args = parser.parse_args(argv)
    if args.root is not None and not args.root.is_dir():
        print(f"{parser.prog}: error: --root {args.root}: not a directory", file=sys.stderr)
        return 2
    try:
        root = _checkout_root(args.root)
    except NotACheckoutError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 3
    if args.check:
        stale = check_generated(root)
        for path in stale:
            print(f"stale: {path.relative_to(root)}", file=sys.stderr)
        if stale:
            print("Generated files are outdated; run `python -m enginewire._tools.generate`.",
                  file=sys.stderr)
            return 1
        return 0
    for path in write_generated(root):
        print(f"wrote {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
