"""Our IPC measurements, each taken next to its floor (``floor.py``) in the same run.

Every function here returns rows (plain dicts) that ``run.py`` turns into the ratio table:

* ``echo``: a no-op utility call (``echo`` of 16 bytes) through SyncMPClient and
  AsyncMPClient, against the raw ROUTER/DEALER + PUSH/PULL echo and the threaded pipeline
  echo. Contenders alternate in blocks, so a noisy neighbour hits both alike.
* ``delivery``: K requests (512-token prompts) x 64 tokens with the ``null`` model, gated the
  way perf-floor §3.1 gates the floor: the engine is paused (``keep``) while the K adds land,
  then resumed. Tokens/s counts the 63 decode steps at batch K after the prefill step, which
  leaves admission out on both sides. The window opens at the engine's stamp on the first
  (prefill) batch and closes when the caller has the last one (both ``time.monotonic``, one
  clock across processes), as perf-floor §3.1 times from an engine-side event: a window
  opened by the caller's receipt of the first batch shrinks whenever the caller is late to
  it (batches pile up, then drain at once), which once gave the floor 3.7 M tok/s, more
  than its engine can build.
* ``compute``: the same with a fixed 5 ms step; the non-compute share is
  ``1 - 63 * sleep / window`` with ``sleep`` the median of ``time.sleep(0.005)`` measured here,
  the same formula for the floor.
* ``spec``: cost of one request-lifecycle transition (the generated tables behind
  ``Lifecycle.fire``) against a bare nested-dict lookup, and its share of a step at batch 256
  (the client fires one transition per output per step; decode steps fire none engine-side).
* ``inproc``: InprocClient tokens/s against driving ``EngineCore`` directly.
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, cast

from ..protocol.messages import EngineCoreRequest, SamplingParams
from ..runtime.config import EngineConfig
from .floor import FloorPeer, FloorRequest, FloorSampling, freeze_heap

__all__ = [
    "ECHO_PAYLOAD",
    "MAX_TOKENS",
    "PROMPT_LEN",
    "bench_async",
    "bench_compute",
    "bench_delivery",
    "bench_echo",
    "bench_inproc",
    "bench_spec",
    "echo_rows",
    "floor_round",
    "make_row",
    "null_config",
    "our_requests",
    "peers",
    "percentile",
    "random_prompts",
]

PROMPT_LEN = 512
MAX_TOKENS = 64
ECHO_PAYLOAD = b"x" * 16
STEP_DELAY_S = 0.005
_VOCAB_LO, _VOCAB_HI = 3, 512  # the null model's tiny vocabulary; same ids on both sides
_TIMEOUT_S = 60.0


def null_config(k_max: int, delay_s: float = 0.0) -> EngineConfig:
    """Room for ``k_max`` requests at full length, all prefilled in one step."""
    max_len = PROMPT_LEN + MAX_TOKENS + 64
    return EngineConfig(
        model="null",
        device="cpu",
        max_num_seqs=k_max,
        max_num_batched_tokens=k_max * (PROMPT_LEN + 1),
        max_model_len=max_len,
        num_gpu_blocks_override=k_max * -(-max_len // 16),
        null_step_delay_s=delay_s,
    )


def make_row(
    section: str,
    name: str,
    unit: str,
    ours: list[float],
    floor: list[float] | None,
    ratio: float | None,
    **extra: Any,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "section": section,
        "name": name,
        "unit": unit,
        "ours": statistics.median(ours),
        "ours_spread": [min(ours), max(ours)],
        "floor": statistics.median(floor) if floor else None,
        "floor_spread": [min(floor), max(floor)] if floor else None,
        "ratio": ratio,
    }
    row.update(extra)
    return row


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# --- peers -----------------------------------------------------------------------------------


@contextmanager
def peers(*kinds: str) -> Iterator[dict[str, FloorPeer]]:
    """Start the named floor peers; close them all on exit."""
    started: dict[str, FloorPeer] = {}
    try:
        for kind in kinds:
            started[kind] = FloorPeer(kind)
        yield started
    finally:
        for p in started.values():
            p.close()


# --- echo ------------------------------------------------------------------------------------


def _time_calls(call: Callable[[], object], n: int, out: list[float]) -> None:
    pc = time.perf_counter
    for _ in range(n):
        t0 = pc()
        call()
        out.append((pc() - t0) * 1e6)


def echo_rows(
    label: str, ours: list[list[float]], floors: dict[str, list[list[float]]],
    bar_key: str | None, section: str = "echo",
) -> list[dict[str, Any]]:
    """p50/p99 over all samples; the spread is the range of per-block p50s. ``bar_key`` keys
    the p50 row against the raw floor."""
    rows = []
    flat_ours = [x for b in ours for x in b]
    for fname, blocks in floors.items():
        flat_floor = [x for b in blocks for x in b]
        for q, tag in ((0.5, "p50"), (0.99, "p99")):
            o, f = percentile(flat_ours, q), percentile(flat_floor, q)
            row = make_row(
                section,
                f"{label} echo RTT {tag} / {fname}",
                "µs",
                [percentile(b, q) for b in ours],
                [percentile(b, q) for b in blocks],
                o / f,
                calls=len(flat_ours),
            )
            row["ours"], row["floor"] = o, f  # over all samples, not the median of blocks
            if tag == "p50" and fname == "raw" and bar_key is not None:
                row["key"] = bar_key
            rows.append(row)
    return rows


def bench_echo(
    sync_client: Any, floor: dict[str, FloorPeer], n: int, block: int, warmup: int = 500
) -> list[dict[str, Any]]:
    """SyncMPClient.echo round trips, alternating blocks with each floor peer."""
    payload = ECHO_PAYLOAD

    def ours() -> object:
        return sync_client.call_utility("echo", payload)

    contenders: dict[str, Callable[[], object]] = {"ours": ours}
    if "raw_echo" in floor:
        contenders["raw"] = lambda: floor["raw_echo"].echo(payload)
    if "pipeline" in floor:
        contenders["threaded"] = lambda: floor["pipeline"].echo(payload)
    for call in contenders.values():
        _time_calls(call, warmup, [])
    samples: dict[str, list[list[float]]] = {k: [] for k in contenders}
    for i in range(max(1, n // block)):
        order = list(contenders.items())
        if i % 2:
            order.reverse()
        for name, call in order:
            buf: list[float] = []
            _time_calls(call, block, buf)
            samples[name].append(buf)
    ours_s = samples.pop("ours")
    return echo_rows("sync", ours_s, samples, "echo_sync_p50")


async def _raw_asyncio_block(peer: FloorPeer, payload: bytes, k: int, out: list[float]) -> None:
    """The least an asyncio caller pays for a round trip: the raw echo peer's replies read by
    a loop callback on the socket's FD that resolves a future (no protocol, no registry).
    What the async client can at best reach; the task's wake-up after the callback (a loop
    iteration more) is asyncio's, not the wire's."""
    import zmq

    loop = asyncio.get_running_loop()
    sock = peer.pull
    fd = cast(int, sock.get(zmq.FD))
    waiter: list[asyncio.Future[bytes] | None] = [None]

    def on_readable() -> None:
        while True:  # edge-triggered: read until empty, which re-arms the FD
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            fut, waiter[0] = waiter[0], None
            if fut is not None:
                fut.set_result(msg)

    loop.add_reader(fd, on_readable)
    on_readable()  # re-arm the FD: a synchronous recv last left it without an edge to come
    try:
        pc = time.perf_counter
        for _ in range(k):
            t0 = pc()
            fut = waiter[0] = loop.create_future()
            peer.router.send_multipart([peer.ident, payload])
            await fut
            out.append((pc() - t0) * 1e6)
    finally:
        loop.remove_reader(fd)


async def _async_all(
    config: EngineConfig,
    raw: FloorPeer | None,
    pipe: FloorPeer | None,
    echo: tuple[int, int, int] | None,
    ks: tuple[int, ...],
    reps: int,
) -> list[dict[str, Any]]:
    """One AsyncMPClient (it binds to the loop it first runs on) for echo and delivery."""
    from ..runtime.factory import make_client

    client: Any = make_client(config, multiprocess=True, asyncio=True)
    rows: list[dict[str, Any]] = []
    try:
        payload = ECHO_PAYLOAD
        pc = time.perf_counter
        await client.call_utility_async("echo", payload)  # binds the reader to this loop
        freeze_heap()

        async def ours_block(k: int, out: list[float]) -> None:
            for _ in range(k):
                t0 = pc()
                await client.call_utility_async("echo", payload)
                out.append((pc() - t0) * 1e6)

        if echo is not None and raw is not None:
            n, block, warmup = echo
            await ours_block(warmup, [])
            _time_calls(lambda: raw.echo(payload), warmup, [])
            await _raw_asyncio_block(raw, payload, warmup, [])
            ours: list[list[float]] = []
            floor: list[list[float]] = []
            afloor: list[list[float]] = []
            for i in range(max(1, n // block)):
                a: list[float] = []
                b: list[float] = []
                c: list[float] = []
                if i % 2:
                    _time_calls(lambda: raw.echo(payload), block, b)
                    await _raw_asyncio_block(raw, payload, block, c)
                    await ours_block(block, a)
                else:
                    await ours_block(block, a)
                    await _raw_asyncio_block(raw, payload, block, c)
                    _time_calls(lambda: raw.echo(payload), block, b)
                ours.append(a)
                floor.append(b)
                afloor.append(c)
            rows += echo_rows("async", ours, {"raw": floor, "raw asyncio": afloor},
                               "echo_async_p50")
        if pipe is not None:
            for k in ks:
                prompts = random_prompts(k, k)
                await ours_round_async(client, k, prompts, f"aw{k}")
                floor_round(pipe, k, prompts, f"aw{k}")
                o, f = [], []
                for i in range(reps):
                    o.append(await ours_round_async(client, k, prompts, f"a{k}-{i}"))
                    f.append(floor_round(pipe, k, prompts, f"a{k}-{i}"))
                    gc.collect()
                ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(o, f, strict=True)]
                rows.append(
                    make_row(
                        "delivery",
                        f"async tokens/s K={k} / floor",
                        "tok/s",
                        [x["tok_s"] for x in o],
                        [x["tok_s"] for x in f],
                        statistics.median(ratios),
                        key=f"delivery_async_{k}",
                        reps=reps,
                    )
                )
        return rows
    finally:
        await client.shutdown_async()


def bench_async(
    config: EngineConfig,
    raw: FloorPeer | None,
    pipe: FloorPeer | None,
    echo: tuple[int, int, int] | None,
    ks: tuple[int, ...] = (),
    reps: int = 0,
) -> list[dict[str, Any]]:
    """AsyncMPClient: echo round trips against the raw echo (``echo=(n, block, warmup)``),
    and, with ``pipe``, tokens/s against the same sync-client floor pipeline (informative)."""
    return asyncio.run(_async_all(config, raw, pipe, echo, ks, reps))


# --- token delivery --------------------------------------------------------------------------


def random_prompts(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(_VOCAB_LO, _VOCAB_HI) for _ in range(PROMPT_LEN)] for _ in range(k)]


class _Round:
    """What the caller of ``get_output`` sees: first batch, last batch, tokens in between."""

    __slots__ = ("done", "first", "last", "steps", "tokens")

    def __init__(self) -> None:
        self.first = 0.0
        self.last = 0.0
        self.tokens = 0
        self.done = 0
        self.steps = 0

    def take(self, outputs: list[Any], stamp: float, columns: int = 0) -> None:
        """One batch at the caller; ``stamp`` is the engine's ``time.monotonic()`` on it.
        ``columns``: its tokens still in the stream columns (a ``columnar_outputs`` client's
        batch), counted as they are; the outputs are walked."""
        # The same per-request walk on both sides, as any real caller does per batch.
        if not (outputs or columns):
            return
        now = time.monotonic()
        if not self.steps:
            self.first = stamp
        else:
            n = columns
            for o in outputs:
                n += len(o.new_token_ids)
                if o.finish_reason is not None:
                    self.done += 1
            self.tokens += n
        self.steps += 1
        self.last = now

    def result(self) -> dict[str, float]:
        window = self.last - self.first
        return {
            "tok_s": self.tokens / window,
            "window_s": window,
            "step_us": window / max(1, self.steps - 1) * 1e6,
            "steps": self.steps - 1,
            "tokens": self.tokens,
        }


def floor_round(
    peer: FloorPeer, k: int, prompts: list[list[int]], tag: str, delay_s: float = 0.0
) -> dict[str, float]:
    sp = [FloorSampling(max_tokens=MAX_TOKENS, ignore_eos=True, seed=i) for i in range(k)]
    for i in range(k):
        peer.add(FloorRequest(f"{tag}-{i}", prompts[i], sp[i], time.time()))
    peer.go(delay_s)
    r = _Round()
    while r.done < k:
        batch = peer.get_output()
        r.take(batch.outputs, batch.timestamp)
    return r.result()


def our_requests(k: int, prompts: list[list[int]], tag: str) -> list[EngineCoreRequest]:
    return [EngineCoreRequest(f"{tag}-{i}", prompts[i],
                              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=i),
                              time.time()) for i in range(k)]  # fmt: skip


def ours_round(client: Any, k: int, prompts: list[list[int]], tag: str) -> dict[str, float]:
    """Gate with pause(keep)/resume so all K are live before the first step (perf-floor
    §3.1's GO). ``call_utility`` directly: the wrappers' extra ``is_sleeping`` round trip
    would land inside the window. A client built with ``columnar_outputs`` is read by its
    columns (``_Round.take``'s ``columns``)."""
    client.call_utility("pause_scheduler", "keep", timeout=_TIMEOUT_S)
    for req in our_requests(k, prompts, tag):
        client.add_request(req)
    client.call_utility("resume_scheduler", timeout=_TIMEOUT_S)
    r = _Round()
    deadline = time.monotonic() + _TIMEOUT_S
    while r.done < k:
        batch = client.get_output(timeout=1.0)
        r.take(batch.outputs, batch.timestamp, len(batch.stream_tokens))
        if time.monotonic() > deadline:
            raise TimeoutError(f"delivery round {tag}: {r.done}/{k} finished")
    return r.result()


async def ours_round_async(
    client: Any, k: int, prompts: list[list[int]], tag: str
) -> dict[str, float]:
    await client.call_utility_async("pause_scheduler", "keep", timeout=_TIMEOUT_S)
    for req in our_requests(k, prompts, tag):
        await client.add_request_async(req)
    await client.call_utility_async("resume_scheduler", timeout=_TIMEOUT_S)
    r = _Round()
    deadline = time.monotonic() + _TIMEOUT_S
    while r.done < k:
        batch = await client.get_output_async(timeout=1.0)
        r.take(batch.outputs, batch.timestamp)
        if time.monotonic() > deadline:
            raise TimeoutError(f"async delivery round {tag}: {r.done}/{k} finished")
    return r.result()


def _ours_at(client: Any, k: int, prompts: list[list[int]], tag: str, i: int) -> dict[str, float]:
    return ours_round(client, k, prompts, f"{tag}{k}-{i}")


def _floor_at(
    peer: FloorPeer, k: int, prompts: list[list[int]], tag: str, delay_s: float, i: int
) -> dict[str, float]:
    return floor_round(peer, k, prompts, f"{tag}{k}-{i}", delay_s)


def _alternate(
    ours: Callable[[int], dict[str, float]], floor: Callable[[int], dict[str, float]], reps: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """One warm-up each, then reps alternating who goes first."""
    ours(-1)
    floor(-1)
    o, f = [], []
    for i in range(reps):
        if i % 2:
            f.append(floor(i))
            o.append(ours(i))
        else:
            o.append(ours(i))
            f.append(floor(i))
        gc.collect()  # between rounds, never inside a window
    return o, f


def bench_delivery(
    client: Any, peer: FloorPeer, ks: tuple[int, ...], reps: int, label: str = "sync"
) -> list[dict[str, Any]]:
    """Tokens/s at the caller, ours vs the floor pipeline, no compute."""
    rows = []
    for k in ks:
        prompts = random_prompts(k, k)
        o, f = _alternate(
            partial(_ours_at, client, k, prompts, "d"),
            partial(_floor_at, peer, k, prompts, "d", 0.0),
            reps,
        )
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(o, f, strict=True)]
        rows.append(
            make_row(
                "delivery",
                f"{label} tokens/s K={k} / floor",
                "tok/s",
                [x["tok_s"] for x in o],
                [x["tok_s"] for x in f],
                statistics.median(ratios),
                key=f"delivery_{label}_{k}",
                ours_step_us=statistics.median(x["step_us"] for x in o),
                floor_step_us=statistics.median(x["step_us"] for x in f),
                reps=reps,
            )
        )
    return rows


def measure_sleep(delay_s: float, n: int = 30) -> float:
    """Median real duration of ``time.sleep(delay_s)`` here (the VM overshoots it)."""
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        time.sleep(delay_s)
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def bench_compute(
    client: Any, peer: FloorPeer, ks: tuple[int, ...], reps: int, delay_s: float = STEP_DELAY_S
) -> list[dict[str, Any]]:
    """Non-compute share of the window with a fixed ``delay_s`` step, ours vs floor."""
    slept = measure_sleep(delay_s)
    rows = []
    for k in ks:
        prompts = random_prompts(k, k)
        o, f = _alternate(
            partial(_ours_at, client, k, prompts, "c"),
            partial(_floor_at, peer, k, prompts, "c", delay_s),
            reps,
        )

        def share(x: dict[str, float]) -> float:
            return max(0.0, 1.0 - x["steps"] * slept / x["window_s"]) * 100

        os_, fs = [share(x) for x in o], [share(x) for x in f]
        rows.append(
            make_row(
                "compute",
                f"non-compute share, 5 ms step, K={k}",
                "%",
                os_,
                fs,
                statistics.median(os_) / max(statistics.median(fs), 1e-9),
                key=f"compute_share_{k}",
                judge="value",
                sleep_us=slept * 1e6,
                ours_tok_s=statistics.median(x["tok_s"] for x in o),
                floor_tok_s=statistics.median(x["tok_s"] for x in f),
                reps=reps,
            )
        )
    return rows


# --- spec enforcement ------------------------------------------------------------------------


def bench_spec(step_us_at_256: float | None, quick: bool) -> list[dict[str, Any]]:
    """µs per ``Lifecycle.fire`` (STREAMING --OUTPUT--> STREAMING, the per-token transition)
    against ``state = table[state][event]`` on plain ints, in alternating bursts."""
    from ..spec.request import CLIENT_REQUEST, ClientRequestEvent, ClientRequestState

    lc = CLIENT_REQUEST.lifecycle()
    lc.fire(ClientRequestEvent.SEND)
    lc.fire(ClientRequestEvent.OUTPUT)
    ev = ClientRequestEvent.OUTPUT
    # The floor: the same lookup on a table of ints, no checks, no trace hook. (Enum keys
    # would be slower than the real thing: Enum.__hash__ is Python code.)
    states, events = list(ClientRequestState), list(ClientRequestEvent)
    table = [{events.index(e): i for e in events} for i in range(len(states))]
    st, ev_ix = states.index(ClientRequestState.STREAMING), events.index(ev)
    n, rounds = (2000, 15) if quick else (10000, 31)
    fire = lc.fire

    def ours() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fire(ev)
        return (time.perf_counter() - t0) / n * 1e6

    def floor() -> float:
        s = st
        t0 = time.perf_counter()
        for _ in range(n):
            s = table[s][ev_ix]
        return (time.perf_counter() - t0) / n * 1e6

    def full_life() -> float:
        # A whole request: SEND, 63 OUTPUTs, FINISH_LENGTH on a fresh lifecycle.
        lives = 50
        t0 = time.perf_counter()
        for _ in range(lives):
            life = CLIENT_REQUEST.lifecycle()
            life.fire(ClientRequestEvent.SEND)
            for _ in range(MAX_TOKENS - 1):
                life.fire(ev)
            life.fire(ClientRequestEvent.FINISH_LENGTH)
        return (time.perf_counter() - t0) / (lives * (MAX_TOKENS + 1)) * 1e6

    o, f, life_us = [], [], []
    for i in range(rounds):
        if i % 2:
            f.append(floor())
            o.append(ours())
        else:
            o.append(ours())
            f.append(floor())
        life_us.append(full_life())
    ratios = [a / b for a, b in zip(o, f, strict=True)]
    rows = [
        make_row(
            "spec",
            "spec transition (Lifecycle.fire)",
            "µs",
            o,
            f,
            statistics.median(ratios),
            key="spec_transition_us",
            judge="value",
        ),
        make_row("spec", "spec transition, whole request life", "µs", life_us, None, None),
    ]
    per = statistics.median(o)
    source = "IPC delivery K=256"
    if step_us_at_256 is None:
        step_us_at_256, source = _engine_step_us(256, quick), "EngineCore.step batch 256"
    share = 256 * per / step_us_at_256 * 100
    rows.append(
        make_row(
            "spec",
            "spec share of a step at batch 256",
            "%",
            [share],
            None,
            None,
            step_us=step_us_at_256,
            step_source=source,
            transitions_per_step=256,
        )
    )
    return rows


def _engine_step_us(k: int, quick: bool) -> float:
    from ..runtime.engine import EngineCore

    eng = EngineCore(null_config(k))
    try:
        for req in our_requests(k, random_prompts(k, 7), "s"):
            eng.add_request(req)
        eng.step()  # prefill
        xs = []
        for _ in range(20 if quick else 50):
            t0 = time.perf_counter()
            eng.step()
            xs.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(xs)
    finally:
        eng.shutdown()


# --- in-process ------------------------------------------------------------------------------


def bench_inproc(k: int, reps: int) -> list[dict[str, Any]]:
    """InprocClient.get_output loop vs EngineCore.step loop: tokens/s over all 64 steps."""
    from ..runtime.client import InprocClient
    from ..runtime.engine import EngineCore

    config = null_config(k)
    prompts = random_prompts(k, 11)
    client = InprocClient(config)
    eng = EngineCore(config)
    try:

        def via_client(i: int) -> float:
            for req in our_requests(k, prompts, f"i{i}"):
                client.add_request(req)
            done = tokens = 0
            t0 = time.perf_counter()
            while done < k:
                for o in client.get_output().outputs:
                    tokens += len(o.new_token_ids)
                    done += o.finish_reason is not None
            return tokens / (time.perf_counter() - t0)

        def direct(i: int) -> float:
            for req in our_requests(k, prompts, f"e{i}"):
                eng.add_request(req)
            done = tokens = 0
            t0 = time.perf_counter()
            while done < k:
                for o in eng.step().outputs:
                    tokens += len(o.new_token_ids)
                    done += o.finish_reason is not None
            return tokens / (time.perf_counter() - t0)

        via_client(-1)
        direct(-1)
        o, f = [], []
        for i in range(reps):
            if i % 2:
                f.append(direct(i))
                o.append(via_client(i))
            else:
                o.append(via_client(i))
                f.append(direct(i))
            gc.collect()
        ratios = [a / b for a, b in zip(o, f, strict=True)]
        return [
            make_row(
                "inproc",
                f"InprocClient tokens/s K={k} / EngineCore",
                "tok/s",
                o,
                f,
                statistics.median(ratios),
                key="inproc_ratio",
            )
        ]
    finally:
        client.shutdown()
        eng.shutdown()
