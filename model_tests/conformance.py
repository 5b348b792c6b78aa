"""The one conformance suite for EngineCoreClient implementations (trio's check_two_way_stream).

Every scenario is a plain function over a ``ClientUnderTest`` (a thin driver that gives the
sync, async and in-process clients one blocking call surface) or over a ``ClientFactory``
(for scenarios that break the engine and need a fresh one). ``tests/runtime/test_clients.py``
runs them on the three built-in clients; run them on your own engine::

    from enginewire.testing import conformance

    def test_my_engine_generates():
        with conformance.open_client("sync", my_config) as cut:
            conformance.check_generate(cut)

    def factory(**options):  # the ClientFactory contract, below
        config = options.pop("config", my_config)
        return conformance.open_client("sync", config, **options)

    def my_factory(**options):  # your own client class: wrap it in a ClientUnderTest
        config, trace = options.pop("config", my_config), []
        return conformance.ClientUnderTest(MyClient(config, trace=trace, **options), "sync",
                                           trace)

    def test_my_engine_survives_sigkill():
        conformance.check_kill_during_get_output(factory)

The ``ClientFactory`` contract. ``factory(**options)`` builds and returns a fresh
``ClientUnderTest`` (the scenario shuts it down). With no options it builds your client as
configured. A scenario may pass these options, and a factory must honour each one or raise
``NotApplicable`` naming it (never ignore one, never a ``TypeError``):

* ``config=``: an engine config to use instead of the factory's own
  (``check_construction_failure_leaks_nothing`` passes one that cannot build);
* ``engine_startup_delay_s=``: seconds the engine process waits before its handshake
  (``check_kill_during_handshake``);
* ``engine_fault=``: a fault for the engine process to inject, a ``runtime/faults.py`` spec
  such as ``"forward:3"`` (``check_engine_fatal_error``).

``open_client`` and ``enginewire.testing.stateful.builtin_factory`` meet it; the in-process
client has no engine process, so ``open_client("inproc", ...)`` raises ``NotApplicable`` for
the last two.

Skips. A scenario that cannot run on the client under test (a kill or an injected frame on
an in-process client, prefix caching on a config without it) raises ``NotApplicable``,
never returns quietly. It subclasses ``unittest.SkipTest``, which pytest and unittest
report as a skip; elsewhere it is an exception that says why. Limits come from the client's
config: ``max_tokens`` is clamped to what ``max_model_len`` leaves after the prompt. Every
wait is bounded; death must be seen within ``DEATH_BOUND_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import unittest
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from ..protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SamplingParams,
)
from ..spec import (
    CLIENT,
    CLIENT_REQUEST,
    UTILITY,
    ClientState,
    EngineDeadError,
    EngineStartupError,
    Machine,
    SpecViolation,
    TraceEntry,
    UtilityError,
    validate_trace,
)

__all__ = [
    "CLIENT_KINDS",
    "DEATH_BOUND_S",
    "ClientFactory",
    "ClientUnderTest",
    "Finished",
    "NotApplicable",
    "check_abort_half",
    "check_bad_arguments",
    "check_client_kill_engine_exits",
    "check_construction_failure_leaks_nothing",
    "check_duplicate_request_id",
    "check_engine_fatal_error",
    "check_exits_with_parent",
    "check_forbidden_output",
    "check_generate",
    "check_kill_during_get_output",
    "check_kill_during_handshake",
    "check_kill_during_utility",
    "check_malformed_frames",
    "check_prefix_caching",
    "check_rejected_add_spares_live_request",
    "check_shutdown_semantics",
    "check_sleep_wake",
    "check_trace",
    "check_utilities",
    "collect",
    "open_client",
    "request",
]

CLIENT_KINDS = ("inproc", "sync", "async")
# The brief's bound: engine death is seen on every path within this many seconds.
DEATH_BOUND_S = 1.0
# A parent's death makes the engine exit within this many seconds.
ORPHAN_BOUND_S = 5.0
# Upper bound for ordinary waits (generation, utilities) on a loaded CI machine.
WAIT_S = 60.0
# Options of the ClientFactory contract that need an engine process.
_ENGINE_PROCESS_OPTIONS = ("engine_fault", "engine_startup_delay_s")


class NotApplicable(unittest.SkipTest):
    """The scenario cannot run on this client or config; the message says why.

    A ``unittest.SkipTest``, so pytest and unittest report it as a skip rather than a pass."""


# --- driver ----------------------------------------------------------------------------------


class _LoopThread:
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
    """

    client: Any
    kind: str
    trace: list[TraceEntry] | None = None
    loop: _LoopThread | None = None
    closed: bool = field(default=False)

    def __post_init__(self) -> None:
        if self.kind not in CLIENT_KINDS:
            raise ValueError(f"ClientUnderTest.kind must be one of {CLIENT_KINDS},"
                             f" got {self.kind!r}")
        if self.kind == "async" and self.loop is None:
            # Its calls are coroutines: without a loop the driver would call the sync names,
            # which an async client does not have (an AttributeError in the first scenario).
            self.loop = _LoopThread()

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
        """Start a call without waiting for it (a thread, or a task on the loop)."""
        if self.loop is not None:
            return self.loop.submit(getattr(self.client, f"{name}_async")(*args, **kw))
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="conformance")
        fut = pool.submit(getattr(self.client, name), *args, **kw)
        pool.shutdown(wait=False)
        return fut

    def add_request(self, req: EngineCoreRequest) -> None:
        self._call("add_request", req)

    def abort_requests(self, ids: list[str]) -> None:
        self._call("abort_requests", ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        bound = None if timeout is None else timeout + WAIT_S
        out: EngineCoreOutputs = self._call("get_output", _wait=bound, timeout=timeout)
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


ClientFactory = Callable[..., ClientUnderTest]
"""``factory(**options) -> ClientUnderTest``: a fresh client; it honours ``config=``,
``engine_startup_delay_s=`` and ``engine_fault=`` or raises ``NotApplicable`` (module
docstring)."""


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
        loop = _LoopThread()
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
        return ClientUnderTest(client, kind, trace, loop)
    client = make_client(config, multiprocess=kind == "sync", asyncio=False, trace=trace,
                         **options)
    return ClientUnderTest(client, kind, trace)


# --- helpers ---------------------------------------------------------------------------------


@dataclass
class Finished:
    tokens: list[int]
    reason: FinishReason
    error: str | None = None
    num_cached_tokens: int = 0  # the most any of its outputs reported


_PROMPT = [1, 2, 3, 4]


def max_new_tokens(cut: ClientUnderTest, prompt_len: int = len(_PROMPT)) -> int | None:
    """How many tokens a request with a ``prompt_len``-token prompt can run before
    ``max_model_len`` ends it (None when the client does not say its config)."""
    mml = getattr(getattr(cut.client, "config", None), "max_model_len", None)
    return None if mml is None else int(mml) - prompt_len


def _fit(cut: ClientUnderTest, want: int, what: str, minimum: int = 1) -> int:
    """``want`` tokens, or fewer when ``max_model_len`` allows fewer (at least ``minimum``)."""
    room = max_new_tokens(cut)
    if room is None or room >= want:
        return want
    if room < minimum:
        raise NotApplicable(f"{what} needs {minimum} tokens after a {len(_PROMPT)}-token prompt;"
                            f" max_model_len={room + len(_PROMPT)} leaves {room}")
    return room


def request(rid: str, max_tokens: int = 20, prompt: list[int] | None = None) -> EngineCoreRequest:
    """A request that runs exactly ``max_tokens`` tokens (EOS ignored)."""
    return EngineCoreRequest(
        rid, prompt or list(_PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
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


def _wait_for(predicate: Callable[[], bool], bound: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > bound:
            raise AssertionError(f"{what} not seen within {bound} s")
        time.sleep(0.005)
    return time.monotonic() - start


def stop_process(pid: int, bound: float = WAIT_S) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped.

    ``kill`` only queues a process-directed stop: until the thread the kernel picked to take
    it runs, the others run on, so a call sent right after could still be answered (seen
    under load). Once this returns, nothing is answered until SIGCONT or SIGKILL.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + bound
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    # The state follows the parenthesised command name, which may hold spaces.
                    states.append(f.read().rpartition(")")[2].split()[0])
        if states and all(st in ("T", "t", "Z", "X") for st in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped {bound} s after SIGSTOP"
                                 f" (thread states {states})")
        time.sleep(0.001)


def _process_gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _expect_dead(fut: concurrent.futures.Future[Any], killed_at: float, what: str) -> None:
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


# --- scenarios on a live client (safe on a shared, warm engine) ------------------------------


def _expect_length(rid: str, got: Finished, n: int) -> None:
    assert got.reason is FinishReason.LENGTH and len(got.tokens) == n, (
        f"{rid!r} ended {got.reason.name} after {len(got.tokens)} tokens (error {got.error!r});"
        f" expected LENGTH after exactly {n}")


def check_generate(cut: ClientUnderTest, n: int = 10, max_tokens: int | None = None,
                   prefix: str = "gen") -> None:
    """``n`` requests x ``max_tokens`` tokens complete with exactly that many tokens each.

    ``max_tokens`` defaults to 20, or what ``max_model_len`` leaves after the prompt; an
    explicit value the config cannot hold raises ``ValueError``."""
    room = max_new_tokens(cut)
    if max_tokens is None:
        max_tokens = _fit(cut, 20, "check_generate")
    elif room is not None and max_tokens > room:
        raise ValueError(f"check_generate(max_tokens={max_tokens}): max_model_len leaves"
                         f" {room} tokens after a {len(_PROMPT)}-token prompt")
    ids = [f"{prefix}-{i}" for i in range(n)]
    for rid in ids:
        cut.add_request(request(rid, max_tokens))
    done = collect(cut, ids)
    for rid in ids:
        _expect_length(rid, done[rid], max_tokens)
    check_trace(cut)


def check_abort_half(cut: ClientUnderTest, n: int = 10, prefix: str = "abort") -> None:
    """Aborting half: ABORT endings for those, full output for the rest; late abort harmless.

    The aborted requests ask for 200 tokens, long enough that their aborts land while they
    run. Where ``max_model_len`` allows fewer (a multi-process client only; in-process the
    abort precedes any step), an aborted one may instead finish in full first."""
    ids = [f"{prefix}-{i}" for i in range(n)]
    aborted = ids[::2]
    kept = ids[1::2]
    long_n = _fit(cut, 200, "check_abort_half")
    short_n = _fit(cut, 20, "check_abort_half")
    may_race = long_n < 200 and cut.multiprocess
    for rid in ids:
        cut.add_request(request(rid, long_n if rid in aborted else short_n))
    cut.abort_requests(aborted)
    done = collect(cut, ids)
    for rid in aborted:
        got = done[rid]
        if may_race and got.reason is FinishReason.LENGTH:
            _expect_length(rid, got, long_n)
            continue
        assert got.reason is FinishReason.ABORT and len(got.tokens) < long_n, (
            f"aborted {rid!r} ended {got.reason.name} after {len(got.tokens)} of {long_n}"
            " tokens; expected ABORT before its end")
    for rid in kept:
        _expect_length(rid, done[rid], short_n)
    cut.abort_requests(kept)  # already finished: a no-op on both sides
    cut.abort_requests(["never-sent"])
    check_generate(cut, n=1, prefix=f"{prefix}-after")


def check_utilities(cut: ClientUnderTest) -> None:
    """echo round-trips; a raising utility and an unknown one raise UtilityError by name."""
    value = {"nested": [1, 2.5, "three", None, True], "n": -7}
    assert cut.call_utility("echo", value) == value
    assert cut.call_utility("echo", None) is None
    try:
        cut.call_utility("profile", "not-an-action")
    except UtilityError as e:
        assert e.method == "profile" and "not-an-action" in e.remote_message, e
    else:
        raise AssertionError("a raising utility must raise UtilityError")
    try:
        cut.call_utility("_private_or_unknown")
    except UtilityError as e:
        assert e.method == "_private_or_unknown"
    else:
        raise AssertionError("an unknown utility must raise UtilityError")
    # An array result travels as an aux frame: a reply of two parts, then a plain one.
    arr = np.arange(100, dtype=np.int64)
    assert np.array_equal(cut.call_utility("echo", arr), arr)
    # The client survives failed calls.
    assert cut.call_utility("echo", 42) == 42
    if cut.multiprocess:
        assert cut.client.pending_utility_calls() == 0
    check_trace(cut)


def _refused(kind: type[BaseException], what: str, call: Callable[[], Any]) -> None:
    try:
        call()
    except kind:
        return
    except Exception as e:
        raise AssertionError(f"{what}: expected {kind.__name__}, got {e!r}") from e
    raise AssertionError(f"{what}: expected {kind.__name__}, nothing was raised")


def check_bad_arguments(cut: ClientUnderTest, prefix: str = "arg") -> None:
    """A bad argument to any call is refused with a typed error before anything is sent (a
    bare-string id list would otherwise abort one-letter ids, one bad id drop the whole
    abort), what cannot be sent is refused alike on every transport, a request the engine
    cannot accept finishes with ERROR, and the client keeps serving."""
    short, long_ = f"{prefix}"[:1], f"{prefix}"[:1] + "Z"  # "aZ" as a str iterates to "a"
    n = _fit(cut, 6, "check_bad_arguments")
    cut.add_request(request(short, max_tokens=n))
    cut.add_request(request(long_, max_tokens=n))
    call = cut._call  # the raw call: ClientUnderTest's own timeout arithmetic stays out
    cases: list[tuple[type[BaseException], str, Callable[[], Any]]] = [
        (TypeError, "abort_requests(a str)", lambda: cut.abort_requests(long_)),  # type: ignore[arg-type]
        (TypeError, "abort_requests([id, None])", lambda: cut.abort_requests([long_, None])),  # type: ignore[list-item]
        (TypeError, "abort_requests(None)", lambda: cut.abort_requests(None)),  # type: ignore[arg-type]
        (TypeError, "add_request(a str)", lambda: cut.add_request("r1")),  # type: ignore[arg-type]
        # An id the engine cannot name in its ERROR output would stay live for good.
        (TypeError, "add_request(request_id=7)",
         lambda: cut.add_request(EngineCoreRequest(7, [1], SamplingParams(max_tokens=1)))),  # type: ignore[arg-type]
        (TypeError, "get_output(timeout='soon')", lambda: call("get_output", timeout="soon")),
        (ValueError, "get_output(timeout=nan)", lambda: call("get_output", timeout=float("nan"))),
        (TypeError, "call_utility(timeout='soon')",
         lambda: call("call_utility", "echo", 1, timeout="soon")),
        (TypeError, "wake_up('weights')", lambda: cut.wake_up("weights")),  # type: ignore[arg-type]
        (TypeError, "echo(object())", lambda: cut.call_utility("echo", object())),
        # Sent, they came back as UtilityErrors blaming the engine or a malformed call.
        (TypeError, "call_utility(5)", lambda: call("call_utility", 5)),
        (ValueError, "sleep(True)", lambda: cut.sleep(True)),
        (TypeError, "profile('stop')", lambda: call("profile", "stop")),
        (ValueError, "echo(1 << 70)", lambda: cut.call_utility("echo", 1 << 70)),
        # Refused before the client closes: the requests above still finish below.
        (TypeError, "shutdown(timeout='soon')", lambda: call("shutdown", timeout="soon")),
        (ValueError, "shutdown(timeout=nan)", lambda: call("shutdown", timeout=float("nan"))),
    ]
    for kind, what, fn in cases:
        _refused(kind, what, fn)
    assert 7 not in cut.client.live_requests(), "a refused ADD is not tracked"
    done = collect(cut, [short, long_])
    for rid in (short, long_):  # neither was aborted by a refused call
        _expect_length(rid, done[rid], n)
    bad = f"{prefix}-malformed"
    cut.add_request(EngineCoreRequest(
        bad, [1, 2], SamplingParams(max_tokens=3, stop_token_ids=["x"])))  # type: ignore[list-item]
    got = collect(cut, [bad])[bad]
    assert got.reason is FinishReason.ERROR and "malformed request" in (got.error or ""), got
    # Without end and below zero are both timeouts a caller may pass.
    assert cut.call_utility("echo", 5, timeout=float("inf")) == 5
    assert cut.call_utility("echo", 6, timeout=1e9) == 6
    rid = f"{prefix}-inf"
    cut.add_request(request(rid, max_tokens=1))
    assert isinstance(call("get_output", timeout=float("inf")), EngineCoreOutputs)
    assert isinstance(call("get_output", timeout=-1.0), EngineCoreOutputs)
    deadline = time.monotonic() + WAIT_S
    while rid in cut.client.live_requests():
        assert time.monotonic() < deadline, f"{rid} never finished"
        cut.get_output(timeout=1.0)
    try:
        cut.call_utility("no_such_method")
    except UtilityError as e:
        assert str(e).count("failed") == 1, f"the failure is said once: {e}"
    check_generate(cut, n=1, max_tokens=3, prefix=f"{prefix}-after")
    if cut.multiprocess:
        assert cut.client.pending_utility_calls() == 0
    check_trace(cut)


def check_duplicate_request_id(cut: ClientUnderTest, prefix: str = "dup") -> None:
    """A live duplicate id is refused before sending; reuse after finish is fine."""
    rid = f"{prefix}-0"
    n = _fit(cut, 5, "check_duplicate_request_id")
    cut.add_request(request(rid, n))
    try:
        cut.add_request(request(rid, n))
    except SpecViolation:
        pass
    else:
        raise AssertionError("a duplicate live request id must raise SpecViolation")
    _expect_length(rid, collect(cut, [rid])[rid], n)
    cut.add_request(request(rid, n))
    _expect_length(rid, collect(cut, [rid])[rid], n)
    check_trace(cut)


def check_sleep_wake(cut: ClientUnderTest, level: int, mode: str, prefix: str = "sleep") -> None:
    """sleep(level, mode) then wake_up: in-flight requests end as the mode says."""
    n = _fit(cut, 20, "check_sleep_wake")
    try:
        _sleep_wake(cut, level, mode, prefix, n)
    except BaseException:
        # A failed check must not leave the engine asleep: later checks would time out.
        with contextlib.suppress(Exception):
            if cut.is_sleeping():
                cut.wake_up()
        raise


def _sleep_wake(cut: ClientUnderTest, level: int, mode: str, prefix: str, n: int) -> None:
    ids = [f"{prefix}-{level}-{mode}-{i}" for i in range(3)]
    for rid in ids:
        cut.add_request(request(rid, n))
    if mode == "wait" and not cut.multiprocess:
        try:
            cut.sleep(level, mode)
        except ValueError:
            pass
        else:
            raise AssertionError("in-process sleep(mode='wait') must raise ValueError")
        collect(cut, ids)
        return
    cut.sleep(level, mode)
    assert cut.is_sleeping()
    assert cut.client.state is ClientState.SLEEPING
    if mode == "abort":
        done = collect(cut, ids)
        for rid in ids:
            # Requests may have finished before the sleep arrived; none may run past it.
            if done[rid].reason is not FinishReason.ABORT:
                _expect_length(rid, done[rid], n)
    elif mode == "wait":
        # The reply means drained: every request already finished, in full.
        done = collect(cut, ids)
        for rid in ids:
            _expect_length(rid, done[rid], n)
    assert cut.wake_up() is True
    assert not cut.is_sleeping()
    if mode == "keep":
        # Parked requests resume after wake-up and complete in full.
        done = collect(cut, ids)
        for rid in ids:
            _expect_length(rid, done[rid], n)
    check_generate(cut, n=1, prefix=f"{prefix}-{level}-{mode}-after")


def check_malformed_frames(cut: ClientUnderTest, prefix: str = "bad") -> None:
    """Garbage on the input socket is rejected; the engine keeps serving."""
    if not cut.multiprocess:
        raise NotApplicable("an in-process client has no input socket")
    client = cut.client
    rid = f"{prefix}-0"
    # Pretend the client sent it, so the ERROR output it earns is expected.
    client._track_add(request(rid))
    frames: list[list[bytes]] = [
        [b"\x07\x90"],  # unknown request type
        [RequestType.ADD.value + b"\xc1"],  # not msgpack at all
        [RequestType.ADD.value + b"\x92\xa5" + rid[:5].encode()],  # wrong shape
        [RequestType.ABORT.value + b"\x91\x07"],  # ids must be strings
        [RequestType.ADD.value],  # a type byte and no payload
        [b"", b"", b"", b""],  # empty frames, each a message of its own
        # A part nothing refers to after a valid (no-op) abort: rejected alone.
        [RequestType.ABORT.value + b"\x90", b"\x07stray"],
    ]
    # A recoverable ADD: decodes far enough to name its request id.
    import msgspec

    frames.append([RequestType.ADD.value + msgspec.msgpack.encode([rid, "not a token list"])])
    # A utility call that names its call id but no method: answered with a failure reply,
    # which the client drops (no such call is pending).
    frames.append([RequestType.UTILITY.value + msgspec.msgpack.encode([0, 1 << 40, None])])
    for f in frames:
        client.send_raw_frames(f)
    done = collect(cut, [rid])
    assert done[rid].reason is FinishReason.ERROR and done[rid].error, done[rid]
    check_generate(cut, n=2, prefix=f"{prefix}-after")
    assert cut.call_utility("echo", "still serving") == "still serving"


def check_rejected_add_spares_live_request(cut: ClientUnderTest, prefix: str = "reuse") -> None:
    """A malformed ADD that reuses the id of a live request is dropped: the live request is
    neither finished nor touched (an ERROR under its id, then its stream going on, is
    outputs after a finish), and the engine serves on. Multi-process: the malformed frames
    go on the wire; in-process: the engine's rejection path is driven directly."""
    import msgspec

    rid = f"{prefix}-0"
    # Long enough to be live still when the pause lands (on a data-parallel client the pause
    # goes to every engine, after the ADD went to one).
    n = _fit(cut, 64, "check_rejected_add_spares_live_request")
    cut.add_request(request(rid, n))
    # Parked, the request stays live however fast the engine is, until the rejection was
    # handled (the echo below is answered after it, in order).
    cut._call("pause_scheduler", "keep")
    try:
        if cut.multiprocess:
            bad_sp = msgspec.msgpack.encode([rid, [1, 2], [4, float("inf")]])
            for frames in ([RequestType.ADD.value + msgspec.msgpack.encode([rid, "tokens?"])],
                           [RequestType.ADD.value + bad_sp]):
                cut.client.send_raw_frames(frames)
        else:
            with cut.client._engine_lock:
                assert not cut.client.engine.reject_request(rid, "malformed request: test")
        assert cut.call_utility("echo", "after") == "after"
    finally:
        cut._call("resume_scheduler")
    got = collect(cut, [rid])[rid]
    _expect_length(rid, got, n)
    check_generate(cut, n=1, prefix=f"{prefix}-after")
    check_trace(cut)


def _inject(cut: ClientUnderTest, batch: EngineCoreOutputs) -> None:
    """Queue ``batch`` where a built-in client puts what its engine sent, untracked: what an
    engine that breaks the spec would deliver (NotApplicable for any other client)."""
    from ..runtime.async_mp_client import AsyncMPClient
    from ..runtime.client import InprocClient
    from ..runtime.sync_mp_client import SyncMPClient

    client = cut.client
    if isinstance(client, InprocClient):
        with client._engine_lock:  # stepped batches waiting for get_output
            client._buffered.append(batch)
    elif isinstance(client, SyncMPClient):
        client._outputs.put(batch)
    elif isinstance(client, AsyncMPClient) and cut.loop is not None:
        async def put() -> None:  # on the loop: an asyncio.Queue is not thread-safe
            client._ensure_reader()
            assert client._outputs is not None
            client._outputs.put_nowait(batch)

        cut.loop.run(put())
    else:
        raise NotApplicable(f"cannot inject outputs into a {type(client).__name__}")


def check_forbidden_output(cut: ClientUnderTest, prefix: str = "forbidden") -> None:
    """An engine output the spec forbids (here, one for an id never sent) costs its batch
    nothing else: ``get_output`` raises SpecViolation naming that id, once, and the next
    call returns the batch's legal outputs, each of which advanced its request once; the
    batches after it follow in order. Needs an idle client: the batches are injected."""
    client = cut.client
    if client.live_requests():
        raise NotApplicable("the injected batches need a client with no live request")
    r1, r2, ghost = f"{prefix}-1", f"{prefix}-2", f"{prefix}-never-sent"
    # Tracked as sent, never sent: the engine produces nothing for them.
    client._track_add(request(r1))
    client._track_add(request(r2))
    _inject(cut, EngineCoreOutputs(outputs=[
        EngineCoreOutput(r1, [7], FinishReason.LENGTH),
        EngineCoreOutput(ghost, [8]),
        EngineCoreOutput(r2, [9]),
    ]))
    _inject(cut, EngineCoreOutputs(outputs=[EngineCoreOutput(r2, [10], FinishReason.STOP)]))

    def read() -> list[tuple[str, list[int], Any]]:
        batch = cut.get_output(timeout=WAIT_S)
        return [(o.request_id, list(o.new_token_ids), o.finish_reason) for o in batch.outputs]

    try:
        got = read()
    except SpecViolation as e:
        assert repr(ghost) in str(e) and r1 not in str(e) and r2 not in str(e), str(e)
    else:
        raise AssertionError(f"an output for {ghost!r}, never sent, was returned: {got}")
    assert client.live_requests() == [r2], client.live_requests()
    got = read()
    assert got == [(r1, [7], FinishReason.LENGTH), (r2, [9], None)], f"the rest: {got}"
    got = read()
    assert got == [(r2, [10], FinishReason.STOP)], f"the batch after: {got}"
    assert client.live_requests() == []
    assert cut.get_output(timeout=0).outputs == []  # the violation was raised once
    assert client.queued_outputs() == 0


def check_prefix_caching(cut: ClientUnderTest, prefix: str = "prefix") -> None:
    """With ``enable_prefix_caching``, a prompt of more than one block sent again reports its
    full blocks as cached (``num_cached_tokens``): at least one block, never the whole prompt."""
    config = getattr(cut.client, "config", None)
    if not getattr(config, "enable_prefix_caching", False):
        raise NotApplicable("the client's config does not enable prefix caching")
    block = int(config.block_size)  # type: ignore[union-attr]
    prompt = [3 + i % 250 for i in range(block + 1)]  # one full block and one token more
    room = max_new_tokens(cut, len(prompt))
    if room is not None and room < 1:
        raise NotApplicable(f"max_model_len leaves no token after a {len(prompt)}-token prompt")
    got: list[Finished] = []
    for i in range(2):
        rid = f"{prefix}-{i}"
        cut.add_request(request(rid, 1, prompt))
        got.append(collect(cut, [rid])[rid])
        _expect_length(rid, got[-1], 1)
    cached = got[1].num_cached_tokens
    assert block <= cached < len(prompt) and cached % block == 0, (
        f"the second {len(prompt)}-token prompt reported num_cached_tokens={cached}; expected"
        f" its full {block}-token block(s) cached")
    check_trace(cut)


def check_shutdown_semantics(cut: ClientUnderTest) -> None:
    """shutdown is idempotent, raises no EngineDeadError, wakes a blocked get_output, and
    later calls are refused."""
    from ..spec import ClientClosedError

    blocked = cut.submit("get_output") if cut.multiprocess else None
    if blocked is not None:
        cut.call_utility("echo", 0)  # the blocked call had time to reach its wait
    cut.client.shutdown()
    if blocked is not None:
        try:
            blocked.result(timeout=DEATH_BOUND_S + 5)
        except ClientClosedError:
            pass
        else:
            raise AssertionError("shutdown must wake a blocked get_output")
    cut.client.shutdown()
    assert cut.client.state is ClientState.SHUTDOWN
    for call in (lambda: cut.add_request(request("late")),
                 lambda: cut.call_utility("echo", 1),
                 lambda: cut.get_output(timeout=0.1)):
        try:
            call()
        except ClientClosedError:
            pass
        else:
            raise AssertionError("calls after shutdown must raise ClientClosedError")
    check_trace(cut)
    cut.shutdown()


# --- scenarios that break the engine (fresh client each) --------------------------------------


def check_kill_during_get_output(factory: ClientFactory) -> None:
    """SIGKILL while get_output blocks: it wakes with EngineDeadError within the bound."""
    with factory() as cut:
        if not cut.multiprocess:
            raise NotApplicable("an in-process client has no engine process to kill")
        cut.call_utility("echo", 0)  # the reader is running
        fut = cut.submit("get_output")
        pid = cut.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _expect_dead(fut, time.monotonic(), "blocked get_output")
        try:
            cut.add_request(request("after-death"))
        except EngineDeadError:
            pass
        else:
            raise AssertionError("add_request on a dead engine must raise EngineDeadError")
        cut.abort_requests(["x"])  # silent no-op on a dead engine
        assert cut.client.state is ClientState.DEAD
        check_trace(cut)


def check_kill_during_utility(factory: ClientFactory) -> None:
    """SIGKILL while utility calls are pending: every one fails with EngineDeadError."""
    with factory() as cut:
        if not cut.multiprocess:
            raise NotApplicable("an in-process client has no engine process to kill")
        pid = cut.engine_pid
        assert pid is not None
        cut.call_utility("echo", 0)
        stop_process(pid)  # frozen: the calls below stay pending
        try:
            futs = [cut.submit("call_utility", "echo", i) for i in range(3)]
            try:
                _wait_for(lambda: cut.client.pending_utility_calls() == 3, WAIT_S,
                          "3 pending calls")
            except AssertionError as e:
                # Say what became of the calls: a flaky run must explain itself.
                states = [repr(f.exception(0)) if f.done() else "running" for f in futs]
                raise AssertionError(
                    f"{e}: {cut.client.pending_utility_calls()} pending, calls: {states},"
                    f" client {cut.client.state.name}") from None
        finally:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for f in futs:
            _expect_dead(f, killed, "pending utility")
        assert cut.client.pending_utility_calls() == 0
        check_trace(cut)


def check_kill_during_handshake(factory: ClientFactory) -> None:
    """SIGKILL before the engine is ready: construction fails at once, nothing leaks."""
    me = psutil.Process()
    before = {p.pid for p in me.children()}

    def new_engines() -> set[int]:
        # Any new child but multiprocessing's resource tracker (started on first use).
        found = set()
        for p in me.children():
            with contextlib.suppress(psutil.Error):
                if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline()):
                    found.add(p.pid)
        return found

    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(factory, engine_startup_delay_s=60.0)
    pool.shutdown(wait=False)
    # The factory may refuse the option (NotApplicable) or fail at once: say so, not wait.
    _wait_for(lambda: bool(new_engines()) or fut.done(), WAIT_S, "the engine process")
    if not new_engines():
        cut = fut.result(0)  # the factory's own error, NotApplicable included, raises here
        multiprocess = cut.multiprocess
        cut.shutdown()
        if not multiprocess:
            raise NotApplicable("an in-process client has no engine process to kill")
        raise AssertionError("the factory returned a client before its engine was seen: does"
                             " it honour engine_startup_delay_s?")
    (pid,) = new_engines()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        cut = fut.result(timeout=DEATH_BOUND_S + 5)
    except EngineStartupError as e:
        seen = time.monotonic() - killed
        assert seen <= DEATH_BOUND_S, f"handshake death seen after {seen:.2f} s"
        assert "initialization failed" in str(e) and "SIGKILL" in str(e), e
    else:
        cut.shutdown()
        raise AssertionError("construction must fail when the engine dies during start-up")
    _wait_for(lambda: not new_engines(), WAIT_S, "reaped engine")


def check_engine_fatal_error(factory: ClientFactory) -> None:
    """A fatal engine error: sentinel, in-flight requests wake with EngineDeadError."""
    with factory(engine_fault="forward:3") as cut:
        if not cut.multiprocess:
            raise NotApplicable("an in-process client has no engine process to die")
        pid = cut.engine_pid
        cut.add_request(request("doomed", 50))
        start = time.monotonic()
        try:
            # Short reads, and the engine's exit watched: a client that swallows the death
            # (get_output returning empty batches) fails within the bound, by name, rather
            # than as a request still unfinished after WAIT_S.
            gone_at: float | None = None
            while True:
                batch = cut.get_output(timeout=0.1)
                if any(o.request_id == "doomed" and o.finish_reason is not None
                       for o in batch.outputs):
                    raise AssertionError("'doomed' finished, but the engine was to hit a fatal"
                                         " error in its 3rd forward")
                now = time.monotonic()
                if gone_at is None and pid is not None and _process_gone(pid):
                    gone_at = now
                if gone_at is not None and now - gone_at > DEATH_BOUND_S:
                    raise AssertionError(
                        f"the engine hit a fatal error and its process exited {now - gone_at:.1f}"
                        " s ago, but get_output still returns instead of raising"
                        " EngineDeadError: the client swallowed the engine's death")
                if now - start > WAIT_S:
                    raise AssertionError(f"no EngineDeadError {WAIT_S} s after the request"
                                         " (the engine was to hit a fatal error in its 3rd"
                                         " forward)")
        except EngineDeadError as e:
            # The sentinel (or, if the monitor wins the race, the exit code) is the cause.
            cause = str(e.__cause__)
            assert "sentinel" in cause or "exit code" in cause, cause
        assert cut.client.state is ClientState.DEAD
        check_trace(cut)


_ORPHAN_SCRIPT = textwrap.dedent("""
    import sys
    from enginewire.runtime import make_client
    from enginewire.runtime.config import EngineConfig

    config = EngineConfig(**{config!r})
    client = make_client(config, multiprocess=True, asyncio={is_async!r})
    print(client.engine_pid, flush=True)
    sys.stdin.read()  # hold until killed
""")


def check_client_kill_engine_exits(config_kwargs: dict[str, Any], *, is_async: bool = False
                                   ) -> None:
    """SIGKILL of the client process: its engine exits by itself within ORPHAN_BOUND_S."""
    check_exits_with_parent(_ORPHAN_SCRIPT.format(config=config_kwargs, is_async=is_async),
                            "orphaned engine")


def check_exits_with_parent(script: str, what: str, *, bound: float = ORPHAN_BOUND_S,
                            env: dict[str, str] | None = None) -> None:
    """Run ``script`` in its own interpreter: it starts a process, prints that process's pid
    and holds (reading stdin). SIGKILL the interpreter, which runs no cleanup: the process it
    started must exit by itself within ``bound`` s (it is killed afterwards either way)."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    child: int | None = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the parent script failed: {line!r}"
        child = int(line)
        proc.kill()
        proc.wait(WAIT_S)
        killed = time.monotonic()
        _wait_for(lambda: _process_gone(child), bound + 2, f"{what} exit")
        assert time.monotonic() - killed <= bound, f"{what} outlived its parent by > {bound} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        if proc.stdin:
            proc.stdin.close()
        if proc.stdout:
            proc.stdout.close()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


@contextlib.contextmanager
def _resource_snapshot() -> Iterator[dict[str, Any]]:
    me = psutil.Process()
    snap = {"children": {p.pid for p in me.children(recursive=True)},
            "threads": me.num_threads(), "fds": me.num_fds()}
    yield snap


def check_construction_failure_leaks_nothing(factory: ClientFactory, bad_config: Any) -> None:
    """A client whose engine fails to build raises EngineStartupError and leaks no process,
    thread or fd (psutil before/after)."""
    me = psutil.Process()

    def attempt() -> None:
        try:
            cut = factory(config=bad_config)
        except EngineStartupError as e:
            assert "initialization failed" in str(e), e
        else:
            cut.shutdown()
            raise AssertionError("a failing engine build must raise EngineStartupError")

    attempt()  # warm-up: first use creates process-wide things (imports, pools)
    children = {p.pid for p in me.children(recursive=True)}
    threads, fds = me.num_threads(), me.num_fds()
    attempt()
    _wait_for(lambda: {p.pid for p in me.children(recursive=True)} <= children, WAIT_S,
              "no leftover process")
    _wait_for(lambda: me.num_threads() <= threads, 5.0, f"threads back to {threads}")
    _wait_for(lambda: me.num_fds() <= fds, 5.0, f"fds back to {fds}")
