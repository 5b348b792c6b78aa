"""Bad usage of any subcommand: one line on stderr that names the flag, exit status 2.

Every case here stops before a long job starts (no engine, campaign or matrix runs), except
the two that need the engine's own verdict (an unknown model, an out-of-vocabulary token).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from enginewire.cli import main
from enginewire.runtime import security


def _usage_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    # Every command says who is speaking, as argparse does: "enginewire <command>: error: ...".
    assert lines[0].startswith("enginewire ") and ": error: " in lines[0], err
    return lines[0]


IPC = ["--input-address", "ipc:///tmp/enginewire-cli-test-in",
       "--output-address", "ipc:///tmp/enginewire-cli-test-out"]


@pytest.mark.parametrize(("argv", "flag"), [
    (["campaign", "--examples", "0"], "--examples"),
    (["campaign", "--examples", "-1"], "--examples"),
    (["campaign", "--steps", "-5"], "--steps"),
    (["campaign", "--duration", "-1"], "--duration"),
    (["campaign", "--duration", "nan"], "--duration"),
    (["campaign", "--mutant", "nosuch"], "--mutant"),
    (["campaign", "--seed", "-1"], "--seed"),  # every other command's range, now campaign's
    (["bench", "--only", "nosuch"], "--only"),
    (["spec", "check", "--negative", "nosuch"], "--negative"),
    (["generate", "--model", "null", "--client", "inproc", "--prompt-tokens", " , "],
     "--prompt-tokens"),
    (["bench", "--only", "codec,nosuch"], "--only"),
    (["generate", "--max-tokens", "-3"], "--max-tokens"),
    (["generate", "--temperature", "-1"], "--temperature"),
    (["generate", "--seed", "-1"], "--seed"),
    (["engine", "--input-address", "foo", "--output-address", "bar"], "--input-address"),
    (["engine", "--input-address", "ipc:///tmp/x", "--output-address", "tcp://127.0.0.1"],
     "--output-address"),
    (["engine", "--input-address", "ipc:///tmp/x", "--output-address", "tcp://h:99999"],
     "--output-address"),
    (["engine", "--engine-index", "-5", *IPC], "--engine-index"),
    (["engine", "--engine-index", "65536", *IPC], "--engine-index"),
    (["engine", "--seed", "-1", *IPC], "--seed"),
    (["engine", "--heartbeat-interval", "-1", *IPC], "--heartbeat-interval"),
    (["engine", "--heartbeat-interval", "0", *IPC], "--heartbeat-interval"),
    (["engine", "--input-address", "tcp://127.0.0.1:5", "--output-address",
      "tcp://127.0.0.1:6"], "--allow-insecure-tcp"),
])
def test_bad_value_is_one_line_and_exit_two(argv: list[str], flag: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert flag in _usage_line(argv, capsys)


@pytest.mark.parametrize("command", [
    ["campaign", "--results-dir"],
    ["faults", "matrix", "--client", "inproc", "--results-dir"],
    ["spec", "diagrams", "--out"],
])
def test_output_dir_that_cannot_be_made_is_bad_usage(command: list[str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for bad in (a_file, a_file / "below"):  # taken by a file; under a file
        assert command[-1] in _usage_line([*command, str(bad)], capsys)
    assert a_file.read_text() == ""


def test_bench_output_files_are_checked_before_it_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_line(["bench", "--only", "codec", "--json", str(tmp_path / "no" / "b.json")],
                       capsys)
    assert "--json" in line and "does not exist" in line
    assert "--plot" in _usage_line(["bench", "--only", "codec", "--plot", str(tmp_path)], capsys)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_bench_output_file_is_tried_not_asked(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # os.access says yes to root for /proc; the write would fail only after the whole run.
    line = _usage_line(["bench", "--only", "codec", "--json", "/proc/enginewire-bench.json"],
                       capsys)
    assert "--json" in line and "not writable" in line


def test_bench_output_file_probe_leaves_no_trace(tmp_path: Path) -> None:
    from enginewire.cli import _writable_file

    kept = tmp_path / "kept.json"
    kept.write_text("old")
    _writable_file("--json", str(kept))
    _writable_file("--json", str(tmp_path / "new.json"))
    assert kept.read_text() == "old"  # appended to nothing, not truncated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


def test_generate_refused_request_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_line(["generate", "--model", "null", "--client", "inproc",
                        "--prompt-tokens", "1,999999", "--max-tokens", "2"], capsys)
    assert "refused" in line and "999999" in line


def test_engine_unknown_model_is_one_line(capsys: pytest.CaptureFixture[str],
                                          caplog: pytest.LogCaptureFixture,
                                          tmp_path: Path) -> None:
    ipc = ["--input-address", f"ipc://{tmp_path}/in", "--output-address", f"ipc://{tmp_path}/out"]
    with caplog.at_level(logging.ERROR):
        line = _usage_line(["engine", "--model", "bogus", *ipc], capsys)
    assert "unknown model" in line and "bogus" in line
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.fixture
def two_peers(tmp_path: Path) -> Path:
    """A directory of two peer public keys: more than an engine can pick its front end from."""
    peers = tmp_path / "peers"
    peers.mkdir()
    for name in ("a", "b"):
        security.load_or_create_keypair(peers / f"{name}.key_secret")
    return peers


def test_engine_several_peer_keys_need_a_server_key(
        tmp_path: Path, two_peers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peers = two_peers
    own = tmp_path / "engine.key_secret"
    line = _usage_line(["engine", "--input-address", "tcp://127.0.0.1:5", "--output-address",
                        "tcp://127.0.0.1:6", "--curve-key", str(own), "--curve-peer",
                        str(peers)], capsys)
    assert "--curve-server-key" in line


def test_engine_prints_a_key_pair_it_creates(
        tmp_path: Path, two_peers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Stops at the peer-list check, after the key pair was made: no engine starts.
    peers = two_peers
    own = tmp_path / "engine.key_secret"
    assert main(["engine", "--input-address", "tcp://127.0.0.1:5", "--output-address",
                 "tcp://127.0.0.1:6", "--curve-key", str(own), "--curve-peer",
                 str(peers)]) == 2
    out = capsys.readouterr().out
    public = security.load_or_create_keypair(own, create=False).public.decode()
    assert str(own) in out and public in out and str(tmp_path / "engine.key") in out
    # An existing key is not announced again.
    main(["engine", "--input-address", "tcp://127.0.0.1:5", "--output-address",
          "tcp://127.0.0.1:6", "--curve-key", str(own), "--curve-peer", str(peers)])
    assert capsys.readouterr().out == ""


def test_generate_with_an_unusable_model_file_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUX" + bytes(40))
    line = _usage_line(["generate", "--model", str(bad), "--client", "inproc",
                        "--prompt-tokens", "1,2"], capsys)
    assert "broken.gguf" in line and "not a GGUF file" in line, line


def test_a_public_key_that_starts_with_a_dash_is_taken_as_a_value() -> None:
    """Z85 keys may start with "-" (one random key in ~70): argparse read such a key as an
    option and failed the command ("expected one argument")."""
    from enginewire.cli import _attach_key_values

    key = "-" + "a" * 39
    assert _attach_key_values(["engine", "--curve-peer", key, "--curve-server-key", key]) == [
        "engine", f"--curve-peer={key}", f"--curve-server-key={key}"]
    assert _attach_key_values(["engine", "--curve-peer", "--model"]) == [
        "engine", "--curve-peer", "--model"]  # a real option stays one
