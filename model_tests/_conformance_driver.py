"""The conformance suite's driver: one blocking call surface over every client, and helpers.

``ClientUnderTest`` gives the sync, async and in-process clients one blocking surface (an
async client runs on a private loop thread), ``open_client`` builds a built-in one, and the
helpers (``request``, ``collect``, ``check_trace``, bounded waits, process checks) are what
every scenario uses. The scenarios are in ``conformance.py`` (on a live client) and
``conformance_breaking.py`` (those that break the engine); ``conformance`` re-exports all of
this, and its docstring states the ``ClientFactory`` contract.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import os
import signal
import threading
import time
import unittest
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
)
from ..spec import (
    CLIENT,
    CLIENT_REQUEST,
    UTILITY,
    EngineDeadError,
    Machine,
    TraceEntry,
    validate_trace,
)
from ._harness import (
    LEAK_KINDS,
    RELEASE_BOUND_S,
    ResourceSnapshot,
    fd_targets,
    left_behind,
    wait_until,
)
from .bounds import CONFORMANCE_WAIT_S, DEATH_BOUND_S

CLIENT_KINDS = ("inproc", "sync", "async")
# The suite's name for its bound on ordinary waits (bounds.py says why it is the longer one).
WAIT_S = CONFORMANCE_WAIT_S
# Options of the ClientFactory contract that need an engine process.
_ENGINE_PROCESS_OPTIONS = ("engine_fault", "engine_startup_delay_s")


class NotApplicable(unittest.SkipTest):
    """The scenario cannot run on this client or config; the message says why.

    A ``unittest.SkipTest``, so pytest and unittest report it as a skip rather than a pass."""


# --- driver ----------------------------------------------------------------------------------


class LoopThread:
    """An event loop on a daemon thread, so async clients get a blocking facade."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="conformance-loop",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = WAIT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(drain(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class ClientUnderTest:
    """One blocking call surface over any client; ``kind`` is inproc, sync or async.

    Wrap your own client (a subclass of a built-in one, or any class with the same methods)
    as ``ClientUnderTest(client, kind, trace)``, ``trace`` being the list the client records
    into (``None``: ``check_trace`` cannot run). An ``async`` client gets an event loop on a
    thread of its own, which ``shutdown()`` closes; build the client before wrapping it.
    ``inject``, optional, is how the scenarios that play a misbehaving engine reach your
    client (``Injector``); without one they raise ``NotApplicable``.
    """

    client: Any
    kind: str
    trace: list[TraceEntry] | None = None
    loop: LoopThread | None = None
    closed: bool = field(default=False)
    inject: Injector | None = None

    def __post_init__(self) -> None:
        if self.kind not in CLIENT_KINDS:
            raise ValueError(f"ClientUnderTest.kind must be one of {CLIENT_KINDS},"
                             f" got {self.kind!r}")
        if self.kind == "async" and self.loop is None:
            # Its calls are coroutines: without a loop the driver would call the sync names,
            # which an async client does not have (an AttributeError in the first scenario).
            self.loop = LoopThread()

    @property
    def multiprocess(self) -> bool:
        return bool(getattr(self.client, "multiprocess", False))

    @property
    def engine_pid(self) -> int | None:
        return getattr(self.client, "engine_pid", None)

    def _call(self, name: str, *args: Any, _wait: float | None = WAIT_S, **kw: Any) -> Any:
        if self.loop is not None:
            return self.loop.run(getattr(self.client, f"{name}_async")(*args, **kw), _wait)
        return getattr(self.client, name)(*args, **kw)

    def submit(self, name: str, *args: Any, **kw: Any) -> concurrent.futures.Future[Any]:
        """Start a call without waiting for it (a thread, or a task on the loop); a read's
        batch comes expanded, as from ``get_output``."""
        if self.loop is not None:
            coro = getattr(self.client, f"{name}_async")(*args, **kw)
            return self.loop.submit(_expanded(coro) if name == "get_output" else coro)
        call = getattr(self.client, name)
        if name == "get_output":
            def call(*a: Any, _read: Any = call, **k: Any) -> Any:
                return _expanded_batch(_read(*a, **k))
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="conformance")
        fut = pool.submit(call, *args, **kw)
        pool.shutdown(wait=False)
        return fut

    def add_request(self, req: EngineCoreRequest) -> None:
        self._call("add_request", req)

    def abort_requests(self, ids: list[str]) -> None:
        self._call("abort_requests", ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        bound = None if timeout is None else timeout + WAIT_S
        out: EngineCoreOutputs = _expanded_batch(
            self._call("get_output", _wait=bound, timeout=timeout))
        return out

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self._call("call_utility", method, *args, timeout=timeout)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._call("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return bool(self._call("wake_up", tags))

    def is_sleeping(self) -> bool:
        return bool(self._call("is_sleeping"))

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.client.shutdown()
        finally:
            if self.loop is not None:
                self.loop.close()

    def __enter__(self) -> ClientUnderTest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _expanded_batch(out: Any) -> Any:
    """A client built with columnar_outputs leaves token-only outputs in the columns; the
    harness judges ``outputs``, so it reads every batch expanded (itself when it has no
    columns; a batch of a duck-typed client's own type as it is)."""
    expand = getattr(out, "expanded", None)
    return out if expand is None else expand()


async def _expanded(read: Any) -> Any:
    """An async client's read, its batch expanded (see ``_expanded_batch``)."""
    return _expanded_batch(await read)


class Injector(Protocol):
    """An optional capability of a client factory (trio's conformance suite takes optional
    makers the same way): a hand inside the client for the scenarios that play an engine
    which breaks the spec or a front end which sent garbage, so the suite itself never
    reaches into a client. A factory that builds clients with one sets it as
    ``ClientUnderTest.inject``; ``open_client`` does for the built-in clients."""

    def track_as_sent(self, request: EngineCoreRequest) -> None:
        """Count ``request`` as sent, without sending it: the client now expects outputs
        for it (``check_forbidden_output``), or the ERROR a malformed copy of it earns on
        the wire (``check_malformed_frames``)."""

    def deliver(self, batch: EngineCoreOutputs) -> None:
        """Queue ``batch`` untracked, where the client puts what its engine sent: the next
        ``get_output`` reads it, as an engine that breaks the spec would deliver it."""

    def reject(self, request_id: str, error: str) -> bool:
        """In-process, with no wire to send a malformed ADD on: have the engine reject one
        for ``request_id`` (``EngineCore.reject_request``), under the client's engine lock."""


def injector(cut: ClientUnderTest, what: str) -> Injector:
    """``cut.inject``, or ``NotApplicable`` saying that ``what`` needs one."""
    if cut.inject is None:
        raise NotApplicable(f"{what} needs an injector (ClientUnderTest.inject), which the"
                            f" factory of this {type(cut.client).__name__} does not offer")
    return cut.inject


@dataclass
class _BuiltinInjector:
    """The built-in clients' ``Injector``: the one place that knows where each keeps what
    its engine sent (``open_client`` gives it to every client it builds)."""

    client: Any
    loop: LoopThread | None = None

    def track_as_sent(self, request: EngineCoreRequest) -> None:
        self.client._track_add(request)

    def deliver(self, batch: EngineCoreOutputs) -> None:
        from ..runtime.async_mp_client import AsyncMPClient
        from ..runtime.client import InprocClient
        from ..runtime.sync_mp_client import SyncMPClient

        client = self.client
        if isinstance(client, InprocClient):
            with client._engine_lock:  # stepped batches waiting for get_output
                client._buffered.append(batch)
        elif isinstance(client, SyncMPClient):
            client._outputs.put(batch)
        elif isinstance(client, AsyncMPClient) and self.loop is not None:
            async def put() -> None:  # on the loop: an asyncio.Queue is not thread-safe
                client.bind_loop()
                assert client._outputs is not None
                client._outputs.put_nowait(batch)

            self.loop.run(put())
        else:
            raise NotApplicable(f"cannot inject outputs into a {type(client).__name__}")

    def reject(self, request_id: str, error: str) -> bool:
        with self.client._engine_lock:
            return bool(self.client.engine.reject_request(request_id, error))


ClientFactory = Callable[..., ClientUnderTest]
"""``factory(**options) -> ClientUnderTest``: a fresh client; it honours ``config=``,
``engine_startup_delay_s=`` and ``engine_fault=`` or raises ``NotApplicable`` (module
docstring)."""




# --- a factory's declared contract ---------------------------------------------------------


class Declared(enum.StrEnum):
    """Differences from enginewire's contract a ``ClientFactory`` may declare, as
    ``factory.contract`` (a mapping of name to why), that the harness itself follows. A
    factory of a client that is not enginewire's (``vllm_factory``) names what its client
    does differently instead of having its adapter hide it; the harness then judges by the
    declaration and says so (a cell not applicable, a leak excused), never silently. A
    factory may declare other names too: only its own adapter reads those."""

    # The client never declares a silent engine dead (it has no heartbeat deadline): it
    # refuses ``engine_heartbeat_timeout_s``; the fault matrix leaves the option out and
    # reports a cell only that deadline could end (a SIGSTOP after the handshake) as n/a.
    NO_HEARTBEAT_DEADLINE = "no_heartbeat_deadline"
    # Its wire has no integrity trailers: it refuses ``frame_integrity=True``; frame cells
    # run without them, and those whose fault only the trailers detect (loss, reorder,
    # duplication, bit flips) are n/a.
    NO_FRAME_INTEGRITY = "no_frame_integrity"
    # Its wire has no ATTACH and no attach marker: the lost-attach frame cells are n/a.
    NO_ATTACH_HANDSHAKE = "no_attach_handshake"
    # An engine that dies before its ready is seen only at the ready deadline (the client
    # watches no process while it attaches): start-up death cells get the hung-start-up
    # cells' ready deadline and bound.
    STARTUP_DEATH_AT_READY_DEADLINE = "startup_death_at_ready_deadline"
    # shutdown() leaves the client's libzmq context open (its io threads' eventfd and
    # eventpoll fds) until the client object is collected: leak checks excuse fds of
    # exactly those kinds (``ZMQ_CONTEXT_FDS``), nothing else.
    ZMQ_CONTEXT_OUTLIVES_SHUTDOWN = "zmq_context_outlives_shutdown"
    # Frames are vLLM 0.33's (reference §2.3-§2.5), not enginewire's: the interposer reads
    # their kinds by vLLM's layout.
    VLLM_WIRE = "vllm_wire"
    # One error for a dead and a shut-down client: after its own shutdown() a call may raise
    # EngineDeadError where ClientClosedError is owed (a call that returns is still a
    # failure), calls blocked at shutdown may end with it, and the campaign judges a shut-down
    # client's aborts and reads as a dead one's (an abort is a no-op, a read owes the error).
    CLOSED_IS_DEAD = "closed_is_dead"
    # The client does not refuse a live request id (the layer above it makes ids unique):
    # the campaign never sends one (its duplicate-id rule is off).
    NO_DUPLICATE_ID_CHECK = "no_duplicate_id_check"
    # get_output raises EngineDeadError once, then blocks: once a read got it, the campaign
    # expects no second one; it reads with a short bound instead and fails a read
    # that returns outputs after the death (stateful_base.py, READ_AFTER_DEATH_S).
    DEAD_DELIVERED_ONCE = "dead_delivered_once"


# What an open libzmq context holds: an eventpoll and a mailbox eventfd per io thread and
# for its reaper, and its own mailbox eventfd (no inode number in the link's name).
ZMQ_CONTEXT_FDS = frozenset({"anon_inode:[eventfd]", "anon_inode:[eventpoll]"})


def declared_contract(factory: Any) -> Mapping[str, str]:
    """``factory.contract`` (name -> why: ``Declared`` names and the factory's own), or an
    empty mapping for a factory that declares nothing (every built-in one)."""
    contract = getattr(factory, "contract", None)
    if contract is None:
        return {}
    if not isinstance(contract, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in contract.items()):
        raise TypeError(f"{factory!r}.contract must map names to why (str -> str),"
                        f" got {contract!r}")
    return contract


def declared_reason(contract: Mapping[str, str], name: Declared) -> str:
    """The sentence a result carries when the harness followed ``name``."""
    return f"declared by the factory ({name.value}): {contract[name.value]}"


def left_behind_as_declared(before: ResourceSnapshot, contract: Mapping[str, str], *,
                            bound: float = RELEASE_BOUND_S,
                            kinds: Collection[str] = LEAK_KINDS) -> dict[str, Any]:
    """``left_behind``, except what ``contract`` declares is left: with
    ``ZMQ_CONTEXT_OUTLIVES_SHUTDOWN``, new fds of the ``ZMQ_CONTEXT_FDS`` kinds only."""
    if Declared.ZMQ_CONTEXT_OUTLIVES_SHUTDOWN not in contract or "fds" not in kinds:
        return left_behind(before, bound=bound, kinds=kinds)
    leaks = left_behind(before, bound=bound, kinds=[k for k in kinds if k != "fds"])

    def names(targets: Counter[str]) -> Counter[str]:
        # A file unlinked since the snapshot is the same fd under a new name.
        return Counter(t.removesuffix(" (deleted)") for t in targets.elements())

    def only_context_fds() -> bool:
        new = names(fd_targets()) - names(before.fd_targets)
        return all(t in ZMQ_CONTEXT_FDS for t in new)

    if not wait_until(only_context_fds, bound, poll=0.05):
        import psutil

        leaks["fds"] = max(1, psutil.Process().num_fds() - before.fds)
    return leaks


def open_client(
    kind: str, config: Any, *, construct_in_loop: bool = False, **options: Any
) -> ClientUnderTest:
    """Build a built-in client of ``kind`` (inproc, sync, async) with ``trace`` recording."""
    from ..runtime.factory import make_client

    if kind not in CLIENT_KINDS:
        raise ValueError(f"kind must be one of {CLIENT_KINDS}, got {kind!r}")
    if kind == "inproc":
        unsupported = sorted(k for k in _ENGINE_PROCESS_OPTIONS if k in options)
        if unsupported:
            raise NotApplicable(f"the in-process client has no engine process: {unsupported}"
                                " cannot apply")
    trace: list[TraceEntry] = options.pop("trace", None)
    if trace is None:
        trace = []
    if kind == "async":
        loop = LoopThread()
        try:
            if construct_in_loop:
                async def build() -> Any:
                    return make_client(config, multiprocess=True, asyncio=True, trace=trace,
                                       **options)

                client = loop.run(build(), timeout=None)
            else:
                client = make_client(config, multiprocess=True, asyncio=True, trace=trace,
                                     **options)
        except BaseException:
            loop.close()
            raise
        return ClientUnderTest(client, kind, trace, loop, inject=_BuiltinInjector(client, loop))
    client = make_client(config, multiprocess=kind == "sync", asyncio=False, trace=trace,
                         **options)
    return ClientUnderTest(client, kind, trace, inject=_BuiltinInjector(client))


# --- helpers ---------------------------------------------------------------------------------


@dataclass
class Finished:
    tokens: list[int]
    reason: FinishReason
    error: str | None = None
    num_cached_tokens: int = 0  # the most any of its outputs reported


PROMPT = [1, 2, 3, 4]


def max_new_tokens(cut: ClientUnderTest, prompt_len: int = len(PROMPT)) -> int | None:
    """How many tokens a request with a ``prompt_len``-token prompt can run before
    ``max_model_len`` ends it (None when the client does not say its config)."""
    mml = getattr(getattr(cut.client, "config", None), "max_model_len", None)
    return None if mml is None else int(mml) - prompt_len


def fit(cut: ClientUnderTest, want: int, what: str, minimum: int = 1) -> int:
    """``want`` tokens, or fewer when ``max_model_len`` allows fewer (at least ``minimum``)."""
    room = max_new_tokens(cut)
    if room is None or room >= want:
        return want
    if room < minimum:
        raise NotApplicable(f"{what} needs {minimum} tokens after a {len(PROMPT)}-token prompt;"
                            f" max_model_len={room + len(PROMPT)} leaves {room}")
    return room


def request(rid: str, max_tokens: int = 20, prompt: list[int] | None = None) -> EngineCoreRequest:
    """A request that runs exactly ``max_tokens`` tokens (EOS ignored)."""
    return EngineCoreRequest(
        rid, prompt or list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def collect(cut: ClientUnderTest, ids: list[str], timeout: float = WAIT_S) -> dict[str, Finished]:
    """Read outputs until every id in ``ids`` finished; tokens per id, in order."""
    want = set(ids)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    done: dict[str, Finished] = {}
    deadline = time.monotonic() + timeout
    while not want.issubset(done):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(
                f"timed out after {timeout} s; unfinished: {sorted(want - set(done))}")
        batch = cut.get_output(timeout=min(remaining, 5.0))
        for out in batch.outputs:
            if out.request_id in done and out.request_id in want:
                raise AssertionError(f"output for {out.request_id!r} after it finished")
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
            if out.finish_reason is not None:
                done[out.request_id] = Finished(
                    tokens[out.request_id], FinishReason(out.finish_reason), out.error,
                    cached[out.request_id])
    return done


def check_trace(cut: ClientUnderTest) -> None:
    """Every recorded step of the client, request and utility machines is in the spec."""
    assert cut.trace is not None, "open the client with a trace list"
    machines: tuple[Machine[Any, Any], ...] = (CLIENT, CLIENT_REQUEST, UTILITY)
    for machine in machines:
        validate_trace(machine, cut.trace)


def stop_process(pid: int, bound: float = WAIT_S) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped.

    ``kill`` only queues a process-directed stop: until the thread the kernel picked to take
    it runs, the others run on, so a call sent right after could still be answered (seen
    under load). Once this returns, nothing is answered until SIGCONT or SIGKILL.
    """
    os.kill(pid, signal.SIGSTOP)
    states: list[str] = []

    def stopped() -> bool:
        states[:] = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    # The state follows the parenthesised command name, which may hold spaces.
                    states.append(f.read().rpartition(")")[2].split()[0])
        return bool(states) and all(st in ("T", "t", "Z", "X") for st in states)

    if not wait_until(stopped, bound, poll=0.001):
        raise AssertionError(f"process {pid} not stopped {bound} s after SIGSTOP"
                             f" (thread states {states})")


def expect_dead(fut: concurrent.futures.Future[Any], killed_at: float, what: str) -> None:
    try:
        fut.result(timeout=DEATH_BOUND_S + 5)
    except EngineDeadError as e:
        seen = time.monotonic() - killed_at
        assert seen <= DEATH_BOUND_S, f"{what}: death seen after {seen:.2f} s"
        assert e.__cause__ is not None, "EngineDeadError must carry its cause"
        return
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"{what}: still blocked after the engine was killed") from None
    raise AssertionError(f"{what}: returned instead of raising EngineDeadError")
