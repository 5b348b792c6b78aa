"""Every command line written in the README and in the docs' usage blocks still works: it
parses, its ``--help`` exits 0, and it runs for real in a cheap mode where one exists, so a
documented command cannot break silently (issue 44: ``enginewire bench --quick``, in the
README's table, ended in a traceback after 13 s of measuring, while the ``--only`` runs the
tests made passed).

The commands are found, not listed: the lines of every fenced block but python ones in
README.md and docs/*.md, and the first column of the README's command table, that start with
``enginewire``, ``.venv/bin/enginewire`` or ``python -m enginewire`` (after any VAR=value). A
synopsis (``[--flag ARG]``) is checked against the parser: every flag it names exists and
every ``a|b`` list is that option's choices; ``[--flag]`` alone (the README's table) stands
for the line with and without it. A cheap run keeps what chooses the code path (the client
kinds, the sections, the engines, the flags) and shrinks what only sets the size (examples,
steps, counts, the model, a duration). A command with no cheap run has a reason here that
names where it runs for real; a documented command of a new kind fails until it gets one.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from enginewire.benchmarks import dp as bench_dp
from enginewire.benchmarks import run as bench_run
from enginewire.cli import _attach_key_values, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(r"(?:[A-Z_]+=(?:'[^']*'|\S+)\s+)*(?:\.venv/bin/)?"
                      r"(?:enginewire|python -m enginewire)\b")
# The bench's own module runs exactly `enginewire bench` (docs/benchmarks.md).
_BENCH_MODULE = "enginewire.benchmarks.run"
BOUND_S = 120.0


@dataclass(frozen=True)
class Documented:
    where: str
    line: str
    env: tuple[tuple[str, str], ...] = ()
    module: str = "enginewire"  # what `python -m` runs it as
    argv: tuple[str, ...] = ()  # as the `enginewire` parser reads it
    synopsis: bool = False


def _lines(page: Path) -> Iterator[tuple[str, str]]:
    text = page.read_text(encoding="utf-8")
    where = str(page.relative_to(ROOT))
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang == "python":
            continue
        lines: list[str] = []
        for ln in block.replace("\\\n", " ").splitlines():
            if lines and ln.startswith(" ") and ln.strip().startswith("["):
                lines[-1] += " " + ln.strip()  # a synopsis goes on, indented under itself
            else:
                lines.append(ln)
        for ln in lines:
            for part in re.split(r"\s+#", ln)[0].split("&&"):
                yield where, " ".join(part.split())
    if page.name == "README.md":
        for m in re.finditer(r"^\| `([^`]+)` \|", text, re.M):
            yield f"{where} (table)", m.group(1)


def _documented() -> list[Documented]:
    found: dict[tuple[str, ...], Documented] = {}
    for page in PAGES:
        for where, line in _lines(page):
            if not _COMMAND.match(line):
                continue
            words = shlex.split(line)
            env: list[tuple[str, str]] = []
            while "=" in words[0]:
                name, _, value = words.pop(0).partition("=")
                env.append((name, value))
            if words[0] == "python":
                module, rest = words[2], words[3:]
            else:
                module, rest = "enginewire", words[1:]
            argv = ["bench", *rest] if module == _BENCH_MODULE else rest
            groups = re.findall(r"\[([^\]]*)\]", " ".join(rest))
            if groups and all(re.fullmatch(r"--[\w-]+", g) for g in groups):
                # `[--quick]`: the line without the flag and with it.
                plain = [w for w in argv if not w.startswith("[")]
                for n in range(len(groups) + 1):
                    for flags in itertools.combinations(groups, n):
                        variant = (*plain, *flags)
                        found.setdefault((module, *variant),
                                         Documented(where, line, tuple(env), module, variant))
                continue
            found.setdefault((module, *argv), Documented(where, line, tuple(env), module,
                                                         tuple(argv), synopsis=bool(groups)))
    return list(found.values())


DOCUMENTED = _documented()
CONCRETE = [d for d in DOCUMENTED if not d.synopsis]


def _id(d: Documented) -> str:
    return " ".join((d.module, *d.argv))[:90]


def _subparser(argv: tuple[str, ...]) -> tuple[tuple[str, ...], argparse.ArgumentParser]:
    """The subcommand words leading ``argv`` and the parser that reads the rest."""
    parser = build_parser()
    path: list[str] = []
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
        path.append(word)
    return tuple(path), parser


def _real(argv: tuple[str, ...], tmp: Path) -> list[str]:
    """``argv`` with the docs' placeholders made real."""
    places = {"DIR": str(tmp / "out"), "A": f"ipc://{tmp}/in", "B": f"ipc://{tmp}/out"}
    return [places.get(w, w) for w in argv]


def test_the_docs_document_the_commands_this_test_knows() -> None:
    # The extraction itself: a regex that found nothing would pass every test below.
    said = {" ".join(d.argv[:2]) for d in DOCUMENTED}
    for cmd in ("spec check", "spec diagrams", "campaign --client", "faults matrix",
                "bench --quick", "bench --engines", "generate --model", "engine --input-address"):
        assert any(s.startswith(cmd) for s in said), (cmd, sorted(said))
    assert any(d.module == _BENCH_MODULE for d in DOCUMENTED)
    assert any(d.synopsis for d in DOCUMENTED)


@pytest.mark.parametrize("doc", [d for d in DOCUMENTED if d.synopsis], ids=_id)
def test_a_synopsis_names_only_real_flags_and_choices(doc: Documented) -> None:
    path, parser = _subparser(doc.argv)
    assert path, f"{doc.where}: {doc.line!r} names no subcommand"
    actions = {o: a for a in parser._actions for o in a.option_strings}
    text = " ".join(doc.argv)
    for flag in re.findall(r"(?<![\w-])--[\w-]+", text):
        assert flag in actions, f"{doc.where}: {doc.line!r}: {flag} is not an option of {path}"
    for flag, listed in re.findall(r"(--[\w-]+) ([\w-]+(?:\|[\w-]+)+)", text):
        choices = actions[flag].choices
        assert choices is not None and set(listed.split("|")) == set(choices), (
            f"{doc.where}: {flag} {listed} but the parser has {choices}")


@pytest.mark.parametrize("doc", CONCRETE, ids=_id)
def test_a_documented_command_parses_and_its_help_exits_0(doc: Documented,
                                                          tmp_path: Path) -> None:
    argv = _real(doc.argv, tmp_path)
    try:
        build_parser().parse_args(_attach_key_values(argv))
    except SystemExit as exc:  # argparse refused it: the docs show a command that is not
        pytest.fail(f"{doc.where}: {doc.line!r} does not parse (exit {exc.code})")
    prog = ([sys.executable, "-m", _BENCH_MODULE, *argv[1:]] if doc.module == _BENCH_MODULE
            else [sys.executable, "-m", "enginewire", *argv])
    res = subprocess.run([*prog, "--help"], capture_output=True, text=True, timeout=BOUND_S,
                         cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("usage:"), (doc.line, res.stderr)
    assert not res.stderr


# --- the cheap real runs --------------------------------------------------------------------

# Flags that set only the size, the seed or where a campaign reports: a cheap run drops them
# (with their values) and sets its own, seeded so that it replays the same programs. The
# composed models' explorations (--model-coverage, tens of seconds) have their own tests
# (tests/model_tests/test_model_coverage.py).
_CAMPAIGN_SIZE = {"--examples": 1, "--steps": 1, "--model": 1, "--duration": 1, "--seed": 1,
                  "--results-dir": 1, "--model-coverage": 0}


def _drop(argv: list[str], flags: dict[str, int]) -> list[str]:
    out, skip = [], 0
    for w in argv:
        if skip:
            skip -= 1
        elif w.split("=")[0] in flags:
            skip = 0 if "=" in w else flags[w]
        else:
            out.append(w)
    return out


@dataclass(frozen=True)
class Cheap:
    argv: tuple[str, ...]
    in_process: bool = False  # the bench, with its counts shrunk (below)
    engine: bool = False  # started, seen up, then stopped by SIGTERM


def _cheap(doc: Documented, tmp: Path) -> Cheap | str:
    """The cheap run of ``doc``, or why it has none and where it runs for real."""
    argv = list(doc.argv)
    path, _ = _subparser(doc.argv)
    rest = argv[len(path):]
    if doc.env:
        return ("names the reader's own weight source (a module of theirs); "
                "tests/faults/test_own_engine.py registers one through the variable")
    if path == ("spec", "check"):
        return ("a minute or more on 2 cores even with --quick --no-spin; "
                "tests/spec/test_spec_check.py runs run_spec_check(quick=True), tests/spec the "
                "rest, and the README's main job runs it whole")
    if path == ("spec", "diagrams"):
        return Cheap(("spec", "diagrams", "--out", str(tmp / "diagrams")))
    if path == ("campaign",):
        if "--mutants" in rest or "--mutant" in rest:
            return ("runs the mutant bank, a child campaign each; tests/model_tests/"
                    "test_campaign.py's mutant table (test_mutant_is_detected) runs every one")
        if "--factory" in rest:
            return ("drives vLLM's clients (or the reader's own factory); tests/vllm run the "
                    "vLLM ones where vLLM is installed, tests/cli/test_campaign_cmd.py a factory")
        return Cheap(("campaign", *_drop(rest, _CAMPAIGN_SIZE), "--examples", "1", "--steps",
                      "3", "--model", "null", "--seed", "1", "--results-dir",
                      str(tmp / "results"), *(["--duration", "1"] if "--duration" in rest
                                              else [])))
    if path == ("faults", "matrix"):
        if "--factory" in rest:
            return ("drives vLLM's clients (or the reader's own factory); tests/vllm and "
                    "tests/faults/test_matrix_factory.py run them")
        if "--engines" in rest:
            return ("the data-parallel cells start engines per cell (tens of seconds); "
                    "tests/faults/test_matrix_dp.py runs them")
        if "--front-ends" in rest:
            return ("the front-end cells start an engine and a front-end process per cell"
                    " (tens of seconds); tests/faults/test_matrix_fe.py runs them")
        # The in-process client's quick cells (seconds); CI runs the whole quick matrix after
        # the tests (.ci/run), and tests/faults the rest.
        return Cheap(("faults", "matrix", *_drop(rest, {"--client": 1, "--quick": 0}),
                      "--quick", "--client", "inproc", "--results-dir", str(tmp / "results")))
    if path == ("bench",):
        if "--against-vllm" in rest:
            return ("needs vLLM's environment; tests/benchmarks/test_bench_modes.py runs the "
                    "mode against a stand-in")
        return Cheap(("bench", *_drop(rest, {"--quick": 0, "--json": 1}), "--quick", "--json",
                      str(tmp / "bench.json")), in_process=True)
    if path == ("generate",):
        return Cheap(("generate", *_drop(rest, {"--model": 1, "--max-tokens": 1}), "--model",
                      "null", "--max-tokens", "2"))
    if path == ("engine",):
        if any(w.startswith("tcp://") for w in rest):
            return ("names the operator's hosts and key files; tests/cli/test_engine_cmd.py and "
                    "tests/security start CURVE engines over tcp")
        return Cheap(("engine", *_real(tuple(_drop(rest, {"--model": 1})), tmp), "--model",
                      "null"), engine=True)
    if path == ("monitor",):
        if "--replay" in rest:
            return ("judges a capture the reader wrote; tests/cli/test_monitor_cmd.py writes one"
                    " live and replays it")
        # No front end or engine comes: it relays nothing for a second and says so.
        return Cheap(("monitor", *_drop(rest, {"--front": 1, "--engine": 1, "--capture": 1,
                                              "--report": 1, "--duration": 1}),
                      "--front", f"ipc://{tmp}/fi,ipc://{tmp}/fo",
                      "--engine", f"ipc://{tmp}/ei,ipc://{tmp}/eo",
                      "--capture", str(tmp / "cap"), "--report", str(tmp / "rep"),
                      "--duration", "1"))
    return f"no cheap run is known for {path}: add one here (or its reason)"


def _plans(tmp: Path) -> dict[Cheap, list[str]]:
    plans: dict[Cheap, list[str]] = {}
    for doc in CONCRETE:
        plan = _cheap(doc, tmp)
        if isinstance(plan, Cheap):
            plans.setdefault(plan, []).append(f"{doc.where}: {doc.line}")
    return plans


def test_every_documented_command_has_a_cheap_run_or_a_reason(tmp_path: Path) -> None:
    for doc in CONCRETE:
        plan = _cheap(doc, tmp_path)
        assert isinstance(plan, Cheap) or not plan.startswith("no cheap run"), (doc.line, plan)
    # The commands the issue names run for real, not only their help.
    runs = {" ".join(c.argv[:3]) for c in _plans(tmp_path)}
    for cmd in ("bench --quick --json", "campaign --client all", "spec diagrams --out"):
        assert cmd in runs, sorted(runs)


# A fixed directory for the plans' ids (a test's tmp_path is made later); each run rewrites
# it to its own tmp_path.
_PLACE = Path("/TMP")
PLANS = list(_plans(_PLACE).items())


def _moved(cheap: Cheap, tmp: Path) -> list[str]:
    return [w.replace(str(_PLACE), str(tmp)) for w in cheap.argv]


@pytest.fixture
def small_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's counts shrunk so a run of every section takes seconds per section: the
    sections, their order, their arguments and their checks stay the bench's own."""
    monkeypatch.setattr(bench_run, "_params", lambda quick: {
        "echo": (200, 50, 20), "ks": (16,), "reps": 1, "async_ks": (), "inproc_reps": 1})
    monkeypatch.setattr(bench_dp, "bench_dp",
                        functools.partial(bench_dp.bench_dp, reps=1, rounds=1, n_adds=20))


def _run_bench(argv: list[str], out: Path) -> None:
    rc = main(argv)
    # Shrunk counts may miss a bar (exit 1): a measurement, not a crash; the sections ran.
    assert rc in (0, 1)
    rows = json.loads(out.read_text())["rows"]
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    alone = (["frontends"] if "--front-ends" in argv else ["dp"] if "--engines" in argv
             else bench_run.SECTIONS)
    want = set(only or alone) - {"model"}
    assert want <= {r["section"] for r in rows}, (argv, want)


def _run_engine(argv: list[str], tmp: Path) -> None:
    log = tmp / "engine.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "enginewire", *argv], cwd=tmp,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + BOUND_S
        while "engine core up" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(BOUND_S)
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(("cheap", "documented"), PLANS,
                         ids=[" ".join(c.argv).replace(str(_PLACE), "T")[:90] for c, _ in PLANS])
def test_a_documented_command_runs_in_its_cheap_mode(
        cheap: Cheap, documented: list[str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    argv = _moved(cheap, tmp_path)
    if cheap.in_process:
        request.getfixturevalue("small_bench")
        _run_bench(argv, tmp_path / "bench.json")
        return
    if cheap.engine:
        _run_engine(argv, tmp_path)
        return
    res = subprocess.run([sys.executable, "-m", "enginewire", *argv], capture_output=True,
                         text=True, timeout=BOUND_S, cwd=tmp_path)
    assert res.returncode == 0, (documented, res.stdout[-2000:], res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
