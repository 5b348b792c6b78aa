"""Write, or check fresh, every file generated from the spec tables.

``python -m enginewire.testing.generate`` rewrites them; ``--check`` writes nothing and exits
1 naming each stale or missing file (trio's ``gen_exports.py --test``). The generators
themselves are pure functions in ``enginewire.spec``; only this module touches files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from enginewire.protocol.catalogue import render_protocol_page
from enginewire.spec import MACHINES, compose, properties
from enginewire.spec.diagrams import render_dot, render_mermaid, render_spec_page
from enginewire.spec.machine import render_runtime_tables
from enginewire.spec.promela import render_promela

__all__ = [
    "ROOT",
    "check_generated",
    "generated_files",
    "main",
    "write_diagrams",
    "write_generated",
]

# The repository root: model_tests/ sits directly under it (editable install).
ROOT = Path(__file__).resolve().parent.parent


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
    )
    files[root / "docs" / "protocol.md"] = render_protocol_page()
    return files


def check_generated(root: Path = ROOT) -> list[Path]:
    """The generated files that are missing or differ from what the tables produce now."""
    stale: list[Path] = []
    for path, text in generated_files(root).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
    return stale


def write_generated(root: Path = ROOT) -> list[Path]:
    """Rewrite every stale generated file; returns the paths written."""
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
    parser = argparse.ArgumentParser(prog="python -m enginewire.testing.generate")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        stale = check_generated(args.root)
        for path in stale:
            print(f"stale: {path.relative_to(args.root)}", file=sys.stderr)
        if stale:
            print("Generated files are outdated; run `python -m enginewire.testing.generate`.",
                  file=sys.stderr)
            return 1
        return 0
    for path in write_generated(args.root):
        print(f"wrote {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
