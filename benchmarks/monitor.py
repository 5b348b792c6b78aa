"""The monitor's cost (``enginewire bench --only monitor``, issue 48): a sync client through
the monitor against a sync client straight to its engine, in one run.

Two null-model engines, each with its own ``SyncMPClient`` in this process: one *direct*, one
whose engine connects to a monitor (``enginewire.testing.monitor.Monitor``) that connects to
the client's bound addresses. The monitor runs in a spawned process of its own, as
``enginewire monitor`` runs beside a deployment: in this process its relay and judging
threads would share the client's GIL, a cost no deployment pays.

*Round trip*: the echo utility call (16 bytes) direct, through the monitor, and the raw pyzmq
echo (``floor.py``), in blocks whose order rotates, so a noisy neighbour hits all three alike.
Rows: through the monitor / direct (issue 48's bar: at most 1.5x at p50) and direct / raw.

*Delivery*, at each K: the delivery row's gated round (``ipc.py``: K requests of 512-token
prompts x 64 tokens, the engine paused with ``keep`` while the adds land) direct, through the
monitor, and the floor pipeline, rotating. Rows: through the monitor / direct (the bar: at
least 0.7x, the median of the per-round ratios) and direct / floor. Every round's tokens are
kept (``tokens`` in the rows), so a reader sees both paths delivered all of them.

The monitor's own verdict on the traffic (violations, frames judged, internal errors) is on
every row: a clean run through it is a clean run for its judge too. Every wait is bounded;
the clients, engines and the monitor's process are stopped however the run ends.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from ._child import Child, child_side
from .floor import FloorPeer, freeze_heap
from .ipc import (
    ECHO_PAYLOAD,
    MAX_TOKENS,
    echo_rows,
    floor_round,
    make_row,
    null_config,
    ours_round,
    peers,
    percentile,
    random_prompts,
)

__all__ = ["bench_monitor"]

_START_S = 120.0  # the monitor's process: spawn, import, bind, connect (2 loaded cores)
_STOP_S = 30.0  # its stop: the judge catches up with what is queued, then the report


class MonitorProcessError(RuntimeError):
    """The monitor's process failed; its error, as it saw it."""


def _monitor_main(conn: Connection, front: tuple[str, str], engine: tuple[str, str]) -> None:
    """The monitor's process: relay between ``front`` (bound by the client) and ``engine``
    (bound here), judge, and on ``stop`` (or when the bench is gone) send back its verdict."""
    from ..testing.monitor import Monitor

    mon: Any = None
    with child_side(conn, "the monitor's process"):
        try:
            mon = Monitor(engine=engine, live=None).start()
            mon.attach(*front)
            conn.send(("ready", None))
            # Any message, or the bench's end of the pipe closing, stops it; the bench sends
            # ``stop`` once its client has shut down.
            with contextlib.suppress(EOFError):
                conn.recv()
            report = mon.stop()
            violations = [f"{v['machine']}: {v['event']} in {v['state']}: {v['detail']}"
                          for v in report["violations"]]
            conn.send(("report", {"violations": violations, "frames": report["frames"],
                                  "internal_errors": report.get("internal_errors", [])}))
        finally:
            if mon is not None:
                mon.stop()


class _MonitorProcess(Child):
    """The monitor's process and its pipe; ``stop()`` leaves its verdict in ``verdict``."""

    def __init__(self, front: tuple[str, str], engine: tuple[str, str]) -> None:
        super().__init__(multiprocessing.get_context("spawn"), _monitor_main, (front, engine),
                         name="bench-monitor", label="the monitor's process",
                         error=MonitorProcessError)
        self.verdict: dict[str, Any] | None = None

    def stop(self) -> None:
        """Its verdict (when it still answers); the process reaped."""
        self.verdict = self.finish("stop", "report", (OSError, ValueError, TimeoutError,
                                                      MonitorProcessError), _STOP_S)


@contextlib.contextmanager
def _clients(k_max: int) -> Iterator[tuple[Any, Any, _MonitorProcess]]:
    """A direct client and a client through the monitor's process, each with its engine;
    all stopped on exit (each client before the monitor, so the monitor sees it go)."""
    from ..runtime.factory import make_client

    config = null_config(k_max)
    with contextlib.ExitStack() as stack:
        where = stack.enter_context(tempfile.TemporaryDirectory(prefix="ew-bench-mon-"))
        front = (f"ipc://{where}/front-in", f"ipc://{where}/front-out")
        engine = (f"ipc://{where}/engine-in", f"ipc://{where}/engine-out")
        mon = _MonitorProcess(front, engine)
        stack.callback(mon.stop)
        mon.reply("ready", _START_S)
        through: Any = make_client(config, multiprocess=True, asyncio=False,
                                   input_address=front[0], output_address=front[1],
                                   engine_connect=engine)
        stack.callback(through.shutdown)
        direct: Any = make_client(config, multiprocess=True, asyncio=False)
        stack.callback(direct.shutdown)
        for client in (direct, through):
            got = client.call_utility("echo", ECHO_PAYLOAD, timeout=_START_S)
            if got != ECHO_PAYLOAD:  # a relay that changed a frame: no figure means anything
                raise MonitorProcessError(f"the echo came back as {got!r}")
        freeze_heap()  # after start-up, as the other sections' clients are measured
        yield direct, through, mon


def _echo(direct: Any, through: Any, raw: FloorPeer, n: int, block: int
          ) -> list[dict[str, Any]]:
    pc = time.perf_counter
    payload = ECHO_PAYLOAD

    def timed(call: Callable[[], object], out: list[list[float]]) -> None:
        xs = []
        for _ in range(block):
            t0 = pc()
            call()
            xs.append((pc() - t0) * 1e6)
        out.append(xs)

    calls: list[Callable[[], object]] = [lambda: direct.call_utility("echo", payload),
                                         lambda: through.call_utility("echo", payload),
                                         lambda: raw.echo(payload)]
    samples: list[list[list[float]]] = [[], [], []]
    for call in calls:
        timed(call, [])  # a warm-up block each
    for i in range(max(1, n // block)):
        for j in range(3):  # who goes first rotates
            which = (i + j) % 3
            timed(calls[which], samples[which])
    d, m, f = samples
    rows = echo_rows("sync through the monitor", m, {"direct": d}, None, section="monitor")
    rows[0]["key"] = "monitor_echo_p50"
    for row, q in zip(rows, (0.5, 0.99), strict=True):
        # What the monitor adds to each message's round trip, in µs, over all samples.
        row["added_us"] = percentile([x for b in m for x in b], q) - percentile(
            [x for b in d for x in b], q)
    return rows + echo_rows("sync direct", d, {"raw": f}, None, section="monitor")


def _delivery(direct: Any, through: Any, pipe: FloorPeer, k: int, reps: int
              ) -> list[dict[str, Any]]:
    prompts = random_prompts(k, k)
    rounds: list[Callable[[str], dict[str, float]]] = [
        lambda tag: ours_round(direct, k, prompts, tag),
        lambda tag: ours_round(through, k, prompts, tag),
        lambda tag: floor_round(pipe, k, prompts, tag),
    ]
    got: list[list[dict[str, float]]] = [[], [], []]
    for i in range(-1, reps):  # -1: a warm-up of each, not kept
        for j in range(3):  # who goes first rotates
            which = (i + j) % 3
            r = rounds[which](f"m{which}-{k}-{i}")
            if i >= 0:
                got[which].append(r)
        gc.collect()  # between rounds, never inside a window
    d, m, f = ([x["tok_s"] for x in xs] for xs in got)
    tokens = {"direct": [int(x["tokens"]) for x in got[0]],
              "monitor": [int(x["tokens"]) for x in got[1]]}
    return [
        make_row("monitor", f"sync tokens/s K={k} through the monitor / direct", "tok/s", m, d,
                 statistics.median(a / b for a, b in zip(m, d, strict=True)),
                 key=f"monitor_delivery_{k}", reps=reps, tokens=tokens,
                 tokens_expected=k * (MAX_TOKENS - 1)),
        make_row("monitor", f"sync direct tokens/s K={k} / floor", "tok/s", d, f,
                 statistics.median(a / b for a, b in zip(d, f, strict=True)), reps=reps),
    ]


def bench_monitor(*, ks: tuple[int, ...] = (256, 1024), reps: int = 3,
                  echo: tuple[int, int] = (2000, 250)) -> list[dict[str, Any]]:
    """The section's rows: the echo round trip (``echo=(calls, block)`` per contender)
    through the monitor / direct and direct / raw, p50 and p99; then per K in ``ks``
    delivery tokens/s through the monitor / direct and direct / the floor pipeline, over
    ``reps`` rounds. The monitor's verdict on its traffic is on every row (``monitor``)."""
    for name, v in (("reps", reps), ("echo calls", echo[0]), ("echo block", echo[1])):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: the monitor section needs a count >= 1")
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks={ks!r}: the monitor section needs request counts >= 1")
    rows: list[dict[str, Any]] = []
    with peers("raw_echo", "pipeline") as floor:
        with _clients(max(ks)) as (direct, through, mon):
            rows += _echo(direct, through, floor["raw_echo"], *echo)
            for k in ks:
                rows += _delivery(direct, through, floor["pipeline"], k, reps)
        # Out of the ``with``: the clients are gone and the monitor has judged everything.
        verdict = mon.verdict
    if verdict is None:
        raise MonitorProcessError("the monitor's process gave no verdict when stopped")
    for r in rows:
        r["monitor"] = verdict
    return rows
