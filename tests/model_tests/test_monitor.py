"""model_tests/monitor.py: the judge over hand-made traffic (each seeded wire bug gives its
typed violation), the relay between raw sockets (garbage forwarded, judged, never a crash),
captures (replayed to the same verdict; cut or corrupt ones refused), and a real client and
engine through it (no violation, and the client's own trace within the monitor's)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from enginewire.protocol.codec import Encoder, encode_input
from enginewire.protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    AttachRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ReadyResponse,
    RequestType,
    SamplingParams,
    UtilityOutput,
    UtilityRequest,
)
from enginewire.protocol.vllm033 import (
    VLLM_DEAD_SENTINEL,
    VllmEngineCoreOutput,
    VllmEngineCoreOutputs,
    VllmEngineCoreRequest,
    VllmUtilityOutput,
)
from enginewire.spec.errors import ProtocolError
from enginewire.testing.interposer import (
    Direction,
    FrameAction,
    FrameKind,
    FrameRule,
    Interposer,
    Link,
)
from enginewire.testing.monitor import Judge, Monitor, Violation, read_capture, replay

ENC = Encoder()
IDENT = (0).to_bytes(2, "little")
BOUND_MS = 5000


def _b(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def ready() -> list[bytes]:
    return _b(ENC.encode(ReadyResponse(protocol_version=4, engine_index=0, num_gpu_blocks=8,
                                       block_size=16, max_model_len=64, model="null",
                                       device="cpu")))


def add(rid: str) -> list[bytes]:
    return _b(encode_input(ENC, RequestType.ADD, EngineCoreRequest(rid, [1, 2])))


def abort(*rids: str) -> list[bytes]:
    return _b(encode_input(ENC, RequestType.ABORT, list(rids)))


def call(call_id: int, method: str, *args: Any) -> list[bytes]:
    return _b(encode_input(ENC, RequestType.UTILITY, UtilityRequest(0, call_id, method,
                                                                    list(args))))


def out(*items: tuple[str, FinishReason | None], reply: UtilityOutput | None = None
        ) -> list[bytes]:
    return _b(ENC.encode(EngineCoreOutputs(
        outputs=[EngineCoreOutput(r, [7], finish_reason=f) for r, f in items],
        utility_output=reply)))


def judged(*msgs: tuple[Link, list[bytes]], wire: str = "enginewire",
           bound: float = 5.0) -> Judge:
    judge = Judge(wire, abort_bound_s=bound)
    for i, (link, frames) in enumerate(msgs):
        judge.feed(link, frames, float(i))
    judge.end(float(len(msgs)))
    return judge


R, E, OUT = Link.READY, Link.TO_ENGINE, Link.OUTPUT
STOP = FinishReason.STOP


def only(judge: Judge) -> Violation:
    assert len(judge.violations) == 1, judge.violations
    return judge.violations[0]


def test_a_clean_conversation_has_no_violation_and_its_coverage() -> None:
    judge = judged((R, ready()), (E, add("a")), (OUT, out(("a", None))), (OUT, out(("a", STOP))),
                   (E, call(1, "echo", 3)), (OUT, out(reply=UtilityOutput(1, None, 3))),
                   (E, add("b")), (E, abort("b")), (OUT, out(("b", FinishReason.ABORT))))
    assert judge.violations == []
    counts = judge.report()["coverage"]["transition_counts"]
    for t in ("client CONSTRUCTING -HANDSHAKE_OK-> READY",
              "client_request STREAMING -FINISH_STOP-> FINISHED_STOPPED",
              "client_request SENT -ABORT_SENT-> ABORTING",
              "client_request ABORTING -FINISH_ABORT-> FINISHED_ABORTED",
              "utility PENDING -REPLY_OK-> RESOLVED"):
        assert counts[t] == 1, t


@pytest.mark.parametrize(("msgs", "where"), [
    # an output after the request's finish
    ([(OUT, out(("a", STOP))), (OUT, out(("a", None)))], ("client_request", "UNKNOWN", "OUTPUT")),
    # a finish delivered twice
    ([(OUT, out(("a", STOP))), (OUT, out(("a", STOP)))],
     ("client_request", "UNKNOWN", "FINISH_STOP")),
    # a reply to a call never sent
    ([(OUT, out(reply=UtilityOutput(9, None, 1)))], ("utility", "(no such call)", "REPLY_OK")),
    # a second reply to one call
    ([(E, call(1, "echo", 1)), (OUT, out(reply=UtilityOutput(1, None, 1))),
      (OUT, out(reply=UtilityOutput(1, "boom")))], ("utility", "RESOLVED", "REPLY_ERROR")),
    # a call id reused while pending
    ([(E, call(1, "echo", 1)), (E, call(1, "echo", 2))], ("utility", "PENDING", "call")),
    # a request still streaming after the engine said it slept
    ([(E, call(1, "sleep", 1, "keep")), (OUT, out(reply=UtilityOutput(1))),
      (OUT, out(("a", None)))], ("client", "SLEEPING", "output")),
    # an abort never answered within the bound (here 5 s, the messages 1 s apart)
    ([(E, abort("a"))] + [(OUT, out())] * 7, ("client_request", "ABORTING", "FINISH_ABORT")),
    # anything after the dead sentinel
    ([(OUT, [ENGINE_DEAD_SENTINEL]), (OUT, out(("a", None)))], ("engine", "DEAD", "output")),
    # frames that do not decode, either way
    ([(OUT, [b"\xc1garbage"])], ("wire", "output", "undecodable")),
    ([(E, [b"\x07junk"])], ("wire", "to_engine", "undecodable")),
])
def test_each_seeded_wire_bug_is_its_typed_violation(msgs: list[Any],
                                                     where: tuple[str, str, str]) -> None:
    v = only(judged((R, ready()), (E, add("a")), *msgs))
    assert (v.machine, v.state, v.event) == where
    # The frames that led there end with the one that did it.
    assert v.frames and v.frames[-1].startswith(msgs[-1][0].name.lower())


def test_a_call_pending_at_death_is_failed_and_named() -> None:
    judge = judged((R, ready()), (E, call(4, "echo", 1)), (OUT, [ENGINE_DEAD_SENTINEL]))
    assert judge.violations == []
    assert [c["call_id"] for c in judge.pending_at_death] == [4]
    assert judge.report()["coverage"]["transition_counts"][
        "utility PENDING -ENGINE_DIED-> FAILED_DEAD"] == 1


def test_messages_before_the_attach_marker_are_an_earlier_front_end_s() -> None:
    session = b"s" * 16
    attach = _b(encode_input(ENC, RequestType.ATTACH, AttachRequest(session=session)))
    marker = _b(ENC.encode(EngineCoreOutputs(session=session)))
    judge = judged((R, ready()), (E, attach), (OUT, out(("old", STOP))), (OUT, marker),
                   (E, add("a")), (OUT, out(("a", STOP))))
    assert judge.violations == []
    counts = judge.report()["coverage"]["transition_counts"]
    assert counts["attach AWAITING_MARKER -FOREIGN_MESSAGE-> AWAITING_MARKER"] == 1
    assert counts["attach AWAITING_MARKER -MARKER-> ATTACHED"] == 1


def _vllm_add(rid: str) -> list[bytes]:
    req = VllmEngineCoreRequest(rid, [1], None, None, None, 0.0, None, None, None)
    return [RequestType.ADD.value, msgspec.msgpack.encode(req)]


def _vllm_out(*items: tuple[str, int | None], reply: VllmUtilityOutput | None = None
              ) -> list[bytes]:
    return [msgspec.msgpack.encode(VllmEngineCoreOutputs(
        outputs=[VllmEngineCoreOutput(r, [7], finish_reason=f) for r, f in items],
        utility_output=reply))]


def test_vllm_s_wire_is_judged_the_same() -> None:
    v_ready = [msgspec.msgpack.encode({"max_model_len": 64})]
    v_call = [RequestType.UTILITY.value, msgspec.msgpack.encode([0, 1, "is_sleeping", []])]
    clean = judged((R, v_ready), (E, _vllm_add("a")), (OUT, _vllm_out(("a", None))),
                   (OUT, _vllm_out(("a", 0))), (E, v_call),
                   (OUT, _vllm_out(reply=VllmUtilityOutput(1, None, [None, False]))),
                   wire="vllm-0.33")
    assert clean.violations == []
    v = only(judged((R, v_ready), (E, _vllm_add("a")), (OUT, _vllm_out(("a", 1))),
                    (OUT, _vllm_out(("a", 1))), wire="vllm-0.33"))
    assert (v.machine, v.state, v.event) == ("client_request", "UNKNOWN", "FINISH_LENGTH")
    dead = judged((R, v_ready), (E, _vllm_add("a")), (OUT, [VLLM_DEAD_SENTINEL]),
                  wire="vllm-0.33")
    assert dead.violations == []
    assert "client_request SENT -ENGINE_DIED-> FINISHED_ERROR" in dead.report()[
        "coverage"]["transition_counts"]


# --- the relay between raw sockets -------------------------------------------------------------


class Ends:
    """A front end's bound ROUTER/PULL and an engine's DEALER/PUSH, through the monitor (or
    the interposer: the same ends)."""

    def __init__(self, tmp: Path, mon: Monitor | Interposer, ident: bytes = IDENT) -> None:
        self.ctx = zmq.Context()
        self.router, self.pull = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.PULL)
        inp, out_ = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        self.router.bind(inp)
        self.pull.bind(out_)
        mon.attach(inp, out_)
        self.dealer, self.push = self.ctx.socket(zmq.DEALER), self.ctx.socket(zmq.PUSH)
        self.dealer.setsockopt(zmq.IDENTITY, ident)  # an engine's is its index
        self.dealer.connect(mon.engine_addresses[0])
        self.push.connect(mon.engine_addresses[1])
        for s in (self.router, self.pull, self.dealer, self.push):
            s.setsockopt(zmq.RCVTIMEO, BOUND_MS)
            s.setsockopt(zmq.LINGER, 0)

    def close(self) -> None:
        for s in (self.router, self.pull, self.dealer, self.push):
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[Ends, Monitor]]:
    mon = Monitor(capture=tmp_path / "cap", live=None).start()
    ends = Ends(tmp_path, mon)
    try:
        yield ends, mon
    finally:
        ends.close()
        mon.stop()


def test_the_relay_forwards_garbage_unchanged_and_judges_it(relay: tuple[Ends, Monitor],
                                                           tmp_path: Path) -> None:
    ends, mon = relay
    ends.dealer.send_multipart(ready())
    assert ends.router.recv_multipart() == [IDENT, *ready()]
    sent = [add("a"), [b"\x07junk", b"aux"], [b""], add("b")]
    for m in sent:
        ends.router.send_multipart([IDENT, *m])
    assert [ends.dealer.recv_multipart() for _ in sent] == sent
    back = [out(("a", STOP)), [b"\xc1\xc1"], out(("a", STOP)), [b"x" * 100_000]]
    for m in back:
        ends.push.send_multipart(m)
    assert [ends.pull.recv_multipart() for _ in back] == back
    deadline = time.monotonic() + 5
    while len(mon.violations) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    report = mon.stop()
    kinds = [(v["machine"], v["event"]) for v in report["violations"]]
    assert kinds == [("wire", "undecodable")] * 3 + [
        ("client_request", "FINISH_STOP"), ("wire", "undecodable")], kinds
    # The capture judges the same way, offline.
    again = replay(tmp_path / "cap")
    assert again["violations"] == report["violations"]
    assert again["coverage"] == report["coverage"]
    assert again["capture"]["ended_cleanly"]


def test_a_judge_too_far_behind_stops_judging_and_the_relay_forwards_on(
        tmp_path: Path) -> None:
    """The backlog bound: past ``max_backlog`` bytes waiting for the judge, judging stops
    (said in the report and on the live stream) and nothing is held for it, while every
    message is still forwarded, unchanged and in order."""
    import io

    live = io.StringIO()
    mon = Monitor(live=live)
    mon.max_backlog = 150_000  # one big message fits, the next does not
    with contextlib.ExitStack() as stack:
        stack.enter_context(mon)
        ends = Ends(tmp_path, mon)
        stack.callback(ends.close)
        ends.dealer.send_multipart(ready())
        assert ends.router.recv_multipart() == [IDENT, *ready()]
        with mon._lock:  # the judge held up: the backlog grows
            back = [[b"x" * 100_000] for _ in range(5)]
            for m in back:
                ends.push.send_multipart(m)
            assert [ends.pull.recv_multipart() for _ in back] == back
        report = mon.stop()
    stopped = report["judging_stopped"]
    assert "150000 bytes behind" in stopped["why"] and stopped["unjudged"] >= 3, stopped
    assert "JUDGING STOPPED" in live.getvalue()


def test_a_full_disk_or_a_judge_bug_never_stops_the_relay(tmp_path: Path) -> None:
    mon = Monitor(capture="/dev/full", live=None)
    broken = {"n": 0}
    feed = mon.judge.feed

    def flaky(link: Link, frames: list[bytes], at: float) -> None:
        broken["n"] += 1
        if broken["n"] == 2:
            raise RuntimeError("a bug")
        feed(link, frames, at)

    mon.judge.feed = flaky  # type: ignore[method-assign]
    mon.start()
    ends = Ends(tmp_path, mon)
    try:
        ends.dealer.send_multipart(ready())
        ends.router.recv_multipart()
        big = [out(("x", None))[0] + b"\0" * 70_000]  # past the file's buffer: ENOSPC
        for _ in range(3):
            ends.push.send_multipart(big)
            assert ends.pull.recv_multipart() == big
    finally:
        ends.close()
        report = mon.stop()
    assert "No space left" in report["capture"]["error"]
    assert report["internal_errors"] == ["RuntimeError: a bug"]
    assert report["frames"] == {"to_engine": 0, "output": 2, "ready": 1}


def test_the_engine_s_connection_lost_without_a_sentinel_is_reported(
        relay: tuple[Ends, Monitor], tmp_path: Path) -> None:
    ends, mon = relay
    ends.dealer.send_multipart(ready())
    ends.router.recv_multipart()
    ends.router.send_multipart([IDENT, *add("a")])
    ends.dealer.recv_multipart()
    ends.dealer.close(linger=0)  # the engine goes, saying nothing
    deadline = time.monotonic() + 5
    while not mon.report()["engine_disconnects"] and time.monotonic() < deadline:
        time.sleep(0.02)
    (gone,) = mon.stop()["engine_disconnects"]
    assert gone["live_requests"] == ["a"] and not gone["after_sentinel"]
    assert replay(tmp_path / "cap")["engine_disconnects"] == [gone]


def test_a_monitor_stands_in_for_engine_i_of_several(tmp_path: Path) -> None:
    one = (1).to_bytes(2, "little")
    mon = Monitor(engine_index=1, live=None).start()
    ends = Ends(tmp_path, mon, one)
    try:
        ends.dealer.send_multipart(ready())
        assert ends.router.recv_multipart() == [one, *ready()]
        ends.router.send_multipart([one, *add("a")])
        assert ends.dealer.recv_multipart() == add("a")
    finally:
        ends.close()
        assert mon.stop()["violations"] == []


def test_a_cut_or_corrupt_capture_is_a_protocol_error(relay: tuple[Ends, Monitor],
                                                     tmp_path: Path) -> None:
    ends, mon = relay
    ends.dealer.send_multipart(ready())
    ends.router.recv_multipart()
    ends.router.send_multipart([IDENT, *add("a")])
    ends.dealer.recv_multipart()
    mon.stop()
    data = (tmp_path / "cap").read_bytes()
    for name, bad, says in (("cut", data[:-7], "cut at byte"),
                            ("flipped", data[:40] + bytes([data[40] ^ 1]) + data[41:], "corrupt"),
                            ("alien", b"PK\x03\x04" + data[4:], "not a monitor capture")):
        path = tmp_path / name
        path.write_bytes(bad)
        with pytest.raises(ProtocolError, match=says):
            replay(path)
    wire, records, ended = read_capture(tmp_path / "cap")
    assert wire == "enginewire" and len(list(records)) == 2 and ended
    # One the monitor never closed (killed: no end record) still replays, and says so.
    (tmp_path / "killed").write_bytes(data[:-17])
    wire, records, ended = read_capture(tmp_path / "killed")
    assert len(list(records)) == 2 and not ended
    assert not replay(tmp_path / "killed")["capture"]["ended_cleanly"]


def test_a_capture_the_interposer_wrote_is_judged_offline(tmp_path: Path) -> None:
    """A seeded wire bug injected by the interposer (every output batch duplicated: a finish
    delivered twice), captured there, and judged by replay."""
    rule = FrameRule(action=FrameAction.DUPLICATE, direction=Direction.TO_CLIENT,
                     kind=FrameKind.TOKENS, count=None)
    proxy = Interposer([rule], capture=str(tmp_path / "cap")).start()
    ends = Ends(tmp_path, proxy)
    try:
        ends.dealer.send_multipart(ready())
        ends.router.recv_multipart()
        ends.router.send_multipart([IDENT, *add("a")])
        ends.dealer.recv_multipart()
        ends.push.send_multipart(out(("a", None)))
        ends.push.send_multipart(out(("a", FinishReason.LENGTH)))
        assert len([ends.pull.recv_multipart() for _ in range(4)]) == 4
    finally:
        ends.close()
        proxy.close()
    report = replay(tmp_path / "cap")
    assert [(v["machine"], v["state"], v["event"]) for v in report["violations"]] == [
        ("client_request", "UNKNOWN", "FINISH_LENGTH")]
    assert report["frames"] == {"to_engine": 1, "output": 4, "ready": 1}


# --- a real client and engine through it -----------------------------------------------------


def test_a_real_client_through_the_monitor_agrees_with_its_own_trace(tmp_path: Path) -> None:
    from enginewire.runtime.config import EngineConfig
    from enginewire.runtime.factory import make_client

    trace: list[Any] = []
    inp, out_ = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    with Monitor(capture=tmp_path / "cap", report_dir=tmp_path, live=None) as mon:
        mon.attach(inp, out_)
        client = make_client(EngineConfig(model="null", max_model_len=256), multiprocess=True,
                             asyncio=False, input_address=inp, output_address=out_,
                             engine_connect=mon.engine_addresses, trace=trace)
        try:
            for rid in ("a", "b"):
                client.add_request(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=4)))
            client.add_request(EngineCoreRequest("long", [1], SamplingParams(max_tokens=500)))
            client.abort_requests(["long"])
            left, deadline = {"a", "b", "long"}, time.monotonic() + 30
            while left and time.monotonic() < deadline:
                for o in client.get_output().outputs:
                    if o.finish_reason is not None:
                        left.discard(o.request_id)
            assert not left
            assert client.call_utility("echo", 5) == 5
            client.sleep(1)
            client.wake_up()
        finally:
            client.shutdown()
    report = mon.stop()
    assert report["violations"] == [] and not report["failed"]
    seen = set(report["coverage"]["transition_counts"])
    own = {f"{m} {a} -{e}-> {b}" for m, a, e, b, _ in trace}
    # The client's shutdown of an engine it launched is no message (the engine is stopped as
    # a process): the one transition of its trace the wire cannot show.
    assert own - seen == {"client RUNNING -SHUTDOWN-> SHUTDOWN"}
    assert {t.split(" ")[0] for t in seen - own} == {"engine"}  # the handshake, seen only here
    page = Path(report["report"]).with_suffix(".html").read_text()
    assert "<h1>enginewire monitor: OK</h1>" in page and page.count("<svg") >= 4
    assert replay(tmp_path / "cap")["coverage"] == report["coverage"]


@pytest.mark.slow
def test_a_campaign_with_a_monitor_on_every_link_agrees_with_the_clients_traces(
        tmp_path: Path) -> None:
    """Differential over a campaign run (issue 48): no violation on a clean run, and the wire's
    client-side transitions are the clients' own, but for what the wire cannot show (a
    shutdown of a launched engine sends nothing) and what the wire shows that a client never
    read (outputs still on their way at its shutdown)."""
    import json

    from enginewire.testing.campaign import run_campaign

    assert run_campaign(client="async", examples=3, steps=15, seed=2, faults=False,
                        model="null", results_dir=str(tmp_path), monitor=True) == 0
    (path,) = tmp_path.glob("campaign-*.json")
    report = json.loads(path.read_text())
    (client,) = report["clients"]
    assert client["monitor"]["links"] >= 1 and client["monitor"]["violations"] == []
    wire = set(report["monitor"]["coverage"]["transition_counts"])
    own = set(report["coverage"]["transition_counts"])
    client_side = ("client", "client_request", "utility", "attach")
    assert {t for t in wire if t.split(" ")[0] in client_side} - {
        t for t in wire if t.startswith("client_request ")} <= own
    unseen = {t for t in own - wire if t.split(" ")[0] in client_side}
    assert all(" -SHUTDOWN-> " in t for t in unseen), unseen
    assert len(wire & own) >= 15


@pytest.mark.slow
def test_a_fault_matrix_with_a_monitor_on_each_cell_s_link(tmp_path: Path) -> None:
    """Two cells, each through a monitor: the cells' verdicts stand (the relay is
    transparent), and fault_matrix.json carries what the monitors saw: the dead sentinel of
    the killed forward pass, the failed echo, each as the spec's transition."""
    import json

    from enginewire.runtime.config import EngineConfig
    from enginewire.runtime.faults import Fault, FaultPoint
    from enginewire.testing.fault_matrix import Cell, Scenario, run_fault_matrix

    cells = [Cell("sync", Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3)),
             Cell("sync", Scenario.UTILITY, Fault(point=FaultPoint.UTILITY, method="echo"))]
    assert run_fault_matrix(["sync"], results_dir=str(tmp_path), cells=cells, extra_cells=[],
                            config=EngineConfig(model="null", max_num_seqs=4), echo=None,
                            monitor=True) == 0
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    mon = report["monitor"]
    assert mon["links"] == 2 and mon["violations"] == [], mon
    counts = mon["coverage"]["transition_counts"]
    assert any(t.startswith("engine ") and t.endswith(" -FATAL_ERROR-> DEAD")
               for t in counts), counts
    assert any(t.startswith("client ") and t.endswith(" -ENGINE_DIED-> DEAD")
               for t in counts), counts
    assert counts["utility PENDING -REPLY_ERROR-> FAILED_REMOTE"] == 1, counts


def _through_monitor(tmp_path: Path, mon: Monitor, **config: Any) -> Any:
    from enginewire.runtime.config import EngineConfig
    from enginewire.runtime.factory import make_client

    inp, out_ = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    mon.attach(inp, out_)
    return make_client(EngineConfig(model="null", max_model_len=2048, **config),
                       multiprocess=True, asyncio=False, input_address=inp,
                       output_address=out_, engine_connect=mon.engine_addresses)


@pytest.mark.parametrize(("mutant", "where"), [
    # the client sends a second ADD under a live request's id
    ("duplicate_live_id_accepted", ("client_request", "STREAMING", "SEND")),
    # sleep(mode="wait") replies while requests still stream: tokens after the sleep's ack
    ("sleep_wait_replies_before_idle", ("client", "SLEEPING", "output")),
])
def test_a_seeded_bug_is_flagged_from_the_wire(mutant: str, where: tuple[str, str, str],
                                                      tmp_path: Path) -> None:
    """The mutant bank's bugs that show on the wire (one of the client's, one of the
    engine's), flagged from traffic alone."""
    from enginewire.testing import mutants

    mutants.apply(mutant)  # this process and the engine it launches (preload)
    try:
        with Monitor(live=None) as mon:
            client = _through_monitor(tmp_path, mon, null_step_delay_s=0.01)
            try:
                client.add_request(EngineCoreRequest("r", [1], SamplingParams(max_tokens=300)))
                client.get_output(timeout=10)  # streaming
                if mutant == "duplicate_live_id_accepted":
                    client.add_request(EngineCoreRequest("r", [2]))
                    client.get_output(timeout=10)
                else:
                    client.call_utility("sleep", 0, "wait", timeout=10)
                    client.get_output(timeout=10)  # a token after the ack
                    client.call_utility("wake_up", None, timeout=10)
            finally:
                client.shutdown()
    finally:
        mutants.revert()
    report = mon.stop()
    assert [(v["machine"], v["state"], v["event"]) for v in report["violations"]][:1] == [
        where], report["violations"]
