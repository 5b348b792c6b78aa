"""``DataParallelStateMachine``: the stateful campaign on one client over N engine cores.

Theory of operation
-------------------
Rule 1: as in ``stateful.py``, preconditions and strategies read only the model
(``DPOracle``): which engines the test killed, whether it paused them, how long the client
has lived. Where the system may legitimately differ (a request's last batch queued before its
engine died, a routed request nobody has heard from yet) the oracle keeps what is allowed.
Rule 2: every rule ends at a bounded synchronization point; a death the test caused is seen
(the index DEAD, or SERVING again under a new pid where restarts are on) before the rule ends.

The machine drives a ``SyncDPClient`` or ``AsyncDPClient`` (runtime/dp_client.py) through
``ClientUnderTest``: ADDs, most routed by the client, some pinned with
``data_parallel_rank``; aborts of live, finished and unknown ids; the broadcast utilities
(sleep, wake-up, pause, resume, is_sleeping) and ``call_utility_all``; the one-engine
``echo``; the loss of one engine (SIGKILL, optionally with a ``call_utility_all`` held pending
by a SIGSTOP); and shutdown. Each example draws, in its ``initialize`` rule, whether the
client restarts dead engines (``restart_dead_engines=True``): then a killed index must come
back SERVING with a new pid, and a request routed while it restarts must go elsewhere.

What the oracle holds (``oracle.DPOracle`` on top of ``oracle.Oracle``): every request ends
exactly once and as its request allows; a killed engine's live requests end (with ERROR
naming it, unless their last batch was already queued) and nobody else's end with ERROR; a
request's outputs come from one engine, never one that was dead when it was added; a pinned
request runs where it was pinned, and one pinned to a dead engine is refused naming it; a call
pending on an engine that dies raises ``EngineDeadError`` naming it, and calls after the death
succeed on the rest; ``call_utility_all`` answers once per serving engine; the client is DEAD
only when no engine is left. The recorded CLIENT, CLIENT_REQUEST, UTILITY and MEMBERSHIP
traces are replayed through the spec machines, and a client's teardown checks that every
engine process it ever had (replacements too) was reaped and no thread or fd leaked.

Engines are expensive, so ``DPClientPool`` keeps one healthy client from example to example;
a client that lost an engine, was shut down, or restarts engines where the next example
wants it not to (or the other way round), is closed and checked.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..protocol.messages import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from ..spec.client import ClientState
from ..spec.errors import ClientClosedError, EngineDeadError, SpecViolation, UtilityError
from ..spec.membership import MembershipState
from . import conformance as cf
from .oracle import (
    DPOracle,
    OracleViolation,
    Phase,
    ResourceSnapshot,
    check_reaped,
    check_released,
    check_traces,
    null_tokens,
)
from .stateful import (
    _JSONISH,
    _WAKE_TAG_SETS,
    DEATH_BOUND_S,
    MAX_LIVE,
    SHUTDOWN_BOUND_S,
    WAIT_MODE_TOKENS,
    WAIT_S,
    CampaignStats,
    RuleLimits,
    _note,
)

__all__ = ["DPClientPool", "DataParallelStateMachine", "dp_factory"]

DP_KINDS = ("sync", "async")
# A replacement engine's start (an interpreter and imports, about 0.7 s) on a loaded machine.
RESTART_BOUND_S = 15.0
# The request the kill rule leaves running on the engine it kills: long enough that it is
# still running when the SIGKILL lands (a null engine steps in tens of microseconds, and
# sends one batch per step), so its ERROR ending is what the oracle sees.
DOOMED_TOKENS = 2000
# Routed ADDs are the norm: one draw in four pins the request to an engine.
_PINS = st.sampled_from([None, None, None, 0, 1, 2, 3])

DPFactory = Callable[..., cf.ClientUnderTest]


def dp_factory(kind: str, config: Any) -> DPFactory:
    """``factory(restart_dead_engines=...)``: a fresh data-parallel client of ``kind`` (sync
    or async) on ``config`` (whose ``data_parallel_size`` is at least 2)."""
    if kind not in DP_KINDS:
        raise ValueError(f"the data-parallel machine drives {DP_KINDS} clients, not {kind!r}"
                         " (an in-process client has no engine processes to spread over)")
    if getattr(config, "data_parallel_size", 1) < 2:
        raise ValueError("the data-parallel machine needs a config with data_parallel_size"
                         f" >= 2, got {getattr(config, 'data_parallel_size', 1)}")

    def factory(**options: Any) -> cf.ClientUnderTest:
        return cf.open_client(kind, options.pop("config", config), **options)

    return factory


@dataclass
class _DPLive:
    """One data-parallel client and what its teardown must check."""

    cut: cf.ClientUnderTest
    before: ResourceSnapshot
    restarts: bool
    pids: set[int] = field(default_factory=set)  # every engine process it ever had
    dead: set[int] = field(default_factory=set)  # indexes lost for good (no restarts)

    def note_pids(self) -> None:
        self.pids |= {p for p in self.cut.client.engine_pids if p is not None}


def close_dp_and_check(live: _DPLive, *, check: bool = True) -> float:
    """Shut the client down; every engine it had reaped, no thread or fd left."""
    start = time.monotonic()
    with contextlib.suppress(Exception):
        live.note_pids()
    live.cut.shutdown()
    took = time.monotonic() - start
    if check and took > SHUTDOWN_BOUND_S:
        raise OracleViolation(f"shutdown took {took:.1f} s (bound {SHUTDOWN_BOUND_S} s)")
    if check:
        check_reaped(live.pids, live.before)
        # Ray's driver keeps connections and threads of its own per actor it talked to
        # (outside enginewire's control): with Ray engines only the processes are judged.
        on_ray = getattr(live.cut.client.config, "data_parallel_backend", "mp") == "ray"
        check_released(live.before, engine_pid=None, ipc_path=None, threads_fds=not on_ray)
    return took


# The heartbeat deadline of the campaign's clients: a SIGSTOPped engine (kill_engine's
# "sigstop") is declared dead by it. Long enough that a live engine on a loaded 2-core
# machine never misses it (the beat comes every 1/20 of it).
STOP_HEARTBEAT_TIMEOUT_S = 3.0


class DPClientPool:
    """Keeps one healthy client between examples. An example that asks for the other
    ``restart_dead_engines`` setting, or a client that lost an engine, costs a new one: the
    old one is closed and checked first (two clients alive at once would blur the leak
    check's before and after)."""

    def __init__(self, factory: DPFactory, stats: CampaignStats) -> None:
        self.factory = factory
        self.stats = stats
        self._idle: _DPLive | None = None

    def acquire(self, restarts: bool) -> _DPLive:
        live, self._idle = self._idle, None
        if live is not None and live.restarts == restarts:
            return live
        if live is not None:
            close_dp_and_check(live)
        with contextlib.suppress(Exception):
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()  # process-wide, once: not a leak
        before = ResourceSnapshot.take()
        start = time.monotonic()
        cut = self.factory(restart_dead_engines=restarts,
                           engine_heartbeat_timeout_s=STOP_HEARTBEAT_TIMEOUT_S,
                           engine_heartbeat_interval_s=STOP_HEARTBEAT_TIMEOUT_S / 20)
        self.stats.engines_started += int(cut.client.data_parallel_size)
        self.stats.seconds["(engine start)"] += time.monotonic() - start
        live = _DPLive(cut, before, restarts)
        live.note_pids()
        return live

    def release(self, live: _DPLive) -> None:
        if self._idle is not None:
            close_dp_and_check(self._idle)
            self._idle = None
        if live.dead or live.cut.closed or live.cut.client.is_dead:
            close_dp_and_check(live)
        else:
            self._idle = live

    def close(self) -> None:
        live, self._idle = self._idle, None
        if live is not None:
            close_dp_and_check(live)


class DataParallelStateMachine(RuleBasedStateMachine):
    """Random add/abort/broadcast/kill/restart/shutdown programs on a data-parallel client."""

    def __init__(self, pool: DPClientPool, *, kind: str = "sync", faults: bool = True,
                 exact_tokens: bool = True, vocab_size: int = 512,
                 stats: CampaignStats | None = None, min_life: int = 3) -> None:
        super().__init__()
        if kind not in DP_KINDS:
            raise ValueError(f"kind must be one of {DP_KINDS}, got {kind!r}")
        self.kind = kind
        self.faults = faults
        self.exact_tokens = exact_tokens
        self.vocab_size = vocab_size
        self.pool = pool
        self.stats = stats if stats is not None else pool.stats
        self.min_life = min_life
        self._program = [f"state = {type(self).__name__}()"]
        self.live: _DPLive | None = None
        self.oracle = DPOracle(exact_tokens=exact_tokens, engines=2)
        self.limits = RuleLimits()
        self.restarts = False
        self._ids = 0
        self._busy: str | None = None
        self._life = 0
        self.stats.examples += 1

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def cut(self) -> cf.ClientUnderTest:
        assert self.live is not None
        return self.live.cut

    @property
    def engines(self) -> int:
        return self.oracle.engines

    @property
    def alive(self) -> bool:
        return self.live is not None and self.oracle.phase is Phase.ALIVE

    @contextlib.contextmanager
    def _rule(self, name: str, args: dict[str, Any]) -> Iterator[None]:
        """As ``EngineClientStateMachine._rule``: counted, timed, written to the program."""
        self._busy = name
        self._life += 1
        self.stats.step(name)
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items() if k != "self")
        self._program.append(f"state.{name}({shown})")
        start = time.monotonic()
        try:
            yield
        except BaseException as e:
            self.stats.record_failure(name, e, self._program)
            raise
        self.stats.seconds[name] += time.monotonic() - start
        self._busy = None

    def _fresh_id(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    def _token(self, t: int) -> int:
        return t if t < self.vocab_size else 3 + (t - 3) % (self.vocab_size - 3)

    def _refusal(self) -> type[BaseException]:
        return EngineDeadError if self.oracle.phase is Phase.DEAD else ClientClosedError

    def _expect_raises(self, kinds: type[BaseException] | tuple[type[BaseException], ...],
                       fn: Callable[[], Any], what: str) -> BaseException:
        try:
            fn()
        except kinds as e:
            return e
        except BaseException as e:
            raise OracleViolation(
                f"{what}: raised {type(e).__name__}: {e}; expected {kinds}") from e
        raise OracleViolation(f"{what}: returned; expected {kinds}")

    def _poll(self, timeout: float) -> EngineCoreOutputs:
        batch = self.cut.get_output(timeout=timeout)
        if batch.outputs:
            self.oracle.observe(batch)
        return batch

    def _drain(self, ids: list[str] | None = None, bound: float = WAIT_S) -> None:
        deadline = time.monotonic() + bound
        if ids is None:
            ids = self.oracle.must_finish_ids()
        while True:
            left = [r for r in ids if not self.oracle.requests[r].finished]
            if not left:
                return
            if time.monotonic() > deadline:
                where = {r: self.oracle.placed.get(r) for r in left}
                raise OracleViolation(
                    f"drain: {left} did not finish within {bound} s (on engines {where};"
                    f" engines killed: {sorted(self.oracle.dead)}, paused="
                    f"{self.oracle.paused}, client {self.cut.client.state.name},"
                    f" engines {self._states()})")
            try:
                self._poll(0.2)
            except EngineDeadError:
                if self.oracle.phase is Phase.ALIVE:
                    raise OracleViolation(
                        f"get_output raised EngineDeadError with engines"
                        f" {self.oracle.serving()} alive (engines {self._states()})") from None
                return

    def _states(self) -> dict[int, str]:
        return {i: s.name for i, s in self.cut.client.engines.items()}

    def _pending_calls(self) -> int:
        return int(self.cut.client.pending_utility_calls())

    def _wait_pending(self, n: int, call: concurrent.futures.Future[Any]) -> None:
        deadline = time.monotonic() + WAIT_S
        while self._pending_calls() < n:
            if time.monotonic() > deadline or call.done():
                raise OracleViolation(f"{self._pending_calls()} utility calls pending, not {n}"
                                      f" (the call done: {call.done()})")
            time.sleep(0.001)

    def _request(self, rid: str, prompt: list[int], max_tokens: int, seed: int,
                 stop_at: int | None, rank: int | None = None,
                 ignore_eos: bool = False) -> tuple[EngineCoreRequest, list[int] | None,
                                                   int | None]:
        expected, stop_ids, stop_index = None, [], None
        max_tokens = self.limits.cap(len(prompt), max_tokens)
        if self.exact_tokens:
            expected = null_tokens(seed, len(prompt), max_tokens, self.vocab_size)
            if stop_at is not None and stop_at < max_tokens:
                stop_ids = [expected[stop_at]]
                stop_index = expected.index(expected[stop_at])
        sp = SamplingParams(max_tokens=max_tokens, seed=seed, stop_token_ids=stop_ids,
                            ignore_eos=ignore_eos)
        return (EngineCoreRequest(rid, prompt, sp, data_parallel_rank=rank), expected,
                stop_index)

    def _send(self, req: EngineCoreRequest, expected: list[int] | None,
              stop_index: int | None, *, avoid: set[int] | None = None) -> None:
        self.cut.add_request(req)
        self.oracle.add(req.request_id, req.sampling_params.max_tokens, expected, stop_index,
                        rank=req.data_parallel_rank, avoid=avoid)

    # -- the client -------------------------------------------------------------------------

    @initialize(restarts=st.booleans())
    def start(self, restarts: bool) -> None:
        """Take a client (from the pool): ``restarts`` says whether it restarts dead engines."""
        self._program.append(f"state.start(restarts={restarts!r})")
        try:
            self._take_client(restarts)
        except BaseException as e:
            self.stats.record_failure("engine start", e, self._program)
            raise

    def _take_client(self, restarts: bool) -> None:
        self.live = self.pool.acquire(restarts)
        self.restarts = restarts
        client = self.live.cut.client
        self.limits = RuleLimits.of(client.config)
        self.oracle = DPOracle(exact_tokens=self.exact_tokens,
                               engines=int(client.data_parallel_size), dead=self.live.dead)
        self._life = 0

    # -- requests ---------------------------------------------------------------------------

    @precondition(lambda self: self.alive)
    @rule(prompt=st.lists(st.integers(3, 511), min_size=1, max_size=8),
          max_tokens=st.integers(1, 24), seed=st.integers(0, 2**31 - 1),
          stop_at=st.none() | st.integers(0, 23), pin=_PINS, reuse=st.integers(0, 7))
    def add(self, prompt: list[int], max_tokens: int, seed: int, stop_at: int | None,
            pin: int | None, reuse: int) -> None:
        with self._rule("add", locals()):
            if len(self.oracle.live_ids()) >= MAX_LIVE:
                _note(f"add: {MAX_LIVE} requests live already; skipped")
                return
            tokens = [self._token(t) for t in prompt][:self.limits.max_model_len - 1]
            done = self.oracle.finished_ids
            rid = done[-1 - reuse % len(done)] if reuse < 2 and done else self._fresh_id()
            rank = None if pin is None else pin % self.engines
            req, expected, stop_index = self._request(rid, tokens, max_tokens, seed, stop_at,
                                                      rank)
            if rank is not None and rank in self.oracle.dead:
                err = self._expect_raises(EngineDeadError, lambda: self.cut.add_request(req),
                                          f"an ADD pinned to dead engine {rank}")
                if f"engine {rank}" not in str(err):
                    raise OracleViolation(f"refusing an ADD pinned to dead engine {rank}: the"
                                          f" error does not name it: {err}")
                if rid in self.cut.client.live_requests():
                    raise OracleViolation(f"{rid!r} refused yet live in the client")
                return
            self._send(req, expected, stop_index)

    @precondition(lambda self: self.alive)
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def add_duplicate(self, pick: int) -> None:
        with self._rule("add_duplicate", locals()):
            live = self.oracle.live_ids()
            if not live:
                _note("add_duplicate: no request is live")
                return
            rid = live[pick % len(live)]
            req = EngineCoreRequest(rid, [5, 6], SamplingParams(max_tokens=2))
            self._expect_raises(SpecViolation, lambda: self.cut.add_request(req),
                                f"re-adding live id {rid!r}")

    @precondition(lambda self: self.live is not None and self.oracle.phase is not Phase.CLOSED)
    @rule(which=st.sampled_from(["live", "finished", "unknown", "mixed"]),
          pick=st.integers(0, MAX_LIVE - 1))
    def abort(self, which: str, pick: int) -> None:
        with self._rule("abort", locals()):
            live, done = self.oracle.live_ids(), self.oracle.finished_ids
            ids: list[str] = []
            if which in ("live", "mixed") and live:
                ids.append(live[pick % len(live)])
            if which in ("finished", "mixed") and done:
                ids.append(done[pick % len(done)])
            if which in ("unknown", "mixed") or not ids:
                ids.append(f"never-sent-{pick}")
            self.cut.abort_requests(ids)  # to each owner; silent for a dead one
            self.oracle.abort(ids)

    @precondition(lambda self: self.live is not None)
    @rule()
    def drain(self) -> None:
        with self._rule("drain", locals()):
            if self.oracle.phase is Phase.CLOSED:
                self._expect_raises(ClientClosedError, lambda: self.cut.get_output(timeout=0.01),
                                    "get_output after shutdown")
                return
            self._drain()
            if self.oracle.phase is Phase.DEAD:
                self._expect_raises(EngineDeadError, lambda: self.cut.get_output(timeout=0.01),
                                    "get_output with no engine left")

    @precondition(lambda self: self.live is not None)
    @rule()
    def poll(self) -> None:
        with self._rule("poll", locals()):
            if self.oracle.phase is Phase.CLOSED:
                self._expect_raises(ClientClosedError, lambda: self.cut.get_output(timeout=0.01),
                                    "get_output after shutdown")
                return
            try:
                self._poll(0.005)
            except EngineDeadError:
                if self.alive:
                    raise OracleViolation(
                        f"get_output raised EngineDeadError with engines"
                        f" {self.oracle.serving()} alive") from None

    # -- utilities --------------------------------------------------------------------------

    @precondition(lambda self: self.live is not None)
    @rule(value=_JSONISH)
    def echo(self, value: Any) -> None:
        """A one-engine utility: it goes to a serving engine, whichever died."""
        with self._rule("echo", locals()):
            if not self.alive:
                self._expect_raises(self._refusal(), lambda: self.cut.call_utility("echo", value),
                                    "echo on a dead/closed client")
                return
            got = self.cut.call_utility("echo", value)
            if got != value:
                raise OracleViolation(f"echo({value!r}) returned {got!r}")

    @precondition(lambda self: self.live is not None)
    @rule(value=st.integers(-5, 5))
    def echo_all(self, value: int) -> None:
        """``call_utility_all``: one reply per serving engine, in index order."""
        with self._rule("echo_all", locals()):
            def call() -> Any:
                return self.cut._call("call_utility_all", "echo", value)

            if not self.alive:
                self._expect_raises(self._refusal(), call, "call_utility_all on a dead/closed"
                                    " client")
                return
            got = call()
            want = [value] * len(self.oracle.serving())
            if got != want:
                raise OracleViolation(f"call_utility_all('echo', {value}) returned {got!r} with"
                                      f" engines {self.oracle.serving()} serving; want {want}")

    @precondition(lambda self: self.live is not None)
    @rule()
    def failing_utility(self) -> None:
        with self._rule("failing_utility", locals()):
            kind = UtilityError if self.alive else self._refusal()
            self._expect_raises(kind, lambda: self.cut.call_utility("_no_such_method"),
                                "an unknown utility")

    # -- broadcast: sleep, wake, pause, resume ----------------------------------------------

    def _work_in_flight(self, mode: str) -> None:
        """A wait-mode pause drains something: one long routed request."""
        if mode != "wait" or self.oracle.paused or len(self.oracle.live_ids()) >= MAX_LIVE:
            return
        req, expected, _ = self._request(self._fresh_id(), [5, 6, 7], WAIT_MODE_TOKENS, 11,
                                         None, ignore_eos=True)
        self._send(req, expected, None)

    def _after_pause(self, mode: str, level: int | None) -> None:
        drained = self.oracle.pause(mode, level)
        if mode != "wait" or not drained:
            return
        # Every engine replied once idle, after the outputs it drained: those are queued in
        # the members now, and nothing more comes while they are paused. Read them all.
        deadline = time.monotonic() + WAIT_S
        with contextlib.suppress(EngineDeadError):
            while self.cut.client.queued_outputs() and time.monotonic() < deadline:
                self._poll(0.05)
        early = [r for r in drained if not self.oracle.requests[r].finished]
        if early:
            raise OracleViolation(f"sleep/pause(wait) replied before {early} finished")

    @precondition(lambda self: self.live is not None)
    @rule(level=st.sampled_from([0, 1, 2]), mode=st.sampled_from(["abort", "wait", "keep"]))
    def sleep(self, level: int, mode: str) -> None:
        with self._rule("sleep", locals()):
            if not self.alive:
                self._expect_raises(self._refusal(), lambda: self.cut.sleep(level, mode),
                                    "sleep on a dead/closed client")
                return
            self._work_in_flight(mode)
            self.cut.sleep(level, mode)
            self._after_pause(mode, level)
            members = [self.cut.client.engine_client(i) for i in self.oracle.serving()]
            awake = [i for i, m in zip(self.oracle.serving(), members, strict=True)
                     if m is None or m.state is not ClientState.SLEEPING]
            if awake:
                raise OracleViolation(f"sleep() returned yet engines {awake} are not asleep")
            if not self.cut.is_sleeping():
                raise OracleViolation("is_sleeping() is False right after sleep()")

    @precondition(lambda self: self.alive)
    @rule(mode=st.sampled_from(["abort", "wait", "keep"]))
    def pause(self, mode: str) -> None:
        with self._rule("pause", locals()):
            self._work_in_flight(mode)
            self.cut._call("pause_scheduler", mode)
            self._after_pause(mode, None)

    @precondition(lambda self: self.live is not None)
    @rule(tags=_WAKE_TAG_SETS)
    def wake_up(self, tags: list[str] | None) -> None:
        with self._rule("wake_up", locals()):
            if not self.alive:
                self._expect_raises(self._refusal(), lambda: self.cut.wake_up(tags),
                                    "wake_up on a dead/closed client")
                return
            want = self.oracle.expect_wake(tags)
            got = self.cut.wake_up(tags)
            if got is not want:
                raise OracleViolation(f"wake_up({tags}) returned {got}; the model says {want}"
                                      f" (asleep: {sorted(self.oracle.asleep_tags)})")
            self.oracle.wake(tags)
            if want and self.cut.is_sleeping():
                raise OracleViolation("is_sleeping() is True after a full wake_up")

    @precondition(lambda self: self.alive)
    @rule()
    def resume(self) -> None:
        with self._rule("resume", locals()):
            if self.oracle.resume_allowed():
                self.cut._call("resume_scheduler")
                self.oracle.resume()
            else:
                self._expect_raises(UtilityError, lambda: self.cut._call("resume_scheduler"),
                                    "resume_scheduler while asleep")

    # -- losing an engine -------------------------------------------------------------------

    @precondition(lambda self: self.alive and self.faults and self._life >= self.min_life
                  # a replacement comes up awake: the model keeps one pause state for all
                  and not (self.restarts and self.oracle.paused))
    @rule(pick=st.integers(0, 3), observers=st.booleans(),
          how=st.sampled_from(["sigkill", "sigstop"]))
    def kill_engine(self, pick: int, observers: bool, how: str = "sigkill") -> None:
        """SIGKILL one serving engine, or SIGSTOP it and leave it stopped (alive, silent:
        only the heartbeat deadline, ``STOP_HEARTBEAT_TIMEOUT_S``, reveals it). With
        ``observers`` a ``call_utility_all`` is held pending on it (SIGSTOP first): it must
        raise EngineDeadError naming the engine. A long request pinned to it first is live
        when it dies: it must end with ERROR."""
        with self._rule("kill_engine", locals()):
            serving = self.oracle.serving()
            k = serving[pick % len(serving)]
            client = self.cut.client
            old = client.engine_client(k).engine_pid
            assert old is not None
            self.stats.faults[f"engine_{how}"] += 1
            if not self.oracle.paused and len(self.oracle.live_ids()) < MAX_LIVE:
                req, expected, _ = self._request(
                    self._fresh_id(), [4, 5, 6], self.limits.cap(3, DOOMED_TOKENS), 3, None,
                    rank=k, ignore_eos=True)
                self._send(req, expected, None)
            pending: concurrent.futures.Future[Any] | None = None
            if observers or how == "sigstop":
                cf.stop_process(old)
            if observers:
                try:
                    pending = self.cut.submit("call_utility_all", "echo", "pending")
                    self._wait_pending(1, pending)
                except BaseException:
                    os.kill(old, signal.SIGKILL)
                    raise
            if how == "sigkill":
                os.kill(old, signal.SIGKILL)
            # A stopped engine is left stopped: its client's teardown resumes and ends it.
            start = time.monotonic()
            bound = DEATH_BOUND_S + 3 + (STOP_HEARTBEAT_TIMEOUT_S if how == "sigstop" else 0)
            # Told at once: outputs read from here on may show the death.
            self.oracle.engine_died(k, restarted=self.restarts)
            assert self.live is not None
            if not self.restarts:
                self.live.dead.add(k)
            if pending is not None:
                self._pending_fails(pending, k, bound)
            self._await_membership(k, start, old, bound)
            self.live.note_pids()
            if self.restarts:
                self.stats.engines_started += 1
            elif self.oracle.phase is Phase.DEAD and not client.is_dead:
                raise OracleViolation("every engine is dead, yet the client is"
                                      f" {client.state.name}")
            # Its requests end (ERROR, after its queued batches) soon after the death is seen.
            self._drain(sorted(self.oracle.doomed), bound=bound)
            self._drain()

    def _pending_fails(self, fut: concurrent.futures.Future[Any], k: int, bound: float
                       ) -> None:
        try:
            got = fut.result(timeout=bound)
        except EngineDeadError as e:
            if f"engine {k} of {self.engines}" not in str(e):
                raise OracleViolation(f"a call pending on engine {k} when it died raised"
                                      f" EngineDeadError not naming it: {e}") from None
            return
        except concurrent.futures.TimeoutError:
            raise OracleViolation(f"a call pending on engine {k} was not woken by its"
                                  " death") from None
        raise OracleViolation(f"a call pending on engine {k} when it died returned {got!r}")

    def _await_membership(self, k: int, start: float, old: int, bound: float) -> None:
        """Until engine ``k``'s death is seen: DEAD, or (restarts) SERVING under a new pid,
        with an ADD routed while it was not serving; reads outputs meanwhile."""
        client = self.cut.client
        while client.engines[k] is MembershipState.SERVING and (
                client.engine_client(k) is not None
                and client.engine_client(k).engine_pid == old):
            if time.monotonic() > start + bound:
                raise OracleViolation(f"engine {k}'s death not seen within"
                                      f" {bound:g} s (engines {self._states()})")
            with contextlib.suppress(EngineDeadError):
                self._poll(0.01)
        if not self.restarts:
            if client.engines[k] is not MembershipState.DEAD:
                raise OracleViolation(f"engine {k} killed: membership {self._states()}")
            return
        if len(self.oracle.live_ids()) < MAX_LIVE:
            # Routed while engine k restarts: whatever serves it, it is not engine k's old
            # process nor (if k is still not serving once the ADD returned) engine k.
            req, expected, _ = self._request(self._fresh_id(), [8, 9], 4, 5, None)
            self.cut.add_request(req)
            away = client.engines[k] is not MembershipState.SERVING
            self.oracle.add(req.request_id, req.sampling_params.max_tokens, expected, None,
                            avoid={k} if away else set())
        deadline = time.monotonic() + RESTART_BOUND_S
        while True:
            member = client.engine_client(k)
            if (client.engines[k] is MembershipState.SERVING and member is not None
                    and member.engine_pid not in (None, old)):
                return
            if client.engines[k] is MembershipState.DEAD and member is None:
                raise OracleViolation(f"engine {k}'s replacement failed to start"
                                      f" ({self._states()})")
            if time.monotonic() > deadline:
                raise OracleViolation(f"engine {k} not SERVING again within"
                                      f" {RESTART_BOUND_S} s ({self._states()})")
            with contextlib.suppress(EngineDeadError):
                self._poll(0.02)

    # -- shutdown and a new client ----------------------------------------------------------

    @precondition(lambda self: self.live is not None and self.oracle.phase is not Phase.CLOSED
                  and self._life >= 2 * self.min_life)
    @rule(with_pending=st.booleans())
    def shutdown(self, with_pending: bool) -> None:
        """Bounded, clean: a blocked read fails with ClientClosedError; every engine is
        reaped."""
        with self._rule("shutdown", locals()):
            assert self.live is not None
            pending: list[concurrent.futures.Future[Any]] = []
            if with_pending and self.alive:
                live = self.oracle.live_ids()
                if live:
                    self.cut.abort_requests(live)
                    self.oracle.abort(live)
                    self._drain(live)
                pending.append(self.cut.submit("get_output"))
                self.cut.call_utility("echo", 0)  # the read is waiting by now
            self.live.note_pids()
            start = time.monotonic()
            self.cut.client.shutdown()
            took = time.monotonic() - start
            for fut in pending:
                try:
                    fut.result(timeout=DEATH_BOUND_S + 3)
                except ClientClosedError:
                    continue
                except concurrent.futures.TimeoutError:
                    raise OracleViolation("a read blocked at shutdown was never woken") from None
                except BaseException as e:
                    raise OracleViolation(f"a read blocked at shutdown raised"
                                          f" {type(e).__name__}: {e}") from None
                raise OracleViolation("a read blocked at shutdown returned a value")
            if took > SHUTDOWN_BOUND_S:
                raise OracleViolation(f"shutdown took {took:.1f} s (bound {SHUTDOWN_BOUND_S} s)")
            self.oracle.closed()
            states = set(self.cut.client.engines.values())
            if states != {MembershipState.SHUT_DOWN}:
                raise OracleViolation(f"after shutdown the engines are {self._states()}")
            check_reaped(self.live.pids, self.live.before)

    @precondition(lambda self: self.live is not None and self.oracle.phase is not Phase.ALIVE)
    @rule()
    def new_client(self) -> None:
        with self._rule("new_client", locals()):
            self._finish_client(check=True)
            self._take_client(self.restarts)

    # -- invariants and teardown ------------------------------------------------------------

    @invariant()
    def client_matches_model(self) -> None:
        if self._busy is not None or self.live is None:
            return
        client = self.cut.client
        problem = None
        state = client.state
        allowed = self.oracle.expected_client_states()
        if state not in allowed:
            problem = (f"client is {state.name}; the model allows"
                       f" {sorted(s.name for s in allowed)}")
        elif self.oracle.phase is Phase.ALIVE:
            want = {i: (MembershipState.DEAD if i in self.oracle.dead
                        else MembershipState.SERVING) for i in range(self.engines)}
            if client.engines != want:
                problem = (f"engines are {self._states()}; the model says"
                           f" {({i: s.name for i, s in want.items()})}")
        if problem is not None:
            err = OracleViolation(problem)
            self.stats.record_failure("invariant client_matches_model", err, self._program)
            raise err

    def _record_trace(self) -> None:
        trace = self.cut.trace
        if trace is None:
            return
        self.stats.coverage.add(trace)
        try:
            check_traces(trace)
        finally:
            del trace[:]

    def _finish_client(self, *, check: bool) -> None:
        live = self.live
        if live is None:
            return
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.oracle.max_in_flight)
        try:
            close_dp_and_check(live, check=check)
        finally:
            self._record_trace()
            self.live = None

    def teardown(self) -> None:
        self._program.append("state.teardown()")
        try:
            self._teardown()
        except BaseException as e:
            self.stats.record_failure("teardown", e, self._program)
            raise

    def _teardown(self) -> None:
        live = self.live
        if live is None:
            return
        try:
            if self._busy is not None:
                _note(f"rule {self._busy} did not finish; discarding its client")
                self._finish_client(check=False)
                return
            if self.oracle.phase is not Phase.ALIVE:
                self._finish_client(check=True)
                return
            self._drain()
            if self._pending_calls():
                raise OracleViolation(f"{self._pending_calls()} utility call(s) still pending")
            left = self.oracle.live_ids()
            if left:
                self.cut.abort_requests(left)
                self.oracle.abort(left)
            if self.oracle.paused:
                if self.cut.wake_up(None) is not True:
                    raise OracleViolation("wake_up(None) at teardown was not full")
                self.oracle.wake(None)
            self._drain(self.oracle.live_ids())
            if self.oracle.phase is not Phase.ALIVE:
                raise OracleViolation("an engine died during teardown")
            unfinished = [r for r, m in self.oracle.requests.items() if not m.finished]
            if unfinished:
                raise OracleViolation(f"requests never ended: {unfinished}")
            self._record_trace()
        except BaseException:
            with contextlib.suppress(Exception):
                self._finish_client(check=False)
            raise
        self.live = None
        self.pool.release(live)
