"""The campaign's coverage page (enginewire.testing.coverage_html), read back with html.parser:
one diagram per machine, every transition on it with its count or its declared reason, and
each failure linked to a reproducer file that exists."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from enginewire.spec import CLIENT, MACHINES
from enginewire.spec.diagrams import edges
from enginewire.testing import coverage_html
from enginewire.testing.campaign import run_campaign
from enginewire.testing.coverage_html import (
    render_coverage_html,
    write_coverage_html,
    write_reproducers,
)

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")


@dataclass
class _El:
    tag: str
    attrs: dict[str, str]
    machine: str | None  # data-machine of the enclosing <svg>
    title: str = ""
    text: str = ""
    children: list[_El] = field(default_factory=list)


class _Page(HTMLParser):
    """Every element with its attributes, its <title> text and the machine it is drawn in."""

    VOID = {"meta", "br", "img", "input", "link", "hr"}

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[_El] = []
        self._stack: list[_El] = []
        self.feed(text)
        self.close()
        assert not self._stack, [e.tag for e in self._stack]  # every tag closed

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        machine = self._stack[-1].machine if self._stack else None
        el = _El(tag, {k: v or "" for k, v in attrs}, machine)
        if tag == "svg":
            el.machine = el.attrs.get("data-machine")
        self.elements.append(el)
        if self._stack:
            self._stack[-1].children.append(el)
        if tag not in self.VOID:
            self._stack.append(el)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self._stack.pop()

    def handle_endtag(self, tag: str) -> None:
        assert self._stack and self._stack[-1].tag == tag, (tag, [e.tag for e in self._stack])
        self._stack.pop()

    def handle_data(self, data: str) -> None:
        if not self._stack:
            return
        top = self._stack[-1]
        if top.tag == "title" and len(self._stack) > 1:
            self._stack[-2].title += data
        top.text += data

    def find(self, tag: str, cls: str | None = None) -> list[_El]:
        return [e for e in self.elements if e.tag == tag
                and (cls is None or cls in e.attrs.get("class", "").split())]


def _key(machine: Any, t: Any) -> str:
    return f"{machine.name} {t.source.name} -{t.event.name}-> {t.target.name}"


def _check_diagrams(page: _Page, report: dict[str, Any]) -> None:
    cov = report["coverage"]
    counts, why = cov["transition_counts"], {i["transition"]: i["why"]
                                             for i in cov["never_reached"]}
    svgs = page.find("svg", "machine")
    assert [s.machine for s in svgs] == list(cov["per_machine"])  # one per machine, in order
    for machine in MACHINES:
        if machine.name not in cov["per_machine"]:
            continue
        # The diagrams' own arrows (docs/diagrams), each once.
        arrows = [(e.attrs["data-source"], e.attrs["data-target"])
                  for e in page.find("g", "edge") if e.machine == machine.name]
        assert arrows == [(src, dst) for src, dst, _ in edges(machine)]
        paths = {p.attrs["data-transition"]: p for p in page.find("path", "transition")
                 if p.machine == machine.name}
        assert sorted(paths) == sorted(_key(machine, t) for t in machine.transitions)
        reached = 0
        for key, p in paths.items():
            if counts.get(key, 0):
                reached += 1
                assert p.attrs["data-count"] == str(counts[key])
                assert "stroke-dasharray" not in p.attrs
                assert f"reached {counts[key]} time" in p.title
            else:
                assert p.attrs["data-count"] == "0"
                assert p.attrs.get("stroke-dasharray"), key  # dashed
                assert why[key] in p.title, (key, p.title)  # the declared reason, or the gap
        assert reached == cov["per_machine"][machine.name]["reached"]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """A real, short campaign on the in-process client (a few seconds)."""
    results = tmp_path_factory.mktemp("results")
    assert run_campaign(client="inproc", examples=5, steps=20, results_dir=str(results)) == 0
    (path,) = results.glob("campaign-*.json")
    return json.loads(path.read_text()), path


def test_the_campaign_writes_its_page_beside_its_json(
        campaign: tuple[dict[str, Any], Path]) -> None:
    report, path = campaign
    page_path = path.with_suffix(".html")
    assert report["html"] == page_path.name and page_path.is_file()
    page = _Page(page_path.read_text(encoding="utf-8"))
    _check_diagrams(page, report)
    (back,) = [a for a in page.find("a") if a.attrs["href"] == path.name]  # links its JSON
    assert (page_path.parent / back.attrs["href"]).is_file()
    # Declared reasons are there, not only gaps: this run observes the engine in-process, so
    # an ENGINE row reads "not observable" rather than "no reason declared".
    titles = " ".join(p.title for p in page.find("path", "unreached"))
    assert "not observable" in titles and "unreachable by this runtime" in titles
    assert not page.find("a", "reproducer")  # nothing failed


@pytest.mark.parametrize("layout", ["layered", "dot"])
def test_both_layouts_carry_the_same_styling(
        campaign: tuple[dict[str, Any], Path], layout: str) -> None:
    if layout == "dot" and shutil.which("dot") is None:
        pytest.skip("Graphviz is not installed (CI installs it)")
    report, _ = campaign
    page = _Page(render_coverage_html(report, layout=layout))
    assert {s.attrs["data-layout"] for s in page.find("svg", "machine")} == {layout}
    _check_diagrams(page, report)


def test_without_graphviz_the_page_falls_back_to_its_own_layout(
        campaign: tuple[dict[str, Any], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    report, _ = campaign
    monkeypatch.setattr(coverage_html.shutil, "which", lambda name: None)
    page = _Page(render_coverage_html(report))
    assert {s.attrs["data-layout"] for s in page.find("svg", "machine")} == {"layered"}
    with pytest.raises(FileNotFoundError):
        render_coverage_html(report, layout="dot")
    with pytest.raises(ValueError, match="layout must be one of"):
        render_coverage_html(report, layout="circle")


def _synthetic(why: str = "declared: never on this runtime", failure: str = "boom",
               client: str = "sync") -> dict[str, Any]:
    """A report on the client machine alone: its first transition reached 3 times, the
    others never (the second with ``why``)."""
    keys = [_key(CLIENT, t) for t in CLIENT.transitions]
    return {
        "clients": [
            {"client": client, "failure": failure, "errors": ["add: RuntimeError('x')"],
             "reproducer": "# Reproducer\nstate = EngineClientStateMachine()\nstate.poll()",
             "round_seeds": [7]},
            {"client": "async", "failure": "no program", "reproducer": None},
            {"client": "inproc", "failure": None, "reproducer": None},
        ],
        "coverage": {
            "per_machine": {"client": {"transitions": len(keys), "reached": 1}},
            "transition_counts": {keys[0]: 3},
            "never_reached": [{"transition": keys[1], "why": why}],
            "never_reached_states": [],
        },
        "settings": {"client": "all"},
        "failed": True,
    }


def test_a_failure_links_its_reproducer_file(tmp_path: Path) -> None:
    report = _synthetic()
    (tmp_path / "campaign-x.json").write_text("{}")
    written = write_reproducers(report, tmp_path, "campaign-x")
    assert [p.name for p in written] == ["campaign-x-sync-reproducer.py"]
    page_path = write_coverage_html(report, tmp_path / "campaign-x.html")
    page = _Page(page_path.read_text(encoding="utf-8"))
    (link,) = page.find("a", "reproducer")
    target = page_path.parent / link.attrs["href"]  # relative to the page
    assert target.is_file() and target.read_text() == report["clients"][0]["reproducer"] + "\n"
    compile(target.read_text(), str(target), "exec")
    failures = {d.attrs["data-client"]: d for d in page.find("div", "failure")}
    assert sorted(failures) == ["async", "sync"]  # the client that passed is not listed
    assert "no reproducer" in "".join(c.text for c in failures["async"].children)
    # The synthetic report's one machine: the styling holds for a hand-made report too.
    cov = report["coverage"]
    keys = [_key(CLIENT, t) for t in CLIENT.transitions]
    paths = {p.attrs["data-transition"]: p for p in page.find("path", "transition")}
    assert paths[keys[0]].attrs["data-count"] == "3"
    assert "declared: never on this runtime" in paths[keys[1]].title
    assert "no declared reason" in paths[keys[2]].title  # in neither list: said so
    assert paths[keys[2]].attrs["stroke-dasharray"]
    assert [s.machine for s in page.find("svg", "machine")] == list(cov["per_machine"])


def test_every_text_is_escaped(tmp_path: Path) -> None:
    evil = '<script>alert("x")</script> & \'q\''
    report = _synthetic(why=evil, failure=evil, client='a"b<c>')
    write_reproducers(report, tmp_path, "r")
    text = render_coverage_html(report)
    assert "<script" not in text
    page = _Page(text)
    assert not page.find("script")
    keys = [_key(CLIENT, t) for t in CLIENT.transitions]
    (path,) = [p for p in page.find("path", "transition") if p.attrs["data-transition"] == keys[1]]
    assert evil in path.title  # read back as written: escaped, not dropped
    failures = {d.attrs["data-client"]: d for d in page.find("div", "failure")}
    assert 'a"b<c>' in failures
    (link,) = page.find("a", "reproducer")
    assert "<" not in link.attrs["href"] and '"' not in link.attrs["href"]
