"""A Z85 public key may start with "-" (one in ~85) or "--" (one in ~7000): given after
``--curve-peer`` or ``--curve-server-key``, with a space or with "=", it is the option's value."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import zmq.utils.z85

from enginewire.cli import _attach_key_values, _is_z85_key, build_parser, main

Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
TCP = ["--input-address", "tcp://127.0.0.1:5", "--output-address", "tcp://127.0.0.1:6"]


def _key_starting(prefix: str, seed: int) -> str:
    """A valid Z85 public key whose text starts with ``prefix`` (at most 5 characters): the
    first 4-byte group is chosen to encode to it, the other 28 bytes are random."""
    rng = random.Random(seed)
    tail = rng.choices(Z85[:80], k=5 - len(prefix))  # any tail below 85**k keeps it < 2**32
    value = 0
    for c in prefix + "".join(tail):
        value = value * 85 + Z85.index(c)
    key = zmq.utils.z85.encode(struct.pack(">I", value) + rng.randbytes(28)).decode("ascii")
    assert key.startswith(prefix) and len(zmq.utils.z85.decode(key)) == 32
    return key


DOUBLE = _key_starting("--", 1)
SINGLE = _key_starting("-x", 2)
# What the CLI's options look like when spelled inside a key: "--" then an option name.
OPTION_LIKE = _key_starting("--cur", 3)


def _parse(argv: list[str]) -> list[str]:
    parser = build_parser()
    args = parser.parse_args(_attach_key_values(["engine", *TCP, *argv], parser))
    peers: list[str] = args.curve_peer or []
    return [*peers, *([args.curve_server_key] if args.curve_server_key else [])]


@pytest.mark.parametrize("key", [DOUBLE, SINGLE, OPTION_LIKE], ids=["--", "-", "--cur"])
def test_a_key_that_starts_with_a_dash_is_the_value_in_both_forms(key: str) -> None:
    assert _parse(["--curve-peer", key]) == [key]
    assert _parse([f"--curve-peer={key}"]) == [key]
    assert _parse(["--curve-peer", key, "--curve-server-key", key]) == [key, key]
    assert _parse([f"--curve-peer={key}", f"--curve-server-key={key}"]) == [key, key]


def test_two_dashed_keys_reach_the_engine_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Through main: both keys are read, so the command stops at "name the front end's".
    own = str(tmp_path / "engine.key_secret")
    rc = main(["engine", *TCP, "--curve-key", own, "--curve-peer", DOUBLE,
               "--curve-peer", SINGLE])
    err = capsys.readouterr().err
    assert rc == 2 and "--curve-peer gave 2 keys" in err, err


@pytest.mark.parametrize("argv", [
    ["--curve-peer"],
    ["--curve-peer", "--curve-key", "x.key_secret"],
    ["--curve-peer", "--allow-insecure-tcp"],
    # 40 characters that decode as Z85 (see the last test), but they spell a real option:
    # the value is missing.
    ["--curve-peer", "--input-address=tcp://192.168.10.20:5570"],
], ids=["end", "option", "flag", "option=value"])
def test_a_missing_key_is_still_one_clear_usage_error(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["engine", *TCP, *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "argument --curve-peer: expected one argument" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_z85_check_agrees_with_pyzmq() -> None:
    rng = random.Random(7)
    texts = ["".join(rng.choices(Z85, k=40)) for _ in range(2000)]
    texts += [DOUBLE, SINGLE, OPTION_LIKE, "#" * 40, "a" * 39]
    assert _is_z85_key("--input-address=tcp://192.168.10.20:5570")
    for text in texts:
        try:
            ok = len(zmq.utils.z85.decode(text)) == 32
        except Exception:
            ok = False
        assert _is_z85_key(text) == ok, text
