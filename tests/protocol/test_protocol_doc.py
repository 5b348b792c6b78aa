"""docs/protocol.md is enough to write a front end: a raw one, built from the page alone.

The front end here uses only pyzmq and ``msgspec.msgpack`` (no enginewire import). Every
layout it relies on (field positions and defaults, type bytes, finish reasons, ext codes, the
sentinel, the version) is read from the page's tables, and the prose facts it relies on are
asserted to be on the page, so a page that drifts from the wire fails here. The engine is a
real one (null model) in a subprocess; only its launch is outside the protocol.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8")

# Facts from the page's prose this front end acts on (the tables are parsed below).
PROSE = (
    "The front end binds both sockets; the engine connects to them.",
    "| ROUTER (input) | DEALER |",
    "| PULL (output) | PUSH |",
    "arrives on the ROUTER as ``[identity, payload]``: no type byte, no aux.",
    '``identity`` is ``engine_index.to_bytes(2, "little")``',
    "The front end puts it first on every message it sends",
    "request ``stream_ids[i]`` got token ``stream_tokens[i]``",
    "first one ``EngineCoreOutput(stream_ids[i],\n  [stream_tokens[i]])`` per column entry",
    "``finished_requests`` lists the ids this\n  batch finished",
    "**A heartbeat**: an ``EngineCoreOutputs`` with nothing but ``engine_index`` and\n"
    "  ``timestamp``",
    "the engine sends one as soon as its output\n  socket connects",
    "There is no shutdown message. SIGTERM or SIGINT",
    "the process exits 0, *without* a sentinel",
    "| ext code | carries | ext body (msgpack) |",
    "aux 0 is the frame right after the payload frame",
    "``echo(x)`` returns ``x``",
    "a front end sends ``ATTACH`` with a random 16-byte ``session``",
    "``EngineCoreOutputs`` whose\n``session`` field is that session",
    "must refuse\nany ``protocol_version`` it does not know",
)

ENGINE_INDEX = 3
DEADLINE_S = 10.0  # bound on every wait below; a healthy run takes well under a second each


def _structs(doc: str) -> dict[str, list[tuple[str, Any]]]:
    """Each struct's fields in wire order with their defaults (``_REQUIRED`` if none)."""
    out: dict[str, list[tuple[str, Any]]] = {}
    for name, body in re.findall(r"### `(\w+)`\n(.*?)(?=\n### |\n## |\Z)", doc, re.S):
        # The default is the last cell (a type cell may hold a "|" of its own).
        rows = re.findall(r"^\| (\d+) \| `(\w+)` \| .* \| ([^|]*?) \|$", body, re.M)
        assert [int(i) for i, _, _ in rows] == list(range(len(rows))), name
        fields = []
        for _, field, default in rows:
            if default == "required":
                fields.append((field, _REQUIRED))
                continue
            try:
                fields.append((field, ast.literal_eval(default.strip("`"))))
            except ValueError:  # a nested struct's repr: this front end never omits those
                fields.append((field, _REQUIRED))
        out[name] = fields
    return out


_REQUIRED = object()
STRUCTS = _structs(DOC)
TYPE_BYTES = {
    k: bytes.fromhex(h) for h, k in re.findall(r"^\| `0x(\w\w)` \| `(\w+)` \|", DOC, re.M)}
FINISH = {k: int(v) for v, k in re.findall(r"^\| (\d) \| `([A-Z]+)` \|$", DOC, re.M)}
EXT = {k: int(v) for v, k in re.findall(r"^\| (\d) \| (torch tensor|numpy array) \|", DOC, re.M)}
SENTINEL = ast.literal_eval(re.search(r"Engine-dead sentinel: one frame, exactly `(.*?)`", DOC)[1])
VERSION = int(re.search(r"Protocol version: \*\*(\d+)\*\*", DOC)[1])
INLINE_UNDER = int(re.search(r"inline arrays under (\d+) bytes", DOC)[1])


def pack(struct: str, **values: Any) -> list[Any]:
    """A positional array: fields in the page's order, trailing defaults left out."""
    names = [f for f, _ in STRUCTS[struct]]
    unknown = set(values) - set(names)
    assert not unknown, f"{struct} has no field(s) {unknown}"
    last = max(names.index(k) for k in values)
    missing = [n for n in names[:last + 1] if n not in values]
    assert not missing, f"{struct}: give {missing} too (fields are positional)"
    return [values[n] for n in names[:last + 1]]


def get(struct: str, arr: list[Any], name: str) -> Any:
    """A field of a decoded positional array; an omitted trailing field has its default."""
    fields = STRUCTS[struct]
    i = [f for f, _ in fields].index(name)
    if i < len(arr):
        return arr[i]
    default = fields[i][1]
    assert default is not _REQUIRED, f"{struct}.{name} is required but missing"
    return default


class Array(msgspec.Struct, frozen=True):
    """A numpy array as this front end sees one: its dtype string, shape and bytes."""

    dtype: str
    shape: list[int]
    data: bytes


def decode_message(frames: list[bytes]) -> Any:
    """The payload, with numpy ext values resolved against this message's aux frames."""

    def ext_hook(code: int, body: memoryview) -> Any:
        assert code == EXT["numpy array"], f"unexpected ext code {code}"
        dtype, shape, data = msgspec.msgpack.decode(body)
        if isinstance(data, int):
            data = frames[1 + data]  # aux 0 is the frame right after the payload
        return Array(dtype, shape, bytes(data))

    return msgspec.msgpack.Decoder(ext_hook=ext_hook).decode(frames[0])


def numpy_ext(dtype: str, shape: list[int], data: int | bytes) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(EXT["numpy array"], msgspec.msgpack.encode([dtype, shape, data]))


class FrontEnd:
    """The two bound sockets and what arrived on the output one, expanded per request."""

    def __init__(self, ctx: zmq.Context[Any], directory: str) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.pull = ctx.socket(zmq.PULL)
        for sock in (self.router, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.input_address = f"ipc://{directory}/input"
        self.output_address = f"ipc://{directory}/output"
        self.router.bind(self.input_address)
        self.pull.bind(self.output_address)
        self.identity = b""
        self.tokens: dict[str, list[int]] = {}
        self.streamed: dict[str, int] = {}  # tokens that came in the stream columns
        self.finish: dict[str, int] = {}
        self.finished_ids: set[str] = set()
        self.replies: dict[int, list[Any]] = {}
        self.heartbeats = 0
        self.markers: list[bytes] = []

    def close(self) -> None:
        self.router.close(0)
        self.pull.close(0)

    def wait_ready(self) -> list[Any]:
        assert self.router.poll(DEADLINE_S * 1000), "no ReadyResponse on the ROUTER"
        frames = self.router.recv_multipart()
        assert len(frames) == 2, f"ready should be [identity, payload], got {len(frames)} parts"
        self.identity = frames[0]
        return msgspec.msgpack.decode(frames[1])

    def send(self, kind: str, payload: Any, *aux: bytes) -> None:
        self.router.send_multipart(
            [self.identity, TYPE_BYTES[kind] + msgspec.msgpack.encode(payload), *aux])

    def receive(self, timeout_s: float) -> bool:
        """Take one message from the PULL; False on timeout."""
        if not self.pull.poll(int(timeout_s * 1000)):
            return False
        frames = self.pull.recv_multipart()
        assert frames != [SENTINEL], "the engine reported a fatal error"
        batch = decode_message(frames)
        assert get("EngineCoreOutputs", batch, "engine_index") == ENGINE_INDEX
        reply = get("EngineCoreOutputs", batch, "utility_output")
        if reply is not None:
            self.replies[get("UtilityOutput", reply, "call_id")] = reply
        ids = get("EngineCoreOutputs", batch, "stream_ids")
        toks = get("EngineCoreOutputs", batch, "stream_tokens")
        outputs = get("EngineCoreOutputs", batch, "outputs")
        finished = get("EngineCoreOutputs", batch, "finished_requests")
        session = get("EngineCoreOutputs", batch, "session")
        if session is not None:
            self.markers.append(session)
        elif reply is None and not (ids or outputs or finished):
            self.heartbeats += 1
        assert len(ids) == len(toks)
        # Expanded as the page says: the column entries first, then ``outputs``.
        for rid, tok in zip(ids, toks, strict=True):
            assert rid not in self.finish, f"{rid} got a token after it finished"
            self.tokens.setdefault(rid, []).append(tok)
            self.streamed[rid] = self.streamed.get(rid, 0) + 1
        for out in outputs:
            rid = get("EngineCoreOutput", out, "request_id")
            assert rid not in self.finish, f"{rid} got an output after it finished"
            self.tokens.setdefault(rid, []).extend(get("EngineCoreOutput", out, "new_token_ids"))
            reason = get("EngineCoreOutput", out, "finish_reason")
            if reason is not None:
                assert reason != FINISH["ERROR"], get("EngineCoreOutput", out, "error")
                self.finish[rid] = reason
        self.finished_ids.update(finished or ())
        return True

    def receive_until(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not done():
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.receive(remaining), f"timed out waiting for {what}"


ENGINE_SCRIPT = """
import os, sys
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import run_engine_core
code = run_engine_core(
    EngineConfig(model="null", null_step_delay_s=0.002),
    input_address=sys.argv[1], output_address=sys.argv[2], engine_index=int(sys.argv[3]),
    heartbeat_interval_s=0.5, parent_pid=int(sys.argv[4]))
sys.stdout.flush(); sys.stderr.flush()
os._exit(code)
"""


@contextmanager
def engine_and_front_end() -> Iterator[tuple[subprocess.Popen[bytes], FrontEnd, Path]]:
    # A short private directory: ipc paths are limited to about 100 bytes.
    directory = tempfile.mkdtemp(prefix="ewdoc-")
    ctx: zmq.Context[Any] = zmq.Context()
    fe = FrontEnd(ctx, directory)
    log = Path(directory) / "engine.log"
    env = {**os.environ, "ENGINEWIRE_ENGINE_THREADS": "1"}
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE_SCRIPT, fe.input_address, fe.output_address,
             str(ENGINE_INDEX), str(os.getpid())],
            stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        yield proc, fe, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(DEADLINE_S)
        fe.close()
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)


def test_the_page_states_what_the_front_end_relies_on() -> None:
    text = " ".join(DOC.split())  # line breaks are the generator's, not facts
    missing = [fact for fact in PROSE if " ".join(fact.split()) not in text]
    assert not missing, f"docs/protocol.md no longer says: {missing}"
    assert set(TYPE_BYTES) == {"ADD", "ABORT", "UTILITY", "ATTACH"}
    assert {"STOP", "LENGTH", "ABORT", "ERROR"} <= set(FINISH)
    assert set(EXT) == {"torch tensor", "numpy array"}
    for name in ("EngineCoreRequest", "SamplingParams", "UtilityRequest", "EngineCoreOutputs",
                 "EngineCoreOutput", "UtilityOutput", "ReadyResponse"):
        assert STRUCTS.get(name), f"no field table for {name}"


@pytest.mark.timeout(60)
def test_raw_front_end_from_the_page_alone() -> None:
    with engine_and_front_end() as (proc, fe, log):
        try:
            _drive(proc, fe)
        except AssertionError:
            sys.stderr.write(log.read_text(errors="replace")[-4000:])
            raise


def _drive(proc: subprocess.Popen[bytes], fe: FrontEnd) -> None:
    # Handshake: the engine speaks first, identified by its index.
    ready = fe.wait_ready()
    assert get("ReadyResponse", ready, "protocol_version") == VERSION, "refuse: unknown version"
    assert get("ReadyResponse", ready, "engine_index") == ENGINE_INDEX
    assert fe.identity == ENGINE_INDEX.to_bytes(2, "little")
    max_model_len = get("ReadyResponse", ready, "max_model_len")
    # Attach under a fresh session: the marker comes back on the PULL.
    session = os.urandom(16)
    fe.send("ATTACH", pack("AttachRequest", session=session))
    fe.receive_until(lambda: session in fe.markers, "the attach marker")
    # With an interval set, a heartbeat arrives before anything was asked.
    fe.receive_until(lambda: fe.heartbeats >= 1, "the first heartbeat")

    # One request and one echo, by hand. The echo carries an array in an aux frame (>= the
    # inline size) and one inline, to check the ext layout both ways.
    fe.send("ADD", pack("EngineCoreRequest", request_id="r1", prompt_token_ids=[5, 6, 7],
                        sampling_params=pack("SamplingParams", max_tokens=8)))
    big = array("d", [i / 3 for i in range(100)]).tobytes()
    small = array("i", [7, -1]).tobytes()
    assert len(big) >= INLINE_UNDER > len(small)
    value = {"text": "héllo", "nums": [1, 2.5, None], "big": numpy_ext("<f8", [100], 0),
             "small": numpy_ext("<i4", [2], small)}
    fe.send("UTILITY", pack("UtilityRequest", client_index=0, call_id=7, method="echo",
                            args=[value]), big)
    fe.receive_until(lambda: "r1" in fe.finish and 7 in fe.replies, "r1 to finish and the echo")
    assert fe.finish["r1"] == FINISH["LENGTH"]
    assert len(fe.tokens["r1"]) == 8
    assert "r1" in fe.finished_ids
    assert fe.streamed.get("r1", 0) >= 1, "no token came in the stream columns"
    reply = fe.replies[7]
    assert get("UtilityOutput", reply, "failure_message") is None
    assert get("UtilityOutput", reply, "result") == {
        "text": "héllo", "nums": [1, 2.5, None], "big": Array("<f8", [100], big),
        "small": Array("<i4", [2], small)}

    # A long request, aborted once it is live: it ends ABORT, short of its length.
    long_tokens = max_model_len - 3
    fe.send("ADD", pack("EngineCoreRequest", request_id="r2", prompt_token_ids=[5, 6, 7],
                        sampling_params=pack("SamplingParams", max_tokens=long_tokens)))
    fe.receive_until(lambda: "r2" in fe.tokens, "r2's first token")
    fe.send("ABORT", ["r2"])
    fe.receive_until(lambda: "r2" in fe.finish, "r2 to finish")
    assert fe.finish["r2"] == FINISH["ABORT"]
    assert "r2" in fe.finished_ids
    assert len(fe.tokens["r2"]) < long_tokens

    # No shutdown message: SIGTERM, exit 0, and no sentinel on the way out.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DEADLINE_S) == 0
    while fe.receive(0):  # receive() fails on the sentinel
        pass
