"""Several front ends over shared engines (issue 47): ``FrontEndsEngine``, engines started on
their own that each serve ``K`` front ends at once (one address pair per front end), and
``FrontEndsStateMachine``, the campaign machine that drives two front ends over them.

Theory of operation
-------------------
Two front ends, each an ordinary client in this process (sync or async, drawn at each
attach), attach to the same engine (or to the same data-parallel group of engines) under
``client_index`` 0 and 1, and the rules act from either one: ``add``, ``abort``, ``echo``,
``sleep`` and ``wake_up`` (engine-wide: the other front end is told), ``poll`` and
``drain``. Front end 1 can go (``crash``: without a word, as a SIGKILLed process leaves its
socket, or with its goodbye, never aborting what it leaves) and come back under the same
index (``restart``). The fault matrix (``fault_matrix_fe.py``) kills and stops front-end
*processes*; this machine makes the loss cheap enough to draw many times per example.

The model is one ``_FrontEnd`` per attached client (its requests, what it received) plus
the engine's power state; the oracle judges the properties of ``spec/compose_fe.py`` on the
real engines, with their names:

- **isolation**: every output a front end reads is for a request *it* sent and is still
  waiting for; the null model's tokens are exact and each front end draws its own seeds, so
  another front end's output under a shared id shows as a wrong token. Utility replies
  come back to their caller (``echo``'s value).
- **own-death-ends-own-requests**: once front end 1 went, its requests (long ones, running)
  end in the engine within the front-end timeout plus the engine's poll (``GONE_BOUND_S``),
  read from the survivor's ``get_stats``, while the survivor's requests run to their end,
  never ABORTed; the front end attached again under index 1 receives nothing of them.
- **exactly-once end at sender**: every request ends once at its sender (a second ending,
  or an output after the end, is a violation; the teardown's drain sees every one end),
  ABORT only where an abort could reach it (its own front end's, or a ``sleep(abort)``
  from either front end, which ends every live request of the engine).
- **power view converges**: after a sleep or a wake-up from either front end, and after an
  attach, every attached client's lifecycle (SLEEPING or not) becomes the engine's own
  (its ``is_sleeping``) within ``POWER_BOUND_S``.

Every wait is bounded; a failure prints the example as a program (``_rule``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from ..protocol.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason, SamplingParams
from ..protocol.records import EngineStats
from ..runtime.ipc import owned_tempdir
from ..spec.client import CLIENT_ASLEEP
from ..spec.errors import EngineDeadError, SpecViolation, UtilityError
from . import conformance as cf
from .bounds import SHUTDOWN_BOUND_S, WAIT_S
from .campaign_stats import CampaignStats
from .oracle import (
    OracleViolation,
    ResourceSnapshot,
    check_traces,
    engine_trace_entries,
    null_tokens,
)
from .pools import ensure_resource_tracker
from .stateful_base import safe_note
from .stateful_standalone import release_engine_dir

__all__ = ["FRONT_ENDS", "FrontEndsEngine", "FrontEndsStateMachine", "fe_config"]

FRONT_ENDS = 2  # the machine's front ends: index 0 stays, index 1 can go and come back
FE_KINDS = ("sync", "async")
# The engine's deadline on a silent front end (``front_end_timeout_s``), and its beat. A
# client beats at a quarter of the deadline. At 1 s a 2-core machine at load 6 saw a live
# front end's beats stall past it: the engine took it for gone and, as spec/session.py
# says, dropped its input unread (a false loss, its next call unanswered); 2 s costs a
# silent loss 2 s.
FE_TIMEOUT_S = 2.0
ENGINE_HEARTBEAT_S = 0.1
# A silent front end's requests end within its deadline plus the engine's poll of it and a
# loaded machine's slack; a goodbye ends them at once, judged by the same bound.
GONE_BOUND_S = FE_TIMEOUT_S + 3.0
# The null model's step time here: a left-behind request (LEFT_TOKENS) then runs for longer
# than GONE_BOUND_S on its own (8 s), so only the engine ending it can end it within the bound.
STEP_DELAY_S = 0.004
LEFT_TOKENS = 2000
POWER_BOUND_S = 5.0
MAX_LIVE_PER_FE = 6
PROMPT = st.lists(st.integers(3, 511), min_size=1, max_size=6)


def fe_config(config: Any) -> Any:
    """``config`` (the campaign's, ``campaign._config``) with the null model's steps slowed
    to ``STEP_DELAY_S`` (see LEFT_TOKENS); another model's as it is."""
    if getattr(config, "model", None) == "null":
        config = msgspec.structs.replace(config, null_step_delay_s=STEP_DELAY_S)
    return config


class FrontEndsEngine:
    """``engines`` engine processes started on their own, each serving ``front_ends`` front
    ends at once (``process_main`` with one address pair per front end, what ``enginewire
    engine --input-address A0 --output-address B0 --input-address A1 ...`` runs). ``attach``
    builds front end ``index``'s client: a one-engine client, or a data-parallel one over
    every engine's pair ``index``. ``close`` stops the engines (SIGTERM) and checks that each
    exited cleanly and that nothing was left behind."""

    def __init__(self, config: Any, *, front_ends: int = FRONT_ENDS, engines: int = 1) -> None:
        import multiprocessing

        from ..runtime.engine_proc import process_main

        ensure_resource_tracker()
        self.config = config
        self.front_ends = front_ends
        self.engines = engines
        self.before = ResourceSnapshot.take()
        self.dir = str(owned_tempdir("enginewire-frontends-"))
        # pairs[e][i]: engine e's address pair for front end i.
        self.pairs = [[(f"ipc://{self.dir}/e{e}-in{i}", f"ipc://{self.dir}/e{e}-out{i}")
                       for i in range(front_ends)] for e in range(engines)]
        mp = multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        try:
            for e in range(engines):
                kwargs: dict[str, Any] = {
                    "input_address": [p[0] for p in self.pairs[e]],
                    "output_address": [p[1] for p in self.pairs[e]],
                    "engine_index": e, "heartbeat_interval_s": ENGINE_HEARTBEAT_S,
                    "front_end_timeout_s": FE_TIMEOUT_S,
                    # These engines wait for front ends without a deadline: a campaign
                    # killed before close() must not leave them running.
                    "parent_pid": os.getpid()}
                proc = mp.Process(target=process_main, name=f"FrontEndsEngine-{e}",
                                  daemon=True,
                                  args=(type(config), msgspec.msgpack.encode(config), kwargs))
                proc.start()
                self.procs.append(proc)
        except BaseException:
            self.close(check=False)
            raise
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def attach(self, index: int, kind: str) -> cf.ClientUnderTest:
        """Front end ``index``'s client, of ``kind`` (sync or async), attached."""
        if kind not in FE_KINDS:
            raise ValueError(f"a front end is one of {FE_KINDS}, not {kind!r}")
        if not 0 <= index < self.front_ends:
            raise ValueError(f"front end {index}: the engines serve {self.front_ends}")
        options: dict[str, Any] = {"launch_engine": False, "client_index": index,
                                   "ready_timeout_s": WAIT_S,
                                   "engine_heartbeat_timeout_s": 2 * POWER_BOUND_S}
        if self.engines == 1:
            options["input_address"], options["output_address"] = self.pairs[0][index]
        else:
            options["input_address"] = [self.pairs[e][index][0] for e in range(self.engines)]
            options["output_address"] = [self.pairs[e][index][1] for e in range(self.engines)]
        return cf.open_client(kind, self.config, **options)

    def close(self, *, check: bool = True) -> None:
        """Stop the engines; with ``check``, OracleViolation if anything was left behind."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        problems: list[str] = []
        for proc in self.procs:
            if not proc.is_alive():
                problems.append(f"engine {proc.name} died under its front ends (exit code"
                                f" {proc.exitcode})")
                continue
            os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            proc.join(SHUTDOWN_BOUND_S)
            if proc.is_alive():
                problems.append(f"engine {proc.name} ignored SIGTERM for {SHUTDOWN_BOUND_S} s")
                proc.kill()
                proc.join(WAIT_S)
            elif proc.exitcode not in (0, None) and not any(proc.name in p for p in problems):
                problems.append(f"engine {proc.name} exited with {proc.exitcode} on SIGTERM")
            with contextlib.suppress(ValueError):
                proc.close()
        release_engine_dir(self.dir, problems, check, self.before, None)


@dataclass
class _Request:
    rid: str
    max_tokens: int
    expected: list[int] | None
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    # Whether an abort could reach it: its own front end's, or a sleep(abort) from either.
    may_abort: bool = False
    # Left running as its front end went (``crash``): nobody reads it, the engine ends it.
    left: bool = False


@dataclass
class _FrontEnd:
    """One attached client and what its model expects of it."""

    index: int
    incarnation: int
    cut: cf.ClientUnderTest
    requests: dict[str, _Request] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"front end {self.index} (incarnation {self.incarnation}, {self.cut.kind})"

    def live(self) -> list[str]:
        return [r for r, m in self.requests.items() if m.finish is None]


class FrontEndsStateMachine(RuleBasedStateMachine):
    """Two front ends over one ``FrontEndsEngine`` (one engine, or a data-parallel group);
    see the module docstring. ``exact_tokens``: the null model's tokens are known."""

    def __init__(self, engine: FrontEndsEngine, *, exact_tokens: bool = True,
                 vocab_size: int | None = None, stats: CampaignStats | None = None) -> None:
        from ..runtime.model import TINY_ARCH

        super().__init__()
        self.engine = engine
        self.exact_tokens = exact_tokens
        # The token ids prompts are drawn from (the campaign's ``_vocab_size``): the tiny
        # model's range by default, which every built-in model has.
        self.vocab_size = TINY_ARCH.vocab_size if vocab_size is None else vocab_size
        self.stats = stats if stats is not None else CampaignStats()
        self._program = [f"state = {type(self).__name__}(engine)"]
        self.stats.examples += 1
        self.asleep = False  # the engine's power state, as the model has it
        self._incarnations = [0] * engine.front_ends
        self._ids = [0] * engine.front_ends  # per index: a restarted front end goes on
        # Ids a gone incarnation of each index used: none may reach its successor.
        self._foreign: list[set[str]] = [set() for _ in range(engine.front_ends)]
        self.fes: list[_FrontEnd | None] = [None] * engine.front_ends
        self._busy: str | None = None
        try:
            for i in range(engine.front_ends):
                self._attach(i, "sync" if i == 0 else "async")
        except BaseException:
            self._close_all(check=False)
            raise

    # -- plumbing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _rule(self, name: str, args: dict[str, Any]) -> Iterator[None]:
        self._busy = name
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

    def _fe(self, index: int) -> _FrontEnd:
        """Front end ``index``, or the other one while it is gone (a drawn index must not
        depend on timing: which front end is attached is the model's, so this replays)."""
        fe = self.fes[index]
        if fe is None:
            fe = self.fes[1 - index]
        assert fe is not None, "front end 0 never goes"
        return fe

    def _attach(self, index: int, kind: str) -> _FrontEnd:
        start = time.monotonic()
        cut = self.engine.attach(index, kind)
        self.stats.seconds["(attach)"] += time.monotonic() - start
        self._incarnations[index] += 1
        fe = _FrontEnd(index, self._incarnations[index], cut)
        self.fes[index] = fe
        return fe

    def _stats(self, fe: _FrontEnd) -> list[EngineStats]:
        got = fe.cut.call_utility("get_stats", timeout=WAIT_S)
        replies = got if isinstance(got, list) else [got]
        for s in replies:
            if not isinstance(s, EngineStats):
                raise OracleViolation(f"get_stats replied no EngineStats: {s!r:.200}")
        return replies

    def _engine_live(self, fe: _FrontEnd) -> int:
        return sum(s.num_live for s in self._stats(fe))

    def _engine_trace(self, fe: _FrontEnd) -> None:
        """The engines' own traces (their sessions, requests, power), drained through ``fe``:
        every step in the spec, and counted toward coverage. Off where they record none."""
        if self.stats.engine_untraced:
            return
        try:
            got = fe.cut.call_utility("drain_trace", timeout=WAIT_S)
        except UtilityError as e:
            if "records no trace" not in str(e):
                raise
            self.stats.engine_untraced = True
            return
        for reply in got if isinstance(got, list) else [got]:
            entries = engine_trace_entries(reply)
            check_traces(entries)
            self.stats.coverage.add(entries)
        self.stats.engine_drains += 1

    # -- the oracle ---------------------------------------------------------------------------

    def _observe(self, fe: _FrontEnd, batch: EngineCoreOutputs) -> None:
        for out in batch.outputs:
            rid = out.request_id
            m = fe.requests.get(rid)
            if m is None:
                whose = ("a request of the incarnation it replaced"
                         if rid in self._foreign[fe.index] else
                         "an id it never sent (another front end's?)")
                raise OracleViolation(f"isolation: {fe.name} received an output for {rid!r},"
                                      f" {whose}")
            if m.finish is not None:
                raise OracleViolation(
                    f"exactly-once: {fe.name} received an output for {rid!r} after it ended"
                    f" {m.finish.name} (now {out.finish_reason!r}, {len(out.new_token_ids)}"
                    " token(s))")
            m.tokens.extend(out.new_token_ids)
            if len(m.tokens) > m.max_tokens:
                raise OracleViolation(f"{fe.name}: {rid!r} got {len(m.tokens)} tokens, past"
                                      f" its max_tokens {m.max_tokens}")
            if m.expected is not None and m.tokens != m.expected[:len(m.tokens)]:
                raise OracleViolation(
                    f"isolation: {fe.name}'s {rid!r} got tokens {m.tokens[-8:]} where the null"
                    f" model gives {m.expected[max(0, len(m.tokens) - 8):len(m.tokens)]}"
                    " (another front end's output under the same id?)")
            if out.finish_reason is None:
                continue
            reason = FinishReason(out.finish_reason)
            m.finish = reason
            if reason is FinishReason.ABORT:
                if not m.may_abort:
                    raise OracleViolation(
                        f"own-death-ends-own-requests: {fe.name}'s {rid!r} ended ABORT after"
                        f" {len(m.tokens)} tokens, though no abort of its own and no"
                        " sleep(abort) could reach it (another front end's loss or abort?)")
            elif reason is FinishReason.LENGTH:
                if len(m.tokens) != m.max_tokens:
                    raise OracleViolation(f"{fe.name}: {rid!r} ended LENGTH after"
                                          f" {len(m.tokens)} of {m.max_tokens} tokens")
            else:
                raise OracleViolation(f"{fe.name}: {rid!r} ended {reason.name}"
                                      f" ({out.error or 'no error'})")

    def _poll(self, fe: _FrontEnd, timeout: float) -> None:
        try:
            batch = fe.cut.get_output(timeout=timeout)
        except EngineDeadError as e:
            raise OracleViolation(f"{fe.name}: the engine died under it ({e})") from e
        except SpecViolation as e:
            # The client's own tracking refused what the engine sent: an output for an id it
            # does not know (now). The property it breaks, named from the model.
            raise OracleViolation(f"{self._refused_property(fe, str(e))}: {fe.name}'s client"
                                  f" refused an output the spec forbids: {e}") from e
        self._observe(fe, batch)

    def _refused_property(self, fe: _FrontEnd, message: str) -> str:
        """Which property an output ``fe``'s client refused breaks: isolation when one of the
        ids it names (``"for request id(s) 'a', 'b'"``) was never sent by ``fe``, or when a
        token output (not an ending) came for an id ``fe`` finished and the other front end
        has live; else exactly-once (a second ending, or an output after the end)."""
        named = message.partition("for request id(s) ")[2].partition(" (")[0]
        event = re.search(r"event (\w+) is not allowed", message)
        ending = event is not None and event.group(1).startswith("FINISH")
        other = self.fes[1 - fe.index]
        for rid in re.findall(r"'([^']*)'", named):
            mine = fe.requests.get(rid)
            theirs = None if other is None else other.requests.get(rid)
            if mine is None or (not ending and theirs is not None and theirs.finish is None):
                return "isolation"
        return "exactly-once"

    def _drain(self, fe: _FrontEnd, ids: list[str] | None = None,
               bound: float = WAIT_S) -> None:
        """Read ``fe``'s outputs until ``ids`` (its live requests) ended."""
        want = fe.live() if ids is None else ids
        deadline = time.monotonic() + bound
        while True:
            left = [r for r in want if fe.requests[r].finish is None]
            if not left:
                return
            if time.monotonic() > deadline:
                raise OracleViolation(
                    f"exactly-once: {fe.name}'s {left} did not end within {bound} s (engine"
                    f" asleep: {self.asleep}; outputs routed elsewhere?)")
            self._poll(fe, 0.2)

    def _check_power_view(self, what: str) -> None:
        """power view converges: every attached client's lifecycle says what the engine is."""
        fe0 = self._fe(0)
        engine = bool(fe0.cut.call_utility("is_sleeping", timeout=WAIT_S))
        if engine is not self.asleep:
            raise OracleViolation(f"after {what}: the engine's is_sleeping() is {engine}; the"
                                  f" model has it {'asleep' if self.asleep else 'awake'}")
        for fe in self.fes:
            if fe is None:
                continue
            deadline = time.monotonic() + POWER_BOUND_S
            while (fe.cut.client.lifecycle.state in CLIENT_ASLEEP) is not engine:
                if time.monotonic() > deadline:
                    raise OracleViolation(
                        f"power view converges: {POWER_BOUND_S} s after {what}, {fe.name}"
                        f" is {fe.cut.client.lifecycle.state.name} while the engine is"
                        f" {'asleep' if engine else 'awake'}")
                time.sleep(0.005)

    # -- rules --------------------------------------------------------------------------------

    @rule(index=st.integers(0, 1), prompt=PROMPT, max_tokens=st.integers(1, 24),
          seed=st.integers(0, 2**20))
    def add(self, index: int, prompt: list[int], max_tokens: int, seed: int) -> None:
        """A request from front end ``index``; ids count per index, so the two front ends
        use the same ids at once (scoped per front end: two requests)."""
        with self._rule("add", locals()):
            fe = self._fe(index)
            if len(fe.live()) >= MAX_LIVE_PER_FE:
                safe_note(f"add: {fe.name} has {MAX_LIVE_PER_FE} live already; skipped")
                return
            self._add(fe, prompt, max_tokens, seed)

    def _add(self, fe: _FrontEnd, prompt: list[int], max_tokens: int, seed: int) -> str:
        self._ids[fe.index] += 1
        rid = f"r{self._ids[fe.index]}"
        prompt = [3 + (t - 3) % (self.vocab_size - 3) for t in prompt]
        # Each front end its own seeds: another's output under a shared id is a wrong token.
        seed = seed * FRONT_ENDS + fe.index
        expected = (null_tokens(seed, len(prompt), max_tokens, self.vocab_size)
                    if self.exact_tokens else None)
        fe.requests[rid] = _Request(rid, max_tokens, expected)
        fe.cut.add_request(EngineCoreRequest(rid, prompt, SamplingParams(
            max_tokens=max_tokens, seed=seed, ignore_eos=True)))
        return rid

    @rule(index=st.integers(0, 1), pick=st.integers(0, 7), unknown=st.booleans())
    def abort(self, index: int, pick: int, unknown: bool) -> None:
        """Front end ``index`` aborts one of its live requests (with an id it never sent
        first, which must touch nobody, not even another front end's request of that id)."""
        with self._rule("abort", locals()):
            fe = self._fe(index)
            live = fe.live()
            ids = [live[pick % len(live)]] if live else []
            if unknown:
                other = self._fe(1 - index)
                # An id only the other front end uses (or a fresh one): scoped, a no-op.
                theirs = [r for r in other.live() if r not in fe.requests]
                ids = [theirs[0] if theirs else "never-sent", *ids]
            for rid in ids:
                if rid in fe.requests:
                    fe.requests[rid].may_abort = True
            if ids:
                fe.cut.abort_requests(ids)

    @rule(index=st.integers(0, 1), value=st.integers(-(2**63), 2**63 - 1) | st.text(max_size=6))
    def echo(self, index: int, value: Any) -> None:
        """A utility round trip: the reply reaches its caller (call ids overlap across front
        ends), with its own value."""
        with self._rule("echo", locals()):
            fe = self._fe(index)
            got = fe.cut.call_utility("echo", [fe.index, value], timeout=WAIT_S)
            if got != [fe.index, value]:
                raise OracleViolation(f"isolation: {fe.name}'s echo({[fe.index, value]!r})"
                                      f" returned {got!r}")

    @rule(index=st.integers(0, 1))
    def poll(self, index: int) -> None:
        with self._rule("poll", locals()):
            self._poll(self._fe(index), 0.005)

    @rule(index=st.integers(0, 1))
    def drain(self, index: int) -> None:
        """Every live request of front end ``index`` ends (the engine awake); asleep, a read."""
        with self._rule("drain", locals()):
            fe = self._fe(index)
            if self.asleep:
                self._poll(fe, 0.01)
                return
            self._drain(fe)

    @precondition(lambda self: not self.asleep)
    @rule(index=st.integers(0, 1), level=st.sampled_from([0, 1, 2]),
          mode=st.sampled_from(["abort", "wait", "keep"]))
    def sleep(self, index: int, level: int, mode: str) -> None:
        """An engine-wide operation from one front end: the engine sleeps for everyone (an
        abort ends every front end's live requests), and every client is told."""
        with self._rule("sleep", locals()):
            fe = self._fe(index)
            if mode == "abort":
                for other in self.fes:
                    if other is not None:
                        for rid in other.live():
                            other.requests[rid].may_abort = True
            fe.cut._call("sleep", level, mode, timeout=WAIT_S)
            self.asleep = True
            if mode == "wait":
                # Replied once the engine had nothing live: everyone's requests ended.
                for other in self.fes:
                    if other is not None:
                        self._drain(other, bound=2.0)
            self._check_power_view(f"{fe.name}'s sleep({level}, {mode!r})")

    @precondition(lambda self: self.asleep)
    @rule(index=st.integers(0, 1))
    def wake_up(self, index: int) -> None:
        """A wake-up from either front end (not necessarily the one that slept)."""
        with self._rule("wake_up", locals()):
            fe = self._fe(index)
            if fe.cut._call("wake_up", None, timeout=WAIT_S) is not True:
                raise OracleViolation(f"{fe.name}'s wake_up(None) was not full")
            self.asleep = False
            self._check_power_view(f"{fe.name}'s wake_up()")

    @precondition(lambda self: self.fes[1] is not None and not self.asleep)
    @rule(how=st.sampled_from(["vanish", "goodbye"]), left=st.integers(1, 3))
    def crash(self, how: str, left: int) -> None:
        """Front end 1 goes with ``left`` long requests running: without a word (``vanish``:
        its socket closed, no goodbye, no abort, as a SIGKILLed process leaves it; the
        engine must see its heartbeat stop) or with its goodbye but no abort. Judged: its
        requests end in the engine within ``GONE_BOUND_S``, the survivor's run to their end."""
        with self._rule("crash", locals()):
            self.stats.faults[f"front_end_{how}"] += 1
            fe = self.fes[1]
            survivor = self._fe(0)
            assert fe is not None
            ids = [self._add(fe, [5, 6, 7], LEFT_TOKENS, 7) for _ in range(left)]
            for rid in ids:
                fe.requests[rid].left = True
            # Running in the engine before the front end goes: each streamed a token.
            deadline = time.monotonic() + WAIT_S
            while any(not fe.requests[r].tokens for r in ids):
                if time.monotonic() > deadline:
                    raise OracleViolation(f"isolation: {fe.name}'s long requests never"
                                          " streamed to it (sent elsewhere?)")
                self._poll(fe, 0.1)
                self._poll(survivor, 0.001)  # where a misrouted output would show
            self._go(fe, how)
            gone = time.monotonic()
            self._drain(survivor)
            while (n := self._engine_live(survivor)) != 0:
                if time.monotonic() - gone > GONE_BOUND_S:
                    raise OracleViolation(
                        f"own-death-ends-own-requests: {n} request(s) still live in the engine"
                        f" {time.monotonic() - gone:.1f} s after front end 1 went ({how}),"
                        f" with the survivor's all ended (bound {GONE_BOUND_S} s)")
                time.sleep(0.02)
            safe_note(f"crash: front end 1's work ended {time.monotonic() - gone:.2f} s after"
                      f" it went ({how})")
            self._engine_trace(survivor)

    def _go(self, fe: _FrontEnd, how: str) -> None:
        """``fe`` goes: its client shut down without aborting what it leaves (and, for
        ``vanish``, without its goodbye); its ids become foreign to its successor."""
        client = fe.cut.client
        # What a SIGKILLed front end leaves: its requests running, no ABORT sent.
        client.abort_left_behind = lambda _ids: None
        if how == "vanish":
            client._say_goodbye = lambda: None
        self._finish(fe, check=True)
        self._foreign[fe.index] |= set(fe.requests)
        self.fes[fe.index] = None

    @precondition(lambda self: self.fes[1] is None)
    @rule(kind=st.sampled_from(FE_KINDS))
    def restart(self, kind: str) -> None:
        """Front end 1 attaches again under its index: its power view is the engine's at
        once, and it receives nothing of its predecessor's (a probe reuses their ids)."""
        with self._rule("restart", locals()):
            fe = self._attach(1, kind)
            self._check_power_view("front end 1 attached again")
            if self.asleep:
                return
            # Probes under the predecessor's ids: an old output would be a wrong token.
            reused = sorted(self._foreign[1])[:2]
            for rid in reused:
                fe.requests[rid] = _Request(rid, 6, null_tokens(
                    99, 2, 6, self.vocab_size) if self.exact_tokens else None)
                fe.cut.add_request(EngineCoreRequest(rid, [8, 9], SamplingParams(
                    max_tokens=6, seed=99, ignore_eos=True)))
            self._drain(fe, reused)

    # -- teardown -----------------------------------------------------------------------------

    def _finish(self, fe: _FrontEnd, *, check: bool) -> None:
        """Shut ``fe``'s client down; judge its trace and, with ``check``, how long it took."""
        start = time.monotonic()
        fe.cut.shutdown()
        took = time.monotonic() - start
        if check and took > SHUTDOWN_BOUND_S:
            raise OracleViolation(f"{fe.name} took {took:.1f} s to shut down")
        if fe.cut.trace is not None:
            if check:
                check_traces(fe.cut.trace)
            self.stats.coverage.add(fe.cut.trace)

    def _close_all(self, *, check: bool) -> None:
        for i, fe in enumerate(self.fes):
            if fe is not None:
                self.fes[i] = None
                with contextlib.suppress(Exception):
                    self._finish(fe, check=check)

    def teardown(self) -> None:
        self._program.append("state.teardown()")
        try:
            if self._busy is None:
                self._settle()
        except BaseException as e:
            self.stats.record_failure("teardown", e, self._program)
            self._close_all(check=False)
            raise
        self._close_all(check=True)

    def _settle(self) -> None:
        """The hot obligations: the engine woken, every request ends exactly once at its
        sender, and nothing is left live in the engine."""
        fe0 = self._fe(0)
        if self.asleep:
            if fe0.cut._call("wake_up", None, timeout=WAIT_S) is not True:
                raise OracleViolation("wake_up(None) at teardown was not full")
            self.asleep = False
            self._check_power_view("the teardown's wake_up()")
        for fe in self.fes:
            if fe is not None:
                self._drain(fe)
        deadline = time.monotonic() + GONE_BOUND_S
        while (n := self._engine_live(fe0)) != 0:
            if time.monotonic() > deadline:
                raise OracleViolation(f"{n} request(s) still live in the engine with every"
                                      " front end's requests ended")
            time.sleep(0.02)
        self._engine_trace(fe0)
