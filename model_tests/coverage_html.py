"""The campaign's coverage page: every machine's diagram, each transition styled by its hits.

Theory of operation
-------------------
Rule 1: the page is drawn from the campaign's JSON report and nothing else, so a kept report
can be turned into its page again (``write_coverage_html(json.load(f), path)``).
Rule 2: the arrows are the diagrams' own (``spec.diagrams.edge_transitions``, the grouping
behind ``docs/diagrams``): one arrow per pair of states, drawn as one strand per transition on
it, so a reached event and an unreached one on the same arrow each keep their own style.

Layout: where Graphviz is installed, ``dot -Tplain`` lays out ``render_dot(machine)`` (the
committed diagram's text) and only its coordinates are used; otherwise a layered layout made
here (states in columns by distance from the initial state). Either way the SVG is written
here, so the styling is the same, and the page needs neither the network nor Graphviz to be
read: one self-contained file, every text escaped.

Styling: a reached transition is solid, its colour and width by hit count (bins of powers of
ten, the same on every page, so two runs compare by eye); an unreached one is dashed grey, or
dashed red when no reason is declared for it (a gap). Each strand and its label carry a
``<title>`` (the browser's tooltip): the count, or the declared reason.
"""

from __future__ import annotations

import html
import math
import re
import shlex
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..spec import MACHINES
from ..spec.diagrams import edge_transitions, render_dot, transition_label
from ..spec.machine import Machine

__all__ = ["LAYOUTS", "render_coverage_html", "write_coverage_html", "write_reproducers"]

# "auto": dot where it is on PATH, the layered layout otherwise.
LAYOUTS = ("auto", "dot", "layered")
# Hit-count bins (1, 2-9, 10-99, 100-999, 1000+): colour and stroke width of a reached strand.
_BIN_COLOURS = ("#9ecae1", "#6baed6", "#3182bd", "#08519c", "#08306b")
_BIN_WIDTHS = (1.4, 1.9, 2.4, 2.9, 3.4)
_UNREACHED_COLOUR = "#8c8c8c"
_GAP_COLOUR = "#d62728"
_DASH = "5 4"
# How why_unreached in campaign.py words a transition with no declared reason.
_GAP = "NOT REACHED in this run"
_NO_REASON = "no declared reason"
# A layout is a few milliseconds; the bound is for a dot that hangs.
_DOT_TIMEOUT_S = 10.0
_STRAND_GAP = 2.5  # px between the strands of one arrow
_LINE = 11.0  # px per label line (10 px font)
_PX = 72.0  # dot's plain output is in inches


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


@dataclass(frozen=True)
class _Strand:
    """One transition on an arrow, as the page shows it."""

    key: str  # "machine SOURCE -EVENT-> TARGET", as the report names it
    label: str
    count: int
    why: str  # the declared reason when unreached; "" when reached
    note: str

    @property
    def style(self) -> str:
        if self.count > 0:
            return f"hit{min(len(_BIN_COLOURS) - 1, int(math.log10(self.count)))}"
        return "gap" if self.why.startswith(_GAP) or self.why == _NO_REASON else "unreached"

    @property
    def title(self) -> str:
        if self.count > 0:
            times = "time" if self.count == 1 else "times"
            return f"{self.key}: reached {self.count} {times}" + (
                f"\n{self.note}" if self.note else "")
        return f"{self.key}: never reached: {self.why}"


def _style(style: str) -> tuple[str, float, str]:
    """(colour, width, dasharray) of a strand style."""
    if style.startswith("hit"):
        b = int(style[3:])
        return _BIN_COLOURS[b], _BIN_WIDTHS[b], ""
    return (_GAP_COLOUR if style == "gap" else _UNREACHED_COLOUR), 1.4, _DASH


Point = tuple[float, float]


@dataclass(frozen=True)
class _Box:
    x: float  # centre
    y: float
    w: float
    h: float


@dataclass(frozen=True)
class _Layout:
    name: str  # "dot" or "layered"
    boxes: dict[str, _Box]  # "__start" is the initial marker
    # The initial marker's arrow, then one per arrow of edge_transitions, in its order: a
    # cubic chain [P0, C1, C2, P1, ...] and the centre of its label block.
    curves: list[tuple[list[Point], Point]]


# --- layouts ---------------------------------------------------------------------------------


def _dot_layout(machine: Machine[Any, Any], arrows: Sequence[tuple[str, str, int]]) -> _Layout:
    """Coordinates from ``dot -Tplain`` run on the committed diagram's text; raises when
    Graphviz is missing or answers something unexpected."""
    dot = shutil.which("dot")
    if dot is None:
        raise FileNotFoundError("dot")
    # One event per label line: the labels are stacked one strand per line here, so dot must
    # leave room for that block, not for the diagram's one-line label.
    text = re.sub(r'(-> "[^"]*" \[label=)"([^"]*)"',
                  lambda m: m[1] + '"' + m[2].replace(", ", "\\n") + '"', render_dot(machine))
    out = subprocess.run([dot, "-Tplain"], input=text, capture_output=True, text=True,
                         timeout=_DOT_TIMEOUT_S, check=True).stdout
    height = 0.0
    boxes: dict[str, _Box] = {}
    found: dict[tuple[str, str], list[tuple[list[Point], Point]]] = {}
    for line in out.splitlines():
        f = shlex.split(line)
        if f and f[0] == "graph":
            height = float(f[3])
        elif f and f[0] == "node":
            boxes[f[1]] = _Box(float(f[2]) * _PX, (height - float(f[3])) * _PX,
                               float(f[4]) * _PX, float(f[5]) * _PX)
        elif f and f[0] == "edge":
            n = int(f[3])
            pts = [(float(f[4 + 2 * i]) * _PX, (height - float(f[5 + 2 * i])) * _PX)
                   for i in range(n)]
            rest = f[4 + 2 * n:]
            at = ((float(rest[1]) * _PX, (height - float(rest[2])) * _PX) if len(rest) >= 5
                  else pts[len(pts) // 2])
            found.setdefault((f[1], f[2]), []).append((pts, at))
    curves = [found[("__start", machine.initial.name)][0],
              *(found[(src, dst)][0] for src, dst, _ in arrows)]
    if "__start" not in boxes or any(s.name not in boxes for s in machine.state_members()):
        raise ValueError("dot's layout lacks a state")
    return _Layout("dot", boxes, curves)


def _clip(box: _Box, toward: Point) -> Point:
    """Where the segment from ``box``'s centre toward ``toward`` leaves the box."""
    dx, dy = toward[0] - box.x, toward[1] - box.y
    if dx == 0 and dy == 0:
        return box.x, box.y
    t = min(box.w / 2 / abs(dx) if dx else math.inf, box.h / 2 / abs(dy) if dy else math.inf)
    return box.x + t * dx, box.y + t * dy


def _layered_layout(machine: Machine[Any, Any],
                    arrows: Sequence[tuple[str, str, int]]) -> _Layout:
    """States in columns by distance from the initial state (declaration order within one),
    the terminal ones in a last column of their own (as dot tends to put them), arrows as bent
    curves: deterministic, and readable enough without Graphviz."""
    names = [s.name for s in machine.state_members()]
    terminal = {s.name for s in machine.terminal}
    rank = {machine.initial.name: 0}
    frontier = [machine.initial.name]
    while frontier:
        nxt = []
        for name in frontier:
            for src, dst, _ in arrows:
                if src == name and dst not in rank and dst not in terminal:
                    rank[dst] = rank[name] + 1
                    nxt.append(dst)
        frontier = nxt
    last = max(rank.values()) + 1
    columns: list[list[str]] = [[] for _ in range(last + 2)]
    for name in names:
        columns[last + 1 if name in terminal else rank.get(name, last)].append(name)
    columns = [c for c in columns if c]
    gap_x, gap_y, h = 230.0, 45.0, 30.0
    # Room above a state for its loop and the loop's label lines.
    loops = {src: n for src, dst, n in arrows if src == dst}
    above = {n: 60 + loops[n] * _LINE if n in loops else 10.0 for n in names}
    heights = [sum(above[n] + h + gap_y for n in col) for col in columns]
    boxes: dict[str, _Box] = {}
    x = 60.0
    for col, height in zip(columns, heights, strict=True):
        width = max(8.0 * len(n) + 24 for n in col)
        y = (max(heights) - height) / 2
        for name in col:
            y += above[name] + h / 2
            boxes[name] = _Box(x + width / 2, y, 8.0 * len(name) + 24, h)
            y += h / 2 + gap_y
        x += width + gap_x
    first = boxes[machine.initial.name]
    boxes["__start"] = _Box(first.x - first.w / 2 - 30, first.y, 6, 6)
    curves: list[tuple[list[Point], Point]] = []
    for src, dst, lines in arrows:
        a, b = boxes[src], boxes[dst]
        if src == dst:
            top, q = a.y - a.h / 2, a.w / 4
            pts = [(a.x - q, top), (a.x - q - 25, top - 50), (a.x + q + 25, top - 50),
                   (a.x + q, top)]
            curves.append((pts, (a.x, top - 44 - lines * _LINE / 2)))
            continue
        dx, dy = b.x - a.x, b.y - a.y
        dist = math.hypot(dx, dy)
        # Bent to the left of its direction: A->B and B->A part instead of overlapping; more
        # within a column, where a straight line would run through the states between.
        bend = (0.35 * dist + 30) if abs(dx) < 1 else 0.15 * dist
        ctrl = ((a.x + b.x) / 2 + dy / dist * bend, (a.y + b.y) / 2 - dx / dist * bend)
        p0, p2 = _clip(a, ctrl), _clip(b, ctrl)
        mid = (0.25 * p0[0] + 0.5 * ctrl[0] + 0.25 * p2[0],
               0.25 * p0[1] + 0.5 * ctrl[1] + 0.25 * p2[1])
        # The quadratic through ctrl, as a cubic (one path grammar for both layouts).
        c1 = (p0[0] + 2 / 3 * (ctrl[0] - p0[0]), p0[1] + 2 / 3 * (ctrl[1] - p0[1]))
        c2 = (p2[0] + 2 / 3 * (ctrl[0] - p2[0]), p2[1] + 2 / 3 * (ctrl[1] - p2[1]))
        curves.append(([p0, c1, c2, p2], mid))
    s = boxes["__start"]
    curves.insert(0, ([(s.x + 3, s.y), (s.x + 10, s.y), (first.x - first.w / 2 - 10, s.y),
                       (first.x - first.w / 2, s.y)], (s.x, s.y)))
    return _Layout("layered", boxes, curves)


# --- the SVG ---------------------------------------------------------------------------------


def _strands(machine: Machine[Any, Any], counts: Mapping[str, int],
             why: Mapping[str, str]) -> list[tuple[str, str, list[_Strand]]]:
    """Each arrow of the diagrams, with one strand per (source, event, target) on it; labels
    in the diagrams' order (sorted)."""
    out = []
    for src, dst, ts in edge_transitions(machine):
        by_key: dict[str, list[Any]] = {}
        for t in ts:
            key = f"{machine.name} {t.source.name} -{t.event.name}-> {t.target.name}"
            by_key.setdefault(key, []).append(t)
        strands = [
            _Strand(key, " / ".join(sorted(transition_label(t) for t in group)),
                    int(counts.get(key, 0)),
                    "" if counts.get(key, 0) else why.get(key, _NO_REASON),
                    "; ".join(t.note for t in group if t.note))
            for key, group in by_key.items()
        ]
        out.append((src, dst, sorted(strands, key=lambda s: s.label)))
    return out


def _path(pts: Sequence[Point], dx: float, dy: float) -> str:
    p = [f"{x + dx:.1f},{y + dy:.1f}" for x, y in pts]
    return "M" + p[0] + "".join(f" C{p[i]} {p[i + 1]} {p[i + 2]}"
                                for i in range(1, len(p) - 2, 3))


def _svg(machine: Machine[Any, Any], counts: Mapping[str, int], why: Mapping[str, str],
         unreached_states: set[str], layout: str) -> str:
    arrows = _strands(machine, counts, why)
    shape = [(src, dst, len(strands)) for src, dst, strands in arrows]
    lay: _Layout | None = None
    if layout in ("auto", "dot"):
        try:
            lay = _dot_layout(machine, shape)
        except (OSError, ValueError, KeyError, IndexError, subprocess.SubprocessError):
            if layout == "dot":
                raise
    if lay is None:
        lay = _layered_layout(machine, shape)
    curves = lay.curves
    name = machine.name
    body: list[str] = []
    xs: list[float] = []
    ys: list[float] = []
    s = lay.boxes["__start"]
    pts, _ = curves[0]
    body.append(f'<g class="initial"><circle cx="{s.x:.1f}" cy="{s.y:.1f}" r="4"/>'
                f'<path d="{_path(pts, 0, 0)}" fill="none" stroke="#333"'
                f' marker-end="url(#{_e(name)}-arrow-start)"/></g>')
    for state in machine.state_members():
        b = lay.boxes[state.name]
        xs += [b.x - b.w / 2, b.x + b.w / 2]
        ys += [b.y - b.h / 2, b.y + b.h / 2]
        seen = state.name not in unreached_states
        terminal = state in machine.terminal
        cls = "state " + ("reached" if seen else "unreached") + (" terminal" if terminal else "")
        tip = f"{name} {state.name}" + ("" if seen else ": state never reached") + (
            " (terminal: sticky)" if terminal else "")
        look = ('fill="#f4f4f4" stroke="#333"' if seen else
                f'fill="#fff" stroke="{_UNREACHED_COLOUR}" stroke-dasharray="{_DASH}"')
        rect = (f'<rect x="{b.x - b.w / 2:.1f}" y="{b.y - b.h / 2:.1f}" width="{b.w:.1f}"'
                f' height="{b.h:.1f}" rx="6" {look}/>')
        if terminal:  # dot's peripheries=2
            rect += (f'<rect x="{b.x - b.w / 2 + 3:.1f}" y="{b.y - b.h / 2 + 3:.1f}"'
                     f' width="{b.w - 6:.1f}" height="{b.h - 6:.1f}" rx="4" {look}/>')
        body.append(f'<g class="{cls}" data-state="{_e(state.name)}"><title>{_e(tip)}</title>'
                    f'{rect}<text x="{b.x:.1f}" y="{b.y + 4:.1f}" font-size="12">'
                    f"{_e(state.name)}</text></g>")
    for (src, dst, strands), (pts, (lx, ly)) in zip(arrows, curves[1:], strict=True):
        # Strands side by side across the arrow's chord (a loop's chord is ~0: stack them down).
        cx, cy = pts[-1][0] - pts[0][0], pts[-1][1] - pts[0][1]
        norm = math.hypot(cx, cy)
        nx, ny = (-cy / norm, cx / norm) if norm > 1 else (0.0, 1.0)
        parts = [f'<g class="edge" data-source="{_e(src)}" data-target="{_e(dst)}">']
        k = len(strands)
        for i, st in enumerate(strands):
            off = (i - (k - 1) / 2) * _STRAND_GAP
            colour, width, dash = _style(st.style)
            reached = "reached" if st.count else "unreached"
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(
                f'<path class="transition {reached}" data-transition="{_e(st.key)}"'
                f' data-count="{st.count}" d="{_path(pts, off * nx, off * ny)}" fill="none"'
                f' stroke="{colour}" stroke-width="{width}"{dash_attr}'
                f' marker-end="url(#{_e(name)}-arrow-{st.style})"><title>{_e(st.title)}</title>'
                "</path>")
        for i, st in enumerate(strands):
            y = ly + (i - (k - 1) / 2) * _LINE + 3.5
            text = f"{st.label} ({st.count})" if st.count else st.label
            fill = "#222" if st.count else _style(st.style)[0]
            parts.append(f'<text class="label {"reached" if st.count else "unreached"}"'
                         f' data-transition="{_e(st.key)}" x="{lx:.1f}" y="{y:.1f}"'
                         f' font-size="10" fill="{fill}"><title>{_e(st.title)}</title>'
                         f"{_e(text)}</text>")
            half = 3.0 * len(text)  # 10 px sans: about 6 px a character
            xs += [lx - half, lx + half]
            ys += [y - _LINE, y + 2]
        xs += [p[0] for p in pts]
        ys += [p[1] for p in pts]
        parts.append("</g>")
        body.append("".join(parts))
    xs += [s.x - 6]
    ys += [s.y - 6, s.y + 6]
    x0, y0 = min(xs) - 12, min(ys) - 12
    w, h = max(xs) - x0 + 12, max(ys) - y0 + 12
    # dot ends a spline where its arrowhead starts; the layered layout ends on the box.
    ref_x = 1 if lay.name == "dot" else 10
    markers = "".join(
        f'<marker id="{_e(name)}-arrow-{style}" viewBox="0 0 10 10" refX="{ref_x}" refY="5"'
        f' markerUnits="userSpaceOnUse" markerWidth="9" markerHeight="9"'
        f' orient="auto-start-reverse">'
        f'<path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
        for style, colour in [("start", "#333"), ("unreached", _UNREACHED_COLOUR),
                              ("gap", _GAP_COLOUR),
                              *((f"hit{b}", c) for b, c in enumerate(_BIN_COLOURS))])
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="machine" data-machine="{_e(name)}"'
            f' data-layout="{lay.name}" viewBox="{x0:.1f} {y0:.1f} {w:.1f} {h:.1f}"'
            f' width="{w:.0f}" height="{h:.0f}" role="img"'
            f' aria-label="{_e(name)} transitions by campaign coverage">'
            f"<defs>{markers}</defs>"
            # Presentation on the elements, not in the page's CSS: an SVG copied out of the
            # page reads the same.
            '<g font-family="Helvetica, Arial, sans-serif" text-anchor="middle">'
            + "".join(body) + "</g></svg>")


# --- the page --------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.diagram { overflow-x: auto; border: 1px solid #ddd; padding: 4px; }
svg.machine .transition:hover { stroke-opacity: 0.6; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 2.2em; vertical-align: middle; margin-right: .3em; }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; }
"""


def _legend() -> str:
    items = [(text, f"hit{b}") for b, text in enumerate(
        ["1 hit", "2-9 hits", "10-99 hits", "100-999 hits", "1000+ hits"])]
    items += [("never reached (declared reason)", "unreached"),
              ("never reached, no declared reason (a gap)", "gap")]
    out = []
    for text, style in items:
        colour, width, dash = _style(style)
        line = "dashed" if dash else "solid"
        out.append(f'<span><i style="border-top: {width + 0.6:.1f}px {line} {colour}"></i>'
                   f"{_e(text)}</span>")
    return ('<p class="legend">' + "".join(out) + "</p><p>Hover an arrow or its label for the"
            " transition's count, or for the reason it was never reached.</p>")


def _failures(clients: Sequence[Mapping[str, Any]]) -> str:
    failed = [c for c in clients if c.get("failure")]
    if not failed:
        return '<section id="failures"><h2>Failures</h2><p>None.</p></section>'
    out = ['<section id="failures"><h2>Failures</h2>']
    for c in failed:
        out.append(f'<div class="failure" data-client="{_e(c.get("client", ""))}">'
                   f'<h3>{_e(c.get("client", "?"))}</h3><p>{_e(c["failure"])}</p>')
        for err in c.get("errors") or []:
            out.append(f"<p>raised in {_e(err)}</p>")
        seeds = c.get("round_seeds") or []
        if seeds and seeds[-1] is not None:
            out.append(f"<p>failing round's seed: {_e(seeds[-1])} (replay with --seed"
                       f" {_e(seeds[-1])})</p>")
        file = c.get("reproducer_file")
        if file:
            # Relative to the page: the reproducer is written beside it (write_reproducers).
            out.append(f'<p>reproducer: <a class="reproducer" href="'
                       f'{_e(urllib.parse.quote(str(file)))}">{_e(file)}</a></p>')
        if c.get("reproducer"):
            out.append(f"<details><summary>reproducer program</summary>"
                       f"<pre>{_e(c['reproducer'])}</pre></details>")
        elif not file:
            out.append("<p>no reproducer (the report has none for this failure)</p>")
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


def render_coverage_html(report: Mapping[str, Any], *, layout: str = "auto",
                         json_name: str | None = None, what: str = "campaign") -> str:
    """The page for a campaign report (the dict its JSON holds), or another report of the
    same layout (``what`` names it: the monitor's). ``layout``: one of ``LAYOUTS``; "dot"
    raises where Graphviz cannot lay a machine out."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cov = report.get("coverage", {})
    counts: Mapping[str, int] = cov.get("transition_counts", {})
    why = {item["transition"]: item["why"] for item in cov.get("never_reached", [])}
    states = set(cov.get("never_reached_states", []))
    settings = report.get("settings", {})
    verdict = "FAILED" if report.get("failed") else "OK"
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>enginewire {_e(what)} coverage: {_e(verdict)}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>enginewire {_e(what)}: {_e(verdict)}</h1>"]
    if json_name:
        out.append(f'<p>Full report: <a href="{_e(urllib.parse.quote(json_name))}">'
                   f"{_e(json_name)}</a></p>")
    if settings:
        out.append("<p>" + ", ".join(f"{_e(k)}={_e(v)}" for k, v in settings.items()
                                     if v is not None) + "</p>")
    if cov:
        out.append(f"<p>Spec coverage: {_e(cov.get('states_reached'))}/"
                   f"{_e(cov.get('states_declared'))} states,"
                   f" {_e(cov.get('transitions_reached'))}/"
                   f"{_e(cov.get('transitions_declared'))} transitions.</p>")
    out.append(_legend())
    if cov and "transition_counts" not in cov:
        out.append("<p><strong>This report has no hit counts (coverage.transition_counts:"
                   " it predates them), so every transition is drawn as unreached.</strong></p>")
    out.append(_failures(report.get("clients", [])))
    machines = {m.name: m for m in MACHINES}
    for name, c in cov.get("per_machine", {}).items():
        out.append(f'<section class="machine" id="machine-{_e(name)}"><h2>{_e(name)}:'
                   f" {_e(c.get('reached'))}/{_e(c.get('transitions'))} transitions"
                   " reached</h2>")
        machine = machines.get(name)
        if machine is None:
            out.append("<p>No diagram: this spec declares no such machine.</p></section>")
            continue
        mstates = {s.split(" ", 1)[1] for s in states if s.split(" ", 1)[0] == name}
        out.append('<div class="diagram">' + _svg(machine, counts, why, mstates, layout)
                   + "</div></section>")
    out.append("</body></html>\n")
    return "\n".join(out)


def write_reproducers(report: dict[str, Any], directory: Path, stem: str) -> list[Path]:
    """Write each failure's reproducer to ``<stem>-<client>-reproducer.py`` in ``directory``
    and name the file in its client's entry (``reproducer_file``, relative to ``directory``),
    so the page can link a program one can run or copy whole."""
    written = []
    for c in report.get("clients", []):
        text = c.get("reproducer")
        if not (c.get("failure") and text):
            continue
        # A factory's client kind is the user's word: keep the file name plain.
        kind = re.sub(r"[^A-Za-z0-9_-]", "_", str(c.get("client", "client")))
        path = directory / f"{stem}-{kind}-reproducer.py"
        path.write_text(text if text.endswith("\n") else text + "\n")
        c["reproducer_file"] = path.name
        written.append(path)
    return written


def write_coverage_html(report: Mapping[str, Any], path: str | Path, *,
                        layout: str = "auto", what: str = "campaign") -> Path:
    """Write ``render_coverage_html(report)`` to ``path``, linking the JSON of the same stem
    when there is one; return the path."""
    path = Path(path)
    json_path = path.with_suffix(".json")
    path.write_text(render_coverage_html(
        report, layout=layout, json_name=json_path.name if json_path.exists() else None,
        what=what),
        encoding="utf-8")
    return path
