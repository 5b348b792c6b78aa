"""Raw floors: what pyzmq and msgspec alone cost on this machine, run beside our clients.

Two peers, each a spawned subprocess (perf-floor.md §1 and §3 give the shapes and figures):

* ``raw_echo``: one thread, a DEALER that receives and a PUSH that sends the same bytes back.
  The client side is a ROUTER plus a PULL, the shape our clients use, so one round trip is
  the least any utility call can cost here.
* ``pipeline``: vLLM's ``EngineCoreProc`` shape with no engine. An input thread decodes into
  a ``queue.Queue``; the main loop, once told GO, emits one token per live request per step
  (optionally sleeping first, standing in for the GPU) and drops requests at 64 tokens; an
  output thread encodes and sends. It also answers ECHO through the queues, which is the
  threaded round-trip floor that our engine's architecture can at best reach.

Conditions are those perf-floor.md §3.3 says move the figures: live requests keep their
prompts, ``gc.collect(); gc.freeze()`` after start-up (the client calls ``freeze_heap`` in its
own process), ipc transport, and the caller warms up first.

Messages are hand-written ``array_like``/``gc=False`` Structs; a frame's first byte says what
it is: ``A`` add, ``G`` go (payload: msgpack step delay in seconds), ``E`` echo, ``Q`` quit.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import threading
import time
from typing import Any

import msgspec
import zmq

__all__ = [
    "FloorOutput",
    "FloorOutputs",
    "FloorPeer",
    "FloorRequest",
    "FloorSampling",
    "freeze_heap",
]

ADD, GO, ECHO, QUIT = b"A", b"G", b"E", b"Q"
_READY_TIMEOUT_MS = 60_000
FLOOR_DIR_PREFIX = "ewfloor-"


class FloorSampling(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class FloorRequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: FloorSampling = FloorSampling()
    arrival_time: float = 0.0
    priority: int = 0


class FloorOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class FloorOutputs(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[FloorOutput] = []
    timestamp: float = 0.0
    finished_requests: list[str] | None = None


def freeze_heap() -> None:
    """Move everything alive now out of the collector's sight, as vLLM does after start-up."""
    gc.collect()
    gc.freeze()


# --- peer processes --------------------------------------------------------------------------


def _exit_with_parent() -> None:
    """A killed bench sends no QUIT, and a peer blocked in recv would live on for good: exit
    once the parent's sentinel pipe closes. The thread sleeps in the kernel until then, so it
    costs the measured round trips nothing."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="FloorParentWatch", daemon=True).start()


def _raw_echo_main(in_addr: str, out_addr: str) -> None:
    _exit_with_parent()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"\x00\x00")
    push = ctx.socket(zmq.PUSH)
    dealer.connect(in_addr)
    push.connect(out_addr)
    dealer.send(b"")  # lets the ROUTER learn our identity
    freeze_heap()
    while True:
        msg = dealer.recv()
        if msg == QUIT:
            break
        push.send(msg)
    dealer.close(linger=0)
    push.close(linger=1000)
    ctx.term()


class _Live:
    """Engine-side request: retains its token list, as a real engine does (perf-floor §3.3)."""

    __slots__ = ("max_tokens", "n", "request_id", "seed", "tokens")

    def __init__(self, req: FloorRequest) -> None:
        self.request_id = req.request_id
        self.tokens = list(req.prompt_token_ids)
        self.max_tokens = req.sampling_params.max_tokens
        self.seed = req.sampling_params.seed or 0
        self.n = 0


def _pipeline_main(in_addr: str, out_addr: str) -> None:
    _exit_with_parent()
    ctx = zmq.Context()
    inq: queue.Queue[tuple[bytes, Any]] = queue.Queue()
    outq: queue.Queue[Any] = queue.Queue()
    ready = threading.Event()

    def input_thread() -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"\x00\x00")
        dealer.connect(in_addr)
        dealer.send(b"")
        ready.set()
        dec = msgspec.msgpack.Decoder(FloorRequest)
        while True:
            frames = dealer.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == ADD:
                inq.put((kind, dec.decode(frames[1].buffer)))
            elif kind == QUIT:
                inq.put((kind, None))
                break
            else:
                inq.put((kind, frames[1].bytes))
        dealer.close(linger=0)

    def output_thread() -> None:
        push = ctx.socket(zmq.PUSH)
        push.connect(out_addr)
        enc = msgspec.msgpack.Encoder()
        while True:
            item = outq.get()
            if item is None:
                break
            if isinstance(item, bytes):
                push.send(item)
            else:
                push.send(enc.encode(item), copy=False)
        push.close(linger=1000)

    threads = [threading.Thread(target=f, daemon=True) for f in (input_thread, output_thread)]
    for t in threads:
        t.start()
    ready.wait(10)
    freeze_heap()
    live: list[_Live] = []
    stepping, delay = False, 0.0
    span = 509
    while True:
        # Drain input; block only when there is nothing to step.
        try:
            item = inq.get_nowait() if stepping else inq.get()
        except queue.Empty:
            item = None
        quit_ = False
        while item is not None:
            kind, payload = item
            if kind == ADD:
                live.append(_Live(payload))
            elif kind == GO:
                stepping, delay = True, float(msgspec.msgpack.decode(payload))
            elif kind == ECHO:
                outq.put(payload)
            elif kind == QUIT:
                quit_ = True
                break
            try:
                item = inq.get_nowait()
            except queue.Empty:
                item = None
        if quit_:
            break
        if not (stepping and live):
            stepping = False
            continue
        if delay:
            time.sleep(delay)
        outs: list[FloorOutput] = []
        add = outs.append
        finished: list[str] | None = None
        for r in live:
            n = r.n + 1
            r.n = n
            tok = 3 + (r.seed * 1_000_003 + n * 7919) % span
            r.tokens.append(tok)
            if n >= r.max_tokens:
                add(FloorOutput(r.request_id, [tok], 1))
                if finished is None:
                    finished = []
                finished.append(r.request_id)
            else:
                add(FloorOutput(r.request_id, [tok]))
        if finished is not None:
            live = [r for r in live if r.n < r.max_tokens]
        outq.put(FloorOutputs(0, outs, time.monotonic(), finished))
    outq.put(None)
    for t in threads:
        t.join(5)
    ctx.term()


_MAINS = {"raw_echo": _raw_echo_main, "pipeline": _pipeline_main}


# --- client side -----------------------------------------------------------------------------


class FloorPeer:
    """Binds a ROUTER and a PULL on ipc paths, spawns the peer and waits for its hello."""

    def __init__(self, kind: str) -> None:
        # Here, not at the top: the spawned peer imports this module, and the runtime package
        # (torch and all) is no part of a floor.
        from ..runtime.ipc import owned_tempdir

        self.kind = kind
        # Owned by this process: a bench killed outright leaves it, and the next floor peer to
        # start removes it.
        self._dir = str(owned_tempdir(FLOOR_DIR_PREFIX))
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        # As our clients do: a full ROUTER drops silently, and a dropped ADD or GO hangs a round.
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.router.bind(in_addr)
        self.pull.bind(out_addr)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_MAINS[kind], args=(in_addr, out_addr), daemon=True,
            name=f"enginewire-floor-{kind}")  # fmt: skip
        self.proc.start()
        if not self.router.poll(_READY_TIMEOUT_MS):
            self.close()
            raise RuntimeError(f"floor peer {kind!r} did not start")
        self.ident = self.router.recv_multipart()[0]
        self.out_dec = msgspec.msgpack.Decoder(FloorOutputs)
        self.enc = msgspec.msgpack.Encoder()

    def echo(self, payload: bytes) -> bytes:
        """One round trip; the raw peer takes the bare payload, the pipeline a typed frame."""
        if self.kind == "raw_echo":
            self.router.send_multipart([self.ident, payload])
        else:
            self.router.send_multipart([self.ident, ECHO, payload])
        return self.pull.recv()

    def add(self, req: FloorRequest) -> None:
        self.router.send_multipart([self.ident, ADD, self.enc.encode(req)])

    def go(self, delay_s: float = 0.0) -> None:
        self.router.send_multipart([self.ident, GO, self.enc.encode(delay_s)])

    def get_output(self) -> FloorOutputs:
        frame = self.pull.recv(copy=False)
        out: FloorOutputs = self.out_dec.decode(frame.buffer)
        return out

    def close(self) -> None:
        ident = getattr(self, "ident", None)
        if self.proc.is_alive():
            if ident is not None:
                try:
                    self.router.send_multipart([ident, QUIT], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self.proc.join(5)
            if self.proc.is_alive():  # never said hello, or did not stop: nothing to flush
                self.proc.kill()
                self.proc.join(5)
        self.router.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> FloorPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
