"""Several front ends over shared engines (``enginewire bench --front-ends K``, issue 47).

K front-end **processes** (spawned; each an ordinary ``SyncMPClient``, or a data-parallel
client with ``--engines N``, attached with ``launch_engine=False`` and its own
``client_index``) against the same standalone null-model engine(s), each engine serving all
K front ends at once (one address pair per front end, as ``enginewire engine`` takes them).

*Delivery*: each front end runs the delivery row's round (``ipc.py``: K requests of 512-token
prompts x 64 tokens, the engine paused with ``keep`` while every front end's adds land, then
resumed by front end 0), all front ends at once, against front end 0 alone (the others
attached and idle) in the same run; the one front end's rate is also set against the raw
pyzmq floor pipeline (``floor.py``) in the same run, as the delivery row does. The null
engine steps with no delay, so a step costs what building and sending its outputs costs: the
front end reading them is the slower side when it is alone (the delivery row's finding), and
the aggregate can only scale while the engine, and the machine's cores, keep up with K of
them. Each front end's window opens at the engine's stamp on its first (prefill) batch of
each engine and closes when it has its last batch (``time.monotonic``, one clock across the
processes); the aggregate's opens at the earliest of those stamps and closes at the latest
last batch, over every front end's tokens.

*Round trip*: front end 0's echo (a no-op utility call of 16 bytes), with the other front
ends idle and with them streaming delivery rounds back to back; and, for scale, the raw pyzmq
echo in the same run. Blocks alternate, so a noisy neighbour hits every condition alike.

Every wait is bounded; the front ends and engines are stopped (and reaped) however the run
ends.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from ..runtime.config import EngineConfig
from ._child import Child, child_side
from .floor import FloorPeer, freeze_heap
from .ipc import (
    ECHO_PAYLOAD,
    echo_rows,
    floor_round,
    make_row,
    null_config,
    our_requests,
    peers,
    percentile,
    random_prompts,
)

__all__ = ["FRONT_ENDS", "bench_front_ends"]

FRONT_ENDS = 2  # the section's front ends when none are named
_TIMEOUT_S = 60.0  # any one step of the protocol between this process and a front end
_START_S = 120.0  # a front end's or an engine's start (spawn, import, handshake) on 2 cores
_FRONT_END_TIMEOUT_S = 10.0  # the engines' deadline on a silent front end (their default)


class FrontEndError(RuntimeError):
    """A front-end process failed; its error, as it saw it."""


# --- the front-end process -------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has run, over all its threads (each thread's
    ``schedstat``: nanoseconds, where ``/proc/PID/stat`` counts 10 ms ticks, too coarse for
    a window of a tenth of a second); NaN where /proc cannot say."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return total / 1e9


class _Tally:
    """One front end's view of a round: per engine, its first batch opens the window (the
    prefill step, not counted, as ``ipc._Round``); every later batch's tokens count.

    The CPU this process and the engines used say which side was the bottleneck: counted
    from ``mark`` (the front end that resumes the engines marks just before it resumes them,
    so its figure holds every step; the others at their first batch) to the last batch, over
    that wall time. Marked at the first batch, a front end that reads late (its batches
    queued) would see engines that had already finished."""

    __slots__ = ("cpu0", "done", "engines", "first", "last", "t0", "tokens")

    def __init__(self, engines: list[int]) -> None:
        self.first: dict[int, float] = {}
        self.last = 0.0
        self.tokens = 0
        self.done = 0
        self.engines = engines
        self.cpu0: list[float] = []
        self.t0 = 0.0

    def _cpu(self) -> list[float]:
        return [time.process_time(), *map(_cpu_s, self.engines)]

    def mark(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = self._cpu()

    def take(self, batch: Any) -> None:
        outputs = batch.outputs
        if not outputs:
            return
        now = time.monotonic()
        engine = batch.engine_index
        if not self.cpu0:
            self.mark()
        if engine not in self.first:
            self.first[engine] = batch.timestamp
        else:
            n = 0
            for o in outputs:
                n += len(o.new_token_ids)
                if o.finish_reason is not None:
                    self.done += 1
            self.tokens += n
        self.last = now

    def result(self) -> dict[str, Any]:
        first = min(self.first.values())
        wall = self.last - self.t0
        cores = [(b - a) / wall for a, b in zip(self.cpu0, self._cpu(), strict=True)]
        return {"first": first, "last": self.last, "tokens": self.tokens,
                "tok_s": self.tokens / (self.last - first), "cores": cores[0],
                "engine_cores": cores[1:]}


def _drain(client: Any, k: int, tag: str, tally: _Tally) -> dict[str, Any]:
    deadline = time.monotonic() + _TIMEOUT_S
    while tally.done < k:
        tally.take(client.get_output(timeout=1.0))
        if time.monotonic() > deadline:
            raise TimeoutError(f"front-end round {tag}: {tally.done}/{k} finished")
    return tally.result()


def _front_end_main(conn: Connection, config_bytes: bytes, index: int,
                    inputs: list[str], outputs: list[str]) -> None:
    """A front-end process: attach as ``client_index`` ``index``, then do what ``conn`` says
    until ``quit`` (or until the bench is gone: its end of the pipe closes)."""
    from ..runtime.factory import make_client

    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    dp = config.data_parallel_size > 1
    client: Any = None
    with child_side(conn, f"front end {index}"):
        try:
            client = make_client(
                config, multiprocess=True, asyncio=False, launch_engine=False,
                client_index=index, input_address=inputs if dp else inputs[0],
                output_address=outputs if dp else outputs[0],
                ready_timeout_s=_START_S, engine_heartbeat_timeout_s=_TIMEOUT_S)
            client.call_utility("echo", ECHO_PAYLOAD, timeout=_START_S)  # every engine answers
            freeze_heap()  # after start-up, as the bench's own clients are measured
            conn.send(("ready", None))
            prompts: dict[int, list[list[int]]] = {}
            while True:
                cmd, *args = conn.recv()
                if cmd == "quit":
                    conn.send(("bye", None))
                    return
                conn.send(_serve(client, conn, prompts, cmd, args))
        finally:
            if client is not None:
                client.shutdown()


def _serve(client: Any, conn: Connection, prompts: dict[int, list[list[int]]], cmd: str,
           args: list[Any]) -> tuple[str, Any]:
    """One command; its reply."""
    call = client.call_utility
    if cmd == "pause":  # engine-wide: every engine of this client, for every front end
        call("pause_scheduler", "keep", timeout=_TIMEOUT_S)
        return "paused", None
    if cmd == "round":  # add K; front end 0 then waits for "go" to resume; drain
        k, tag, resumes, engines = args
        p = prompts.setdefault(k, random_prompts(k, k))
        for req in our_requests(k, p, tag):
            client.add_request(req)
        conn.send(("added", None))
        tally = _Tally(engines)
        if resumes:
            _expect(conn, "go", "the go")
            tally.mark()
            call("resume_scheduler", timeout=_TIMEOUT_S)
        return "round", _drain(client, k, tag, tally)
    if cmd == "echo":
        (n,) = args
        pc = time.perf_counter
        out = []
        for _ in range(n):
            t0 = pc()
            call("echo", ECHO_PAYLOAD, timeout=_TIMEOUT_S)
            out.append((pc() - t0) * 1e6)
        return "echoed", out
    if cmd == "busy":  # rounds back to back, no gate, until "stop"
        k, tag = args
        p = prompts.setdefault(k, random_prompts(k, k))
        rounds = 0
        while True:
            for req in our_requests(k, p, f"{tag}-{rounds}"):
                client.add_request(req)
            if not rounds:
                conn.send(("busy", None))
            _drain(client, k, f"{tag}-{rounds}", _Tally([]))
            rounds += 1
            if conn.poll():
                _expect(conn, "stop", "a stop")
                return "stopped", rounds
    raise ValueError(f"unknown front-end command {cmd!r}")


def _expect(conn: Connection, what: str, said: str) -> None:
    if not conn.poll(_TIMEOUT_S):
        raise TimeoutError(f"no {said} from the bench in {_TIMEOUT_S:g} s")
    got = conn.recv()
    if got[0] != what:
        raise ValueError(f"expected {what!r} from the bench, got {got!r}")


# --- this side -------------------------------------------------------------------------------


class _FrontEnd(Child):
    """A front-end process and its pipe; every reply awaited with a bound."""

    def __init__(self, mp: Any, config: EngineConfig, index: int, inputs: list[str],
                 outputs: list[str]) -> None:
        super().__init__(mp, _front_end_main,
                         (msgspec.msgpack.encode(config), index, inputs, outputs),
                         name=f"bench-front-end-{index}", label=f"front end {index}",
                         error=FrontEndError)
        self.index = index
        self.engine_pids: list[int] = []  # the engines' processes, for their CPU figures

    def reply(self, what: str, bound: float = _TIMEOUT_S) -> Any:
        return super().reply(what, bound)

    def close(self) -> None:
        self.finish("quit", "bye", (OSError, ValueError))


def _engine_main(config_bytes: bytes, kwargs: dict[str, Any]) -> None:
    """An engine process: ``process_main`` logging errors only, unless the environment says
    otherwise (each front end's goodbye at the end is a warning there, noise here)."""
    from ..runtime.engine_proc import process_main

    os.environ.setdefault("ENGINEWIRE_ENGINE_LOG_LEVEL", "ERROR")
    process_main(EngineConfig, config_bytes, kwargs)


def _stop(proc: BaseProcess) -> None:
    if proc.is_alive() and proc.pid is not None:
        os.kill(proc.pid, signal.SIGTERM)  # an engine's clean stop: it tells its front ends
        proc.join(10.0)
    if proc.is_alive():
        proc.kill()
        proc.join(10.0)


@contextlib.contextmanager
def _topology(front_ends: int, engines: int, k_max: int) -> Iterator[list[_FrontEnd]]:
    """``engines`` standalone engines, each serving ``front_ends`` address pairs, and the
    front-end processes attached to them; all stopped on exit."""
    config = msgspec.structs.replace(null_config(k_max * front_ends),
                                     data_parallel_size=engines)
    mp = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        where = stack.enter_context(tempfile.TemporaryDirectory(prefix="ew-fe-"))

        def pair(e: int, i: int) -> tuple[str, str]:
            return f"ipc://{where}/in-e{e}-f{i}", f"ipc://{where}/out-e{e}-f{i}"

        engine_procs: list[BaseProcess] = []
        for e in range(engines):
            kwargs = {"input_address": [pair(e, i)[0] for i in range(front_ends)],
                      "output_address": [pair(e, i)[1] for i in range(front_ends)],
                      "engine_index": e, "parent_pid": os.getpid(),
                      "front_end_timeout_s": _FRONT_END_TIMEOUT_S}
            proc = mp.Process(target=_engine_main, daemon=True, name=f"bench-engine-{e}",
                              args=(msgspec.msgpack.encode(config), kwargs))
            proc.start()
            stack.callback(_stop, proc)
            engine_procs.append(proc)
        pids = [p.pid for p in engine_procs if p.pid is not None]
        fes = []
        for i in range(front_ends):
            fe = _FrontEnd(mp, config, i, [pair(e, i)[0] for e in range(engines)],
                           [pair(e, i)[1] for e in range(engines)])
            stack.callback(fe.close)  # before the engines': a front end says goodbye
            fe.engine_pids = pids
            fes.append(fe)
        for fe in fes:
            fe.reply("ready", _START_S)
        yield fes


def _round(fes: list[_FrontEnd], k: int, tag: str) -> list[dict[str, Any]]:
    """One gated round on ``fes`` at once (the first one pauses and resumes the engines)."""
    lead = fes[0]
    lead.send("pause")
    lead.reply("paused")
    for fe in fes:
        fe.send("round", k, tag, fe is lead, fe.engine_pids if fe is lead else [])
    for fe in fes:
        fe.reply("added")
    lead.send("go")
    return [fe.reply("round") for fe in fes]


def _aggregate(results: list[dict[str, float]]) -> float:
    first = min(r["first"] for r in results)
    last = max(r["last"] for r in results)
    return sum(r["tokens"] for r in results) / (last - first)


def _delivery(fes: list[_FrontEnd], pipe: FloorPeer, k: int, reps: int
              ) -> list[dict[str, Any]]:
    n = len(fes)
    prompts = random_prompts(k, k)
    alone: list[float] = []
    floor: list[float] = []
    agg: list[float] = []
    each: list[list[float]] = [[] for _ in fes]
    # Cores used inside the windows: [front end(s)..., engine(s)...] per round.
    cores_alone: list[list[float]] = []
    cores_all: list[list[float]] = []
    for i in range(-1, reps):  # -1: a warm-up of each, not kept
        for j in range(3):  # who goes first rotates
            which = (i + j) % 3
            if which == 0:
                (r0,) = _round(fes[:1], k, f"o{k}-{i}")
                alone.append(r0["tok_s"])
                cores_alone.append([r0["cores"], *r0["engine_cores"]])
            elif which == 1:
                floor.append(floor_round(pipe, k, prompts, f"f{k}-{i}")["tok_s"])
            else:
                results = _round(fes, k, f"a{k}-{i}")
                agg.append(_aggregate(results))
                for xs, r in zip(each, results, strict=True):
                    xs.append(r["tok_s"])
                cores_all.append([*(r["cores"] for r in results),
                                  *results[0]["engine_cores"]])
        if i < 0:
            kept: list[list[Any]] = [alone, floor, agg, *each, cores_alone, cores_all]
            for warm_up in kept:
                warm_up.clear()
        gc.collect()  # between rounds, never inside a window
    one = statistics.median(alone)
    rows = [
        make_row("frontends", f"one front end (of {n} attached) tokens/s K={k} / floor",
                 "tok/s", alone, floor,
                 statistics.median(a / f for a, f in zip(alone, floor, strict=True)),
                 key=f"frontends_one_{k}", reps=reps),
        make_row("frontends", f"{n} front ends tokens/s K={k} each, aggregate / one front end",
                 "tok/s", agg, alone,
                 statistics.median(a / o for a, o in zip(agg, alone, strict=True)),
                 key=f"frontends_scaling_{k}" if n == FRONT_ENDS else None, reps=reps,
                 per_front_end=[statistics.median(xs) for xs in each],
                 speedup=statistics.median(agg) / one,
                 # Who was the bottleneck: cores each process used inside the windows.
                 cores_alone=_cores(cores_alone, 1), cores_all=_cores(cores_all, n)),
    ]
    for j, xs in enumerate(each):
        rows.append(make_row(
            "frontends", f"front end {j} of {n} tokens/s K={k}, all streaming / one alone",
            "tok/s", xs, alone, statistics.median(x / o for x, o in zip(xs, alone, strict=True)),
            reps=reps))
    return rows


def _cores(rounds: list[list[float]], front_ends: int) -> dict[str, list[float]]:
    """Median cores per process over ``rounds``: the front ends', then the engines'."""
    med = [statistics.median(xs) for xs in zip(*rounds, strict=True)]
    return {"front_ends": med[:front_ends], "engines": med[front_ends:]}


def _echo(fes: list[_FrontEnd], raw: FloorPeer, k_busy: int, n: int, block: int
          ) -> list[dict[str, Any]]:
    """Front end 0's echo round trip: others idle, others streaming, and the raw floor."""
    lead, others = fes[0], fes[1:]
    pc = time.perf_counter
    idle: list[list[float]] = []
    busy: list[list[float]] = []
    floor: list[list[float]] = []

    def ours(out: list[list[float]]) -> None:
        lead.send("echo", block)
        out.append(lead.reply("echoed"))

    def streaming() -> None:
        for fe in others:
            fe.send("busy", k_busy, "b")
        for fe in others:
            fe.reply("busy")
        try:
            ours(busy)
        finally:
            for fe in others:
                fe.send("stop")
            for fe in others:
                fe.reply("stopped")

    def raw_block() -> None:
        xs = []
        for _ in range(block):
            t0 = pc()
            raw.echo(ECHO_PAYLOAD)
            xs.append((pc() - t0) * 1e6)
        floor.append(xs)

    ours([])  # warm-up
    raw_block()
    floor.clear()
    for i in range(max(1, n // block)):
        for j in range(3):  # who goes first rotates
            which = (i + j) % 3
            if which == 0:
                ours(idle)
            elif which == 1:
                streaming()
            else:
                raw_block()
    name = f"front end 0 of {len(fes)}"
    rows = echo_rows(name, idle, {"raw": floor}, None, section="frontends")
    rows += echo_rows(f"{name}, {len(others)} other(s) streaming K={k_busy}", busy,
                       {"others idle": idle}, None, section="frontends")
    for r in rows[2:]:
        r["busy_p50_growth_us"] = percentile([x for b in busy for x in b], 0.5) - percentile(
            [x for b in idle for x in b], 0.5)
    return rows


def bench_front_ends(front_ends: int = FRONT_ENDS, engines: int = 1, *,
                     ks: tuple[int, ...] = (256, 1024), reps: int = 3,
                     echo: tuple[int, int] = (2000, 250)) -> list[dict[str, Any]]:
    """The section's rows: per K in ``ks``, one front end against the pyzmq floor, the
    aggregate of ``front_ends`` against one, and each front end's share; then front end 0's
    echo round trip (``echo=(calls, block)``) with the others idle and streaming at
    ``min(ks)``, and against the raw echo. ``engines`` > 1: a data-parallel client per front
    end, each engine serving every front end."""
    for name, v, lo in (("front_ends", front_ends, 2), ("engines", engines, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r}: the front-ends section needs {name} >= {lo}")
    rows: list[dict[str, Any]] = []
    with peers("raw_echo", "pipeline") as floor, _topology(front_ends, engines, max(ks)) as fes:
        for k in ks:
            rows += _delivery(fes, floor["pipeline"], k, reps)
        rows += _echo(fes, floor["raw_echo"], min(ks), *echo)
    for r in rows:
        r.update(front_ends=front_ends, engines=engines)
        if engines > 1:
            r["name"] += f", {engines} engines"
    return rows
