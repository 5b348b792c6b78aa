"""``EngineClientStateMachine``: a Hypothesis stateful test of an EngineCoreClient and its engine.

Theory of operation
-------------------
Rule 1: preconditions and strategies read only the model (``Oracle``), never the live system,
so Hypothesis can replay and shrink. Where the live system may legitimately differ (an abort
racing a natural finish), the oracle holds the set of allowed observations.
Rule 2: every rule ends at a bounded synchronization point: a call returned, a future resolved,
outputs drained, a death seen. A bound that passes is a failure with a diagnostic, never a
retry.

The machine is parametrized by a client factory (like ``zarr.testing.stateful``), so it runs
against the built-in clients or your own engine::

    from hypothesis.stateful import run_state_machine_as_test
    from enginewire.testing.stateful import EngineClientStateMachine, builtin_factory

    factory = builtin_factory("sync", my_config)
    run_state_machine_as_test(lambda: EngineClientStateMachine(factory, kind="sync"))

Engines are expensive to start, so a ``ClientPool`` hands one healthy engine from example to
example: teardown aborts what is left, drains, wakes the engine and checks the liveness
obligations (every request ended, no utility call pending, the trace legal); only a crash or a
shutdown rule costs a new engine, and then teardown also checks that the engine process was
reaped and no thread, fd or ipc file leaked.

``StandaloneEngineStateMachine`` (at the end of this file) runs the same rules on front ends
attached to one engine started on its own (``StandaloneEngine``, what ``enginewire engine``
runs), and adds the handover: the front end goes, cleanly or without a word, and a new one
attaches and carries on under a fresh oracle.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SamplingParams,
)
from ..runtime.engine import WAKE_TAGS
from ..runtime.ipc import OWNER_FILE, owned_tempdir
from ..spec.engine import EngineState
from ..spec.errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
    SpecViolation,
    UtilityError,
    UtilityTimeoutError,
)
from . import conformance as cf
from .oracle import (
    Coverage,
    Oracle,
    OracleViolation,
    Phase,
    ResourceSnapshot,
    check_released,
    check_traces,
    null_tokens,
)

__all__ = [
    "AttachPool",
    "CampaignStats",
    "ClientPool",
    "EngineClientStateMachine",
    "RuleLimits",
    "StandaloneEngine",
    "StandaloneEngineStateMachine",
    "builtin_factory",
]

# A death must be seen within this bound (the runtime promises 1 s; slack for loaded CI).
DEATH_BOUND_S = 2.0
# Ordinary waits: a drain, a utility reply (null-model drains take milliseconds).
WAIT_S = 10.0
# A clean shutdown, SIGTERM to reaped, on a loaded machine.
SHUTDOWN_BOUND_S = 4.0
# Long enough that an abort sent right after its ADD lands first (null steps take tens of
# microseconds: thousands of tokens take far longer than the abort's trip). A config whose
# max_model_len allows fewer gets fewer (``RuleLimits``); see MIN_JUDGED_LONG_TOKENS.
LONG_MAX_TOKENS = 2000
# Below this many tokens a multi-process engine can finish an aborted request before the abort
# lands (the engine's input thread can wait a GIL switch interval, 5 ms, a few hundred null
# steps), so add_then_abort still races the abort but does not judge the ABORT ending.
MIN_JUDGED_LONG_TOKENS = 1000
# The longest prompt a rule sends (``add`` draws 1 to 8 tokens); fixed prompts have 2 or 3.
MAX_PROMPT = 8
# The shortest max_model_len the machine runs on: a 3-token fixed prompt and one token.
MIN_MODEL_LEN = 4
# The strict "abort right after ADD ends ABORT" check holds only when the client really sent
# the abort right after: a client descheduled longer than this between the two sends (a
# loaded CI machine) widens the allowed set to include a natural finish.
ABORT_GAP_S = 0.005
MAX_LIVE = 8
# The orphan check starts two interpreters (about a second): at most once per example, and
# only on an engine that has lived this many steps (the default of ``orphan_min_life``), so
# short or crash-heavy examples skip it.
ORPHAN_MIN_LIFE = 12
# The request a wait-mode pause drains: long enough to be running when the pause lands (null
# steps take tens of microseconds; the pause follows the ADD at once). Capped by
# max_model_len; a shorter one may finish first, which makes the drain trivial, not wrong.
WAIT_MODE_TOKENS = 500
# timed_out_utility: the call's timeout, and the engine-side delay of its reply. The margin
# between them is what a descheduled client thread may lose before the reply could beat the
# timeout (a false failure); the delay is also what the rule costs.
TIMEOUT_CALL_S = 0.01
TIMEOUT_REPLY_DELAY_S = 0.08

FaultCounter = Counter  # fault kind -> times injected


def _note(text: str) -> None:
    """``hypothesis.note`` inside a test; nothing when a reproducer runs as a plain program
    (where ``note`` raises)."""
    with contextlib.suppress(InvalidArgument):
        note(text)


@dataclass(frozen=True)
class RuleLimits:
    """What the engine config allows the rules, read once from the client's ``config``.

    Every request is sized so that ``max_model_len`` never ends it early: the oracle's LENGTH
    means exactly ``max_tokens`` tokens. A client without a config (or without a field) gets
    the built-in campaign's values."""

    max_model_len: int = LONG_MAX_TOKENS + MAX_PROMPT
    block_size: int = 16
    prefix_caching: bool = False

    @classmethod
    def of(cls, config: Any) -> RuleLimits:
        default = cls()
        return cls(int(getattr(config, "max_model_len", default.max_model_len)),
                   int(getattr(config, "block_size", default.block_size)),
                   bool(getattr(config, "enable_prefix_caching", False)))

    def cap(self, prompt_len: int, max_tokens: int) -> int:
        """``max_tokens``, or what max_model_len leaves after the prompt when that is less."""
        return max(1, min(max_tokens, self.max_model_len - prompt_len))

    @property
    def long_tokens(self) -> int:  # add_then_abort: a 3-token prompt
        return self.cap(3, LONG_MAX_TOKENS)

    @property
    def wait_tokens(self) -> int:  # the request a wait-mode pause drains: a 3-token prompt
        return self.cap(3, WAIT_MODE_TOKENS)

    @property
    def prefix_prompt_len(self) -> int | None:
        """prefix_cache_hit's prompt: one full block and one token more (None: cannot run)."""
        n = self.block_size + 1
        return n if self.prefix_caching and n < self.max_model_len else None

    def notes(self, multiprocess: bool) -> list[str]:
        """What this config changes in the rules, in words (a campaign prints them)."""
        out = []
        if self.long_tokens < LONG_MAX_TOKENS:
            judged = ("not judged: an abort can lose the race on a multi-process engine"
                      if multiprocess and self.long_tokens < MIN_JUDGED_LONG_TOKENS
                      else "still judged")
            out.append(f"add_then_abort: requests of {self.long_tokens} tokens, not"
                       f" {LONG_MAX_TOKENS} (max_model_len={self.max_model_len}); the ABORT"
                       f" ending is {judged}")
        if self.wait_tokens < WAIT_MODE_TOKENS:
            out.append(f"wait_mode/sleep(wait)/pause(wait): the drained request has"
                       f" {self.wait_tokens} tokens, not {WAIT_MODE_TOKENS}; it may finish"
                       " before the pause lands")
        if self.prefix_caching and self.prefix_prompt_len is None:
            out.append(f"prefix_cache_hit skipped: a {self.block_size + 1}-token prompt does not"
                       f" fit max_model_len={self.max_model_len}")
        return out


@dataclass
class CampaignStats:
    """Counters shared by every machine of a campaign (one process, one thread)."""

    steps: int = 0
    examples: int = 0
    engines_started: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    rules: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # rule -> s
    coverage: Coverage = field(default_factory=Coverage)
    max_in_flight: int = 0
    on_step: Callable[[], None] | None = None
    started: float = field(default_factory=time.monotonic)
    # (examples run, seconds since start) when the first failure was seen.
    first_failure: tuple[int, float] | None = None
    # The last few errors a rule or teardown raised, as "rule: Type: message". Hypothesis may
    # report a flaky replay (FlakyStrategyDefinition) instead of the error that ended it; the
    # campaign report shows these so the real failure is not lost.
    errors: list[str] = field(default_factory=list)
    # The program of the last example that failed, one ``state.rule(...)`` line per step: the
    # reproducer when Hypothesis reports a flaky replay instead of printing a shrunk one.
    failed_program: list[str] = field(default_factory=list)
    # How the engine config narrowed the rules (RuleLimits.notes), once per distinct note.
    limits_notes: list[str] = field(default_factory=list)

    def record_failure(self, where: str = "", error: BaseException | None = None,
                       program: list[str] | None = None) -> None:
        if self.first_failure is None:
            self.first_failure = (self.examples, time.monotonic() - self.started)
        if error is not None:
            self.errors = [*self.errors[-4:], f"{where}: {type(error).__name__}: {error}"]
        if program is not None:
            self.failed_program = list(program)

    def step(self, name: str) -> None:
        self.steps += 1
        self.rules[name] += 1
        if self.on_step is not None:
            self.on_step()


ClientFactory = Callable[..., cf.ClientUnderTest]


def builtin_factory(kind: str, config: Any, *, faults: bool = True) -> ClientFactory:
    """A factory for a built-in client with run-time fault arming when ``faults``.

    It meets the conformance ``ClientFactory`` contract: ``config=`` replaces ``config``,
    ``engine_fault=`` replaces the armable plan, ``engine_startup_delay_s=`` is passed on (the
    in-process client raises ``NotApplicable`` for the last two)."""
    from ..runtime.faults import FaultInjector, FaultPlan

    if kind not in cf.CLIENT_KINDS:  # now, not at the first example's engine start
        raise ValueError(f"kind must be one of {cf.CLIENT_KINDS}, got {kind!r}")

    def factory(**options: Any) -> cf.ClientUnderTest:
        built_with = options.pop("config", config)
        if faults and kind != "inproc":
            options.setdefault("engine_fault", FaultPlan(allow_arm=True))
        cut = cf.open_client(kind, built_with, **options)
        if faults and kind == "inproc":
            cut.client.engine.fault_hook = FaultInjector(FaultPlan(allow_arm=True))
        return cut

    # An in-process engine on CUDA creates the CUDA context in this process: some forty
    # driver fds that stay for the process's life. One engine runs a request and a sleep
    # cycle (host copies of the weights) before the first snapshot, so that what CUDA keeps
    # is there before and the leak check compares like with like (seen on an H200: "fds
    # leaked: 47 > 5" at the first restart without it).
    if kind == "inproc" and _resolved_device(config).startswith("cuda"):
        factory.warm_up = functools.partial(warm_up_engine, factory)  # type: ignore[attr-defined]
        factory.warm_up_key = ("inproc", _resolved_device(config))  # type: ignore[attr-defined]
    return factory


def warm_up_engine(factory: ClientFactory) -> None:
    """One client's life: a request to its end and a sleep/wake cycle, then shutdown."""
    cut = factory()
    try:
        cut.add_request(cf.request("warm-up", 2))
        cf.collect(cut, ["warm-up"])
        cut.sleep(1)
        cut.wake_up()
    finally:
        cut.shutdown()


def _resolved_device(config: Any) -> str:
    resolve = getattr(config, "resolved_device", None)
    return str(resolve()) if callable(resolve) else "cpu"


# warm_up_key of every factory warm-up this process ran: process-wide state is made once.
_WARMED: set[object] = set()


def warm_up_process(factory: Any) -> None:
    """Run ``factory.warm_up()`` once per process and key, where the factory declares one: a
    client whose first start creates state that outlives it (a CUDA context) builds one
    throwaway client first, so a leak check's snapshot already includes that state."""
    warm_up = getattr(factory, "warm_up", None)
    key = getattr(factory, "warm_up_key", warm_up)
    if warm_up is None or key in _WARMED:
        return
    warm_up()
    _WARMED.add(key)


@dataclass
class _Live:
    """One client incarnation and what its teardown must check."""

    cut: cf.ClientUnderTest
    before: ResourceSnapshot
    engine_pid: int | None
    ipc_path: str | None


class ClientPool:
    """Keeps one healthy client between examples; builds a new one when none is left."""

    def __init__(self, factory: ClientFactory, stats: CampaignStats) -> None:
        self.factory = factory
        self.stats = stats
        self._idle: _Live | None = None

    def acquire(self) -> _Live:
        if self._idle is not None:
            live, self._idle = self._idle, None
            return live
        if self.factory is not None:
            with contextlib.suppress(Exception):
                from multiprocessing import resource_tracker

                resource_tracker.ensure_running()  # process-wide, once: not a leak
            start = time.monotonic()
            warm_up_process(self.factory)
            self.stats.seconds["(engine start)"] += time.monotonic() - start
        before = ResourceSnapshot.take()
        start = time.monotonic()
        cut = self.factory()
        self.stats.engines_started += 1
        self.stats.seconds["(engine start)"] += time.monotonic() - start
        res = getattr(cut.client, "resources", None)
        ipc = getattr(getattr(res, "ipc_dir", None), "path", None)
        return _Live(cut, before, cut.engine_pid, None if ipc is None else str(ipc))

    def release(self, live: _Live) -> None:
        if self._idle is not None:
            close_and_check(self._idle)
        self._idle = live

    def close(self) -> None:
        if self._idle is not None:
            live, self._idle = self._idle, None
            close_and_check(live)


def close_and_check(live: _Live, *, check: bool = True) -> float:
    """Shut the client down; check that everything was released. Returns the seconds taken."""
    start = time.monotonic()
    live.cut.shutdown()
    took = time.monotonic() - start
    if check and took > SHUTDOWN_BOUND_S:
        raise OracleViolation(f"shutdown took {took:.1f} s (bound {SHUTDOWN_BOUND_S} s)")
    if check:
        check_released(live.before, engine_pid=live.engine_pid, ipc_path=live.ipc_path)
    return took


def _check_orphan_exits(config_kwargs: dict[str, Any]) -> None:
    """SIGKILL a client process; its engine must exit by itself within ORPHAN_BOUND_S. An
    engine that does not is killed here, so a failing check leaks nothing."""
    import subprocess
    import sys

    script = cf._ORPHAN_SCRIPT.format(config=config_kwargs, is_async=False)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    engine_pid = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise OracleViolation(f"orphan check: the client script failed: {line!r}")
        engine_pid = int(line)
        proc.kill()
        proc.wait(WAIT_S)
        deadline = time.monotonic() + cf.ORPHAN_BOUND_S
        while not cf._process_gone(engine_pid):
            if time.monotonic() > deadline:
                raise OracleViolation(
                    f"orphaned engine {engine_pid} still running {cf.ORPHAN_BOUND_S} s after"
                    " its client process was killed")
            time.sleep(0.02)
        engine_pid = None
    finally:
        if engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6,
)
_WAKE_TAG_SETS = st.one_of(st.none(), st.lists(st.sampled_from(WAKE_TAGS), unique=True,
                                                max_size=len(WAKE_TAGS)))
_MALFORMED = (
    [b"\x07\x90"],  # unknown request type
    [RequestType.ADD.value + b"\xc1"],  # not msgpack
    [RequestType.ABORT.value + b"\x91\x07"],  # ids must be strings
    [RequestType.ADD.value],  # a type byte and no payload
    [b"", b"", b""],  # empty frames, each a message of its own
    [RequestType.UTILITY.value + b"\x93\x00"],  # truncated
    [RequestType.ABORT.value + b"\x90", b"\x07stray"],  # a part nothing refers to
)


class EngineClientStateMachine(RuleBasedStateMachine):
    """Random add/abort/utility/sleep/pause/crash/shutdown sequences, judged by the oracle."""

    def __init__(
        self,
        factory: ClientFactory,
        *,
        kind: str = "sync",
        faults: bool = True,
        exact_tokens: bool | None = None,
        vocab_size: int = 512,
        pool: ClientPool | None = None,
        stats: CampaignStats | None = None,
        orphan_config: dict[str, Any] | None = None,
        min_life: int = 3,
        orphan_min_life: int = ORPHAN_MIN_LIFE,
    ) -> None:
        super().__init__()
        if kind not in cf.CLIENT_KINDS:
            raise ValueError(f"kind must be one of {cf.CLIENT_KINDS}, got {kind!r}")
        self.kind = kind
        self.faults = faults
        self.vocab_size = vocab_size
        self.stats = stats if stats is not None else CampaignStats()
        self.pool = pool if pool is not None else ClientPool(factory, self.stats)
        self._own_pool = pool is None
        self.orphan_config = orphan_config
        self.multiprocess = kind != "inproc"
        # This example as a program (Hypothesis' own printout of it is lost when it reports
        # the replay as flaky, as a timing-dependent failure can make it).
        self._program = [f"state = {type(self).__name__}()"]
        try:
            self.live = self.pool.acquire()
        except BaseException as e:  # before any draw: Hypothesis may call the run flaky
            self.stats.record_failure("engine start", e, self._program)
            raise
        config = getattr(self.cut.client, "config", None)
        self.limits = RuleLimits.of(config)
        try:
            # The rules pick their paths (process kills, wire faults, in-process engine rules)
            # by ``kind``; on a client of another kind they fail in ways that hide the cause.
            if self.cut.kind != kind:
                raise ValueError(f"kind={kind!r} but the factory built a {self.cut.kind!r}"
                                 f" client: pass kind={self.cut.kind!r} (or a {kind} factory)")
            self.exact_tokens = self._exact_tokens(exact_tokens, getattr(config, "model", None))
            if self.limits.max_model_len < MIN_MODEL_LEN:
                raise ValueError(f"EngineClientStateMachine needs max_model_len >= "
                                 f"{MIN_MODEL_LEN}; the client's config has"
                                 f" {self.limits.max_model_len}")
        except ValueError:
            close_and_check(self.live, check=False)
            raise
        for line in self.limits.notes(self.multiprocess):
            if line not in self.stats.limits_notes:
                self.stats.limits_notes.append(line)
            _note(line)
        # Tokens of prompts as the engine reported them cached (num_cached_tokens), by id.
        self._cached: dict[str, int] = {}
        self._prompt_lens: dict[str, int] = {}
        self.oracle = Oracle(exact_tokens=self.exact_tokens)
        self._ids = 0
        self._busy: str | None = None
        self._orphans = 0
        # Steps this engine incarnation has lived: crash and shutdown wait for ``min_life``
        # so that most steps run on a live engine (an engine start costs seconds).
        self._life = 0
        self.min_life = min_life
        self.orphan_min_life = orphan_min_life
        self.stats.examples += 1

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def cut(self) -> cf.ClientUnderTest:
        return self.live.cut

    @staticmethod
    def _exact_tokens(asked: bool | None, model: str | None) -> bool:
        """Only the null model's tokens can be predicted (``oracle.null_tokens``)."""
        if asked is None:
            return model == "null"
        if asked and model is not None and model != "null":
            raise ValueError(f"exact_tokens=True predicts the null model's tokens, but the"
                             f" client runs model={model!r}: pass exact_tokens=False (or leave"
                             " it None, which checks tokens for the null model only)")
        return asked

    def _token(self, t: int) -> int:
        """A drawn token id folded into the vocabulary (ids below 3 are reserved)."""
        if self.vocab_size <= 3:
            return t % self.vocab_size
        return t if t < self.vocab_size else 3 + (t - 3) % (self.vocab_size - 3)

    def _prompt(self, *tokens: int) -> list[int]:
        return [self._token(t) for t in tokens]

    @contextlib.contextmanager
    def _rule(self, name: str, args: dict[str, Any]) -> Iterator[None]:
        """Run rule ``name`` called with ``args`` (its ``locals()`` on entry): counted, timed,
        and written to this example's program, which a failure keeps as its reproducer."""
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

    def _full(self, rule: str, n: int = 1) -> bool:
        """Whether ``n`` more requests would pass MAX_LIVE. Checked in the rule, not in a
        precondition: how many are live depends on how far the engine got, and a rule choice
        that depends on timing cannot be replayed (Hypothesis reports it as flaky)."""
        if len(self.oracle.live_ids()) + n <= MAX_LIVE:
            return False
        _note(f"{rule}: {MAX_LIVE} requests live already; skipped")
        return True

    def _fresh_id(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    def _refusal(self) -> type[BaseException]:
        """What every call owes the caller once the engine died or the client was shut."""
        refusal: type[BaseException] = ClientClosedError
        if self.oracle.phase is Phase.DEAD:
            refusal = EngineDeadError
        return refusal

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

    def _observe(self, batch: EngineCoreOutputs) -> None:
        if batch.outputs:
            self.oracle.observe(batch)
            for out in batch.outputs:
                if out.num_cached_tokens:
                    self._check_cached(out.request_id, out.num_cached_tokens)

    def _check_cached(self, rid: str, cached: int) -> None:
        """num_cached_tokens: zero without prefix caching; else whole blocks of the prompt,
        leaving at least one token to compute."""
        block, n = self.limits.block_size, self._prompt_lens.get(rid)
        if not self.limits.prefix_caching:
            raise OracleViolation(f"{rid!r} reported num_cached_tokens={cached} with prefix"
                                  " caching off")
        if cached % block or (n is not None and cached >= n):
            raise OracleViolation(f"{rid!r} reported num_cached_tokens={cached}: not whole"
                                  f" {block}-token blocks of its {n}-token prompt, less one")
        self._cached[rid] = max(self._cached.get(rid, 0), cached)

    def _poll(self, timeout: float) -> EngineCoreOutputs:
        batch = self.cut.get_output(timeout=timeout)
        self._observe(batch)
        return batch

    def _drain(self, ids: list[str] | None = None, bound: float = WAIT_S) -> None:
        """Read outputs until every request that must finish did (or the death is seen)."""
        deadline = time.monotonic() + bound
        if ids is None:
            ids = self.oracle.must_finish_ids()
        while True:
            left = [r for r in ids if not self.oracle.requests[r].finished]
            if not left:
                return
            if time.monotonic() > deadline:
                raise OracleViolation(
                    f"drain: {left} did not finish within {bound} s (engine paused="
                    f"{self.oracle.paused}, client {self.cut.client.state.name})")
            try:
                self._poll(0.2)
            except EngineDeadError:
                if self.oracle.phase is Phase.ALIVE:
                    raise OracleViolation(
                        "the engine died without a fault being injected") from None
                self.oracle.died()
                return

    def _quiesce(self) -> None:
        """End every live request (abort, drain): no output can then reach a blocked read."""
        live = self.oracle.live_ids()
        if live:
            self.cut.abort_requests(live)
            self.oracle.abort(live)
            self._drain(live)

    def _arm(self, spec: str) -> None:
        if not self.faults:
            # Every fault rule is gated on ``faults``; one that is not must fail loudly here,
            # never inject into a run that promised none (``--faults off``).
            raise OracleViolation(f"fault {spec!r} armed in a run with faults off")
        if self.multiprocess:
            self.cut.call_utility("arm_fault", spec)
        else:
            self.cut.client.engine.fault_hook.arm(spec)

    def _await_death(self, futs: list[concurrent.futures.Future[Any]], start: float,
                     what: str) -> None:
        """Each of ``futs`` (blocked calls) must fail with EngineDeadError within the bound."""
        for fut in futs:
            try:
                fut.result(timeout=DEATH_BOUND_S + 3)
            except EngineDeadError:
                pass
            except concurrent.futures.TimeoutError:
                raise OracleViolation(
                    f"{what}: a blocked call was not woken by the engine's death") from None
            else:
                raise OracleViolation(f"{what}: returned instead of raising EngineDeadError")
        deadline = start + DEATH_BOUND_S
        while not self.cut.client.is_dead:
            if time.monotonic() > deadline:
                raise OracleViolation(f"{what}: death not seen within {DEATH_BOUND_S} s")
            time.sleep(0.002)
        self.oracle.died()

    def _pending_calls(self) -> int:
        fn = getattr(self.cut.client, "pending_utility_calls", None)
        return 0 if fn is None else int(fn())

    def _wait_pending(self, n: int, call: concurrent.futures.Future[Any] | None = None) -> None:
        deadline = time.monotonic() + WAIT_S
        while self._pending_calls() != n:
            if time.monotonic() > deadline or (n and call is not None and call.done()):
                why = ""
                if call is not None and call.done():  # it ended instead of staying pending
                    err = call.exception()
                    why = (f"; the call ended: {type(err).__name__}: {err}" if err is not None
                           else f"; the call returned {call.result()!r}")
                raise OracleViolation(
                    f"{self._pending_calls()} utility calls pending, not {n} (client"
                    f" {self.cut.client.state.name}){why}")
            time.sleep(0.001)

    @property
    def alive(self) -> bool:
        return self.oracle.phase is Phase.ALIVE

    # -- requests ---------------------------------------------------------------------------

    def _request(self, rid: str, prompt: list[int], max_tokens: int, seed: int,
                 stop_at: int | None, ignore_eos: bool, temperature: float,
                 top_p: float) -> tuple[EngineCoreRequest, list[int] | None, int | None]:
        expected = None
        stop_ids: list[int] = []
        stop_index = None
        max_tokens = self.limits.cap(len(prompt), max_tokens)
        self._prompt_lens[rid] = len(prompt)
        if self.exact_tokens:
            expected = null_tokens(seed, len(prompt), max_tokens, self.vocab_size)
            if stop_at is not None and stop_at < max_tokens:
                stop_ids = [expected[stop_at]]
                stop_index = expected.index(expected[stop_at])  # the first hit stops it
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
        return EngineCoreRequest(rid, prompt, sp), expected, stop_index

    @precondition(lambda self: self.alive)
    @rule(prompt=st.lists(st.integers(3, 511), min_size=1, max_size=8),
          max_tokens=st.integers(1, 24), seed=st.integers(0, 2**31 - 1),
          stop_at=st.none() | st.integers(0, 23), ignore_eos=st.booleans(),
          temperature=st.sampled_from([0.0, 0.7, 1.0]), top_p=st.sampled_from([1.0, 0.9]),
          reuse=st.integers(0, 7))
    def add(self, prompt: list[int], max_tokens: int, seed: int, stop_at: int | None,
            ignore_eos: bool, temperature: float, top_p: float, reuse: int) -> None:
        with self._rule("add", locals()):
            if self._full("add"):
                return
            prompt = self._prompt(*prompt)[:self.limits.max_model_len - 1]
            done = self.oracle.finished_ids
            # Reuse a finished id now and then: allowed once its request finished.
            rid = done[-1 - reuse % len(done)] if reuse < 2 and done else self._fresh_id()
            req, expected, stop_index = self._request(rid, prompt, max_tokens, seed, stop_at,
                                                      ignore_eos, temperature, top_p)
            self.cut.add_request(req)
            self.oracle.add(rid, req.sampling_params.max_tokens, expected, stop_index)

    @precondition(lambda self: self.alive)
    @rule(how=st.sampled_from(["empty_prompt", "zero_max_tokens", "token_out_of_vocab"]))
    def add_invalid(self, how: str) -> None:
        with self._rule("add_invalid", locals()):
            rid = self._fresh_id()
            prompt = [] if how == "empty_prompt" else [1, 2]
            if how == "token_out_of_vocab":
                prompt = [1, self.vocab_size + 5]
            sp = SamplingParams(max_tokens=0 if how == "zero_max_tokens" else 4)
            self.cut.add_request(EngineCoreRequest(rid, prompt, sp))
            self.oracle.add(rid, 4, None, None, invalid=True)

    @precondition(lambda self: self.alive)
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def add_duplicate(self, pick: int) -> None:
        with self._rule("add_duplicate", locals()):
            # Live as the client sees it: not yet observed finished.
            live = self.oracle.live_ids()
            if not live:  # all finished already (timing): nothing live to duplicate
                _note("add_duplicate: no request is live")
                return
            rid = live[pick % len(live)]
            req = EngineCoreRequest(rid, [5, 6], SamplingParams(max_tokens=2))
            self._expect_raises(SpecViolation, lambda: self.cut.add_request(req),
                                f"re-adding live id {rid!r}")

    @precondition(lambda self: self.oracle.phase is not Phase.CLOSED)
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
            if which in ("unknown", "mixed"):
                ids.append(f"never-sent-{pick}")
            if not ids:
                ids = [f"never-sent-{pick}"]
            self.cut.abort_requests(ids)  # silent on a dead engine
            self.oracle.abort(ids)

    @precondition(lambda self: self.alive)
    @rule(k=st.integers(1, 4))
    def add_then_abort(self, k: int) -> None:
        """ADDs followed at once by their abort: each must end ABORT (never lost, never run)."""
        with self._rule("add_then_abort", locals()):
            if self._full("add_then_abort", k):
                return
            ids = [self._fresh_id() for _ in range(k)]
            n = self.limits.long_tokens
            prompt = self._prompt(7, 8, 9)
            first_add = time.monotonic()
            for rid in ids:
                self.cut.add_request(EngineCoreRequest(
                    rid, prompt, SamplingParams(max_tokens=n, seed=1, ignore_eos=True)))
                self.oracle.add(rid, n, null_tokens(1, 3, n, self.vocab_size)
                                if self.exact_tokens else None, None)
            gap = time.monotonic() - first_add
            self.cut.abort_requests(ids)
            self.oracle.abort(ids)
            self._drain(ids)
            if self.multiprocess and n < MIN_JUDGED_LONG_TOKENS:
                _note(f"add_then_abort: {n}-token requests (max_model_len) may outrun the"
                     " abort; not judged")
                return
            if gap > ABORT_GAP_S:
                _note(f"add_then_abort: {gap * 1000:.1f} ms between the sends; not judged")
                return
            for rid in ids:
                m = self.oracle.requests[rid]
                if m.finish is not None and m.finish is not FinishReason.ABORT:
                    raise OracleViolation(
                        f"{rid!r} was aborted right after its ADD yet ended {m.finish.name}"
                        f" after {len(m.tokens)} tokens: the abort overtook its ADD")

    @rule()
    def drain(self) -> None:
        with self._rule("drain", locals()):
            if self.oracle.phase is Phase.CLOSED:
                self._expect_raises(ClientClosedError, lambda: self.cut.get_output(timeout=0.01),
                                    "get_output after shutdown")
                return
            self._drain()

    @rule()
    def poll(self) -> None:
        """Always enabled: one short read, judged (or the refusal a dead/closed client owes)."""
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
                        "the engine died without a fault being injected") from None

    # -- utilities --------------------------------------------------------------------------

    @rule(value=_JSONISH)
    def echo(self, value: Any) -> None:
        with self._rule("echo", locals()):
            if not self.alive:
                self._expect_raises(self._refusal(), lambda: self.cut.call_utility("echo", value),
                                    "echo on a dead/closed client")
                return
            got = self.cut.call_utility("echo", value)
            if got != value:
                raise OracleViolation(f"echo({value!r}) returned {got!r}")

    @rule(how=st.sampled_from(["raising", "unknown_method"]))
    def failing_utility(self, how: str) -> None:
        with self._rule("failing_utility", locals()):
            if how == "raising":
                call = lambda: self.cut.call_utility("profile", "not-an-action")  # noqa: E731
            else:
                call = lambda: self.cut.call_utility("_no_such_method")  # noqa: E731
            kind = UtilityError if self.alive else self._refusal()
            self._expect_raises(kind, call, f"{how} utility")

    @precondition(lambda self: self.alive and self.faults)
    @rule(delay=st.sampled_from([0.01, 0.05]))
    def slow_utility(self, delay: float) -> None:
        with self._rule("slow_utility", locals()):
            self._arm(f"utility:echo:1:delay:{delay}")
            self.stats.faults["utility_delay"] += 1
            start = time.monotonic()
            assert self.cut.call_utility("echo", "slow") == "slow"
            if time.monotonic() - start < delay * 0.9:
                raise OracleViolation("a delayed utility replied before its delay")

    @precondition(lambda self: self.alive and self.faults and self.multiprocess)
    @rule(failing=st.booleans())
    def timed_out_utility(self, failing: bool) -> None:
        """A call that outlives its timeout raises UtilityTimeoutError and leaves no entry;
        its late reply (a result, or with ``failing`` an error) is dropped."""
        with self._rule("timed_out_utility", locals()):
            method, args = ("profile", ("not-an-action",)) if failing else ("echo", ("late",))
            self._arm(f"utility:{method}:1:delay:{TIMEOUT_REPLY_DELAY_S}")
            self.stats.faults["utility_delay"] += 1
            self._expect_raises(UtilityTimeoutError,
                                lambda: self.cut.call_utility(method, *args,
                                                              timeout=TIMEOUT_CALL_S),
                                "a call past its timeout")
            if self._pending_calls() != 0:
                raise OracleViolation(f"{self._pending_calls()} call(s) left registered after"
                                      " a timeout")
            assert self.cut.call_utility("echo", "after") == "after"  # the late reply dropped

    @precondition(lambda self: self.alive and self.faults and self.kind == "async")
    @rule(failing=st.booleans())
    def cancelled_utility(self, failing: bool) -> None:
        with self._rule("cancelled_utility", locals()):
            method, args = ("profile", ("not-an-action",)) if failing else ("echo", ("x",))
            self._arm(f"utility:{method}:1:delay:0.1")
            self.stats.faults["utility_delay"] += 1
            fut = self.cut.submit("call_utility", method, *args)
            self._wait_pending(1)
            fut.cancel()
            self._wait_pending(0)
            assert self.cut.call_utility("echo", "after") == "after"

    # -- sleep, wake, pause -----------------------------------------------------------------

    def _work_in_flight(self, mode: str) -> None:
        """A wait-mode pause is only interesting with requests to drain: add a long one (it
        cannot finish before the pause arrives, so the pause must really wait for it)."""
        if mode != "wait" or self.oracle.paused or len(self.oracle.live_ids()) >= MAX_LIVE:
            return
        rid = self._fresh_id()
        req, expected, _ = self._request(rid, self._prompt(5, 6, 7), WAIT_MODE_TOKENS, 11, None,
                                         True, 0.0, 1.0)
        self.cut.add_request(req)
        self.oracle.add(rid, req.sampling_params.max_tokens, expected, None)

    def _after_pause(self, mode: str, level: int | None) -> None:
        drained = self.oracle.pause(mode, level)
        if mode == "wait" and drained:
            # The reply means "idle": the outputs it waited for arrived before it, so they are
            # already queued. Read exactly those (reading on would let a late drain catch up).
            qsize = getattr(getattr(self.cut.client, "_outputs", None), "qsize", None)
            queued = qsize() if qsize is not None else None
            with contextlib.suppress(EngineDeadError):
                if queued is None:  # a user's client: read what comes within a short window
                    while self._poll(0.01).outputs:
                        pass
                for _ in range(queued or 0):
                    self._poll(WAIT_S)
            early = [r for r in drained if not self.oracle.requests[r].finished]
            if early:
                raise OracleViolation(f"sleep/pause(wait) replied before {early} finished")

    @rule(level=st.sampled_from([0, 1, 2]), mode=st.sampled_from(["abort", "wait", "keep"]))
    def sleep(self, level: int, mode: str) -> None:
        with self._rule("sleep", locals()):
            if mode == "wait" and not self.multiprocess:
                self._expect_raises(ValueError, lambda: self.cut.sleep(level, mode),
                                    "in-process sleep(wait)")
                return
            if not self.alive:
                self._expect_raises(self._refusal(), lambda: self.cut.sleep(level, mode),
                                    "sleep on a dead/closed client")
                return
            self._work_in_flight(mode)
            self.cut.sleep(level, mode)
            self._after_pause(mode, level)
            if not self.cut.is_sleeping():
                raise OracleViolation("is_sleeping() is False right after sleep()")

    @precondition(lambda self: self.alive and self.multiprocess and not self.oracle.paused)
    @rule(level=st.sampled_from([None, 0, 1, 2]))
    def wait_mode(self, level: int | None) -> None:
        """sleep(level, 'wait') (or pause(wait) when ``level`` is None) with requests running:
        the reply means every one of them finished; then a full wake-up."""
        with self._rule("wait_mode", locals()):
            self._work_in_flight("wait")
            if level is None:
                self.cut._call("pause_scheduler", "wait")
            else:
                self.cut.sleep(level, "wait")
            self._after_pause("wait", level)
            if self.cut.wake_up(None) is not True:
                raise OracleViolation("wake_up(None) after a wait-mode sleep was not full")
            self.oracle.wake(None)

    @precondition(lambda self: self.alive)
    @rule(mode=st.sampled_from(["abort", "wait", "keep"]))
    def pause(self, mode: str) -> None:
        with self._rule("pause", locals()):
            if mode == "wait" and not self.multiprocess:
                self._expect_raises(ValueError, lambda: self.cut.client.pause_scheduler(mode),
                                    "in-process pause(wait)")
                return
            self._work_in_flight(mode)
            self.cut._call("pause_scheduler", mode)
            self._after_pause(mode, None)

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

    @precondition(lambda self: self.alive)
    @rule()
    def resume(self) -> None:
        with self._rule("resume", locals()):
            if self.oracle.resume_allowed():
                self.cut._call("resume_scheduler")
                self.oracle.resume()
            else:
                # Scheduling cannot resume while memory is released: the engine says so.
                self._expect_raises(UtilityError, lambda: self.cut._call("resume_scheduler"),
                                    "resume_scheduler while asleep")

    # -- the in-process EngineCore, past its client ---------------------------------------
    # The in-process client refuses what would block its only thread (wait mode) and what the
    # protocol forbids (a duplicate live id). The engine must still handle both, so these rules
    # drive the EngineCore itself and leave it as the client last saw it.

    @precondition(lambda self: self.alive and self.kind == "inproc")
    @rule(then=st.sampled_from(["drained", "idle", "add", "wake", "wait", "abort", "keep",
                                "crash", "shutdown"]))
    def engine_wait_mode(self, then: str) -> None:
        """The engine's pause(wait) with requests running: it drains them (DRAINING), meets
        ``then`` while draining, completes its deferred reply, and is resumed. ``crash`` is a
        fault: with faults off it drains instead (decided before the rule is recorded, so the
        reproducer says what ran)."""
        if then == "crash" and not self.faults:
            then = "drained"
        with self._rule("engine_wait_mode", locals()):
            engine = self.cut.client.engine
            if self.oracle.paused:  # PAUSED/SLEEPING: nothing to drain, the reply is immediate
                if engine.pause_scheduler("wait") is not None:
                    raise OracleViolation("pause(wait) of a paused engine deferred its reply")
                return
            if then == "idle":
                self._quiesce()  # IDLE -PAUSE_WAIT-> PAUSED at once
            else:
                self._work_in_flight("wait")
            fut = engine.pause_scheduler("wait")
            drained = self.oracle.pause("wait")
            running = [r for r in drained if r in engine.scheduler.requests]
            if fut is None and running:
                raise OracleViolation(f"pause(wait) replied at once with {running} running")
            waiters = [] if fut is None else [fut]
            if fut is not None:
                if then == "add":  # DRAINING -WORK_ARRIVED: queued, not drained
                    self._add_fixed(8)
                elif then == "wake":  # the wake-up ends the wait: scheduling goes on
                    if engine.wake_up(None) is not True:
                        raise OracleViolation("wake_up(None) while draining was not full")
                    self._expect_failed(waiters, UtilityError, "pause(wait) ended by wake_up")
                    self.oracle.wake(None)
                    return
                elif then == "wait":
                    again = engine.pause_scheduler("wait")
                    if again is None:
                        raise OracleViolation("a second pause(wait) while draining replied at once")
                    waiters.append(again)
                elif then in ("abort", "keep"):  # DRAINING -> PAUSED: the drain is over
                    engine.pause_scheduler(then)
                    self.oracle.pause(then)
                    if not fut.done():
                        raise OracleViolation(f"pause({then}) left pause(wait)'s reply pending")
                elif then == "crash":
                    self.stats.faults["step_raise"] += 1
                    self._crash_in_step("step_raise", [])
                    self._expect_failed(waiters, EngineDeadError, "pause(wait) at engine death")
                    return
                elif then == "shutdown":
                    self.cut.client.shutdown()
                    self.oracle.closed()
                    self._expect_failed(waiters, UtilityError, "pause(wait) at shutdown")
                    return
            deadline = time.monotonic() + WAIT_S
            while not all(w.done() for w in waiters):
                if time.monotonic() > deadline:
                    raise OracleViolation(f"pause(wait) did not complete within {WAIT_S} s")
                self._poll(0)
            for w in waiters:
                w.result()  # a failed drain raises here
            if then not in ("abort", "keep"):
                early = [r for r in drained if not self.oracle.requests[r].finished]
                if early:
                    raise OracleViolation(f"pause(wait) completed before {early} finished")
            engine.resume_scheduler()
            self.oracle.resume()

    def _expect_failed(self, futs: list[concurrent.futures.Future[Any]],
                       kind: type[BaseException], what: str) -> None:
        for fut in futs:
            if not fut.done():
                raise OracleViolation(f"{what}: the deferred reply is still pending")
            if not isinstance(fut.exception(), kind):
                raise OracleViolation(f"{what}: the deferred reply ended with"
                                      f" {fut.exception()!r}, not {kind.__name__}")

    def _add_fixed(self, n: int) -> str:
        rid = self._fresh_id()
        req, expected, _ = self._request(rid, self._prompt(5, 6, 7), n, 13, None, True, 0.0, 1.0)
        self.cut.add_request(req)
        self.oracle.add(rid, req.sampling_params.max_tokens, expected, None)
        return rid

    @precondition(lambda self: self.alive and self.kind == "inproc")
    @rule(which=st.sampled_from(["waiting", "live", "preempted"]),
          pick=st.integers(0, MAX_LIVE - 1))
    def engine_duplicate(self, which: str, pick: int) -> None:
        """A live id sent to the engine again ends the live request with ERROR and the copy
        is dropped. ``which``: a request added and not yet scheduled (WAITING), any live one,
        or (when awake) one a level-1 sleep in keep mode preempted, woken afterwards."""
        with self._rule("engine_duplicate", locals()):
            engine = self.cut.client.engine
            slept = False
            if which != "live" and len(self.oracle.live_ids()) < MAX_LIVE:
                live = [self._add_fixed(8)]
                if which == "preempted" and not self.oracle.paused:
                    self._poll(0)  # scheduled: RUNNING, so the sleep preempts it
                    self.cut.sleep(1, "keep")
                    self.oracle.pause("keep", 1)
                    slept = True
            else:
                # Live in the engine too: a finish it made but the test has not read yet
                # would turn the copy into a new request the client does not know.
                live = [r for r in self.oracle.live_ids() if r in engine.scheduler.requests]
            live = [r for r in live if r in engine.scheduler.requests]
            if live:
                rid = live[pick % len(live)]
                engine.add_request(EngineCoreRequest(rid, [5, 6], SamplingParams(max_tokens=2)))
                self.oracle.duplicate(rid)
                self._drain([rid])
                if self.oracle.requests[rid].finish is not FinishReason.ERROR:
                    raise OracleViolation(f"{rid!r} sent again while live did not end ERROR")
            else:
                _note("engine_duplicate: nothing live in the engine")
            if slept:
                if self.cut.wake_up(None) is not True:
                    raise OracleViolation("wake_up(None) after sleep(1, keep) was not full")
                self.oracle.wake(None)

    @precondition(lambda self: self.alive and self.limits.prefix_prompt_len is not None
                  and not self.oracle.paused)
    @rule(first=st.integers(3, 511))
    def prefix_cache_hit(self, first: int) -> None:
        """With prefix caching on: a prompt of one full block and one token more, sent twice
        with nothing else running; the second must report its block cached."""
        with self._rule("prefix_cache_hit", locals()):
            if self._full("prefix_cache_hit"):
                return
            n = self.limits.prefix_prompt_len
            assert n is not None
            prompt = self._prompt(*(first + i for i in range(n)))
            self._drain()  # nothing else may claim blocks between the two
            others = self.oracle.live_ids()
            ids = []
            for _ in range(2):
                rid = self._fresh_id()
                req, expected, _ = self._request(rid, prompt, 1, first, None, True, 0.0, 1.0)
                self.cut.add_request(req)
                self.oracle.add(rid, 1, expected, None)
                self._drain([rid])
                ids.append(rid)
            if others:
                _note(f"prefix_cache_hit: {others} live; the cache hit is not judged")
                return
            if self.alive and self._cached.get(ids[1], 0) < self.limits.block_size:
                raise OracleViolation(
                    f"{ids[1]!r} repeated a {n}-token prompt just computed by {ids[0]!r}, yet"
                    f" reported num_cached_tokens={self._cached.get(ids[1], 0)}; expected its"
                    f" {self.limits.block_size}-token block cached")

    @precondition(lambda self: self.kind == "inproc")
    @rule(fails=st.booleans())
    def short_lived_client(self, fails: bool) -> None:
        """A second in-process client that never serves: with ``fails``, its engine cannot
        start (its KV cache cannot hold one sequence) and it raises EngineStartupError;
        otherwise it is shut down while still READY. Its trace is judged and counted."""
        with self._rule("short_lived_client", locals()):
            import msgspec

            from ..runtime.factory import make_client

            config = self.cut.client.config
            trace: list[Any] = []
            if fails:
                # One block holds a sequence when block_size >= max_model_len: halve the
                # block so that a sequence needs two (max_model_len >= MIN_MODEL_LEN).
                block = config.block_size
                if block >= config.max_model_len:
                    block = config.max_model_len // 2
                bad = msgspec.structs.replace(config, num_gpu_blocks_override=1,
                                              block_size=block)
                self._expect_raises(EngineStartupError,
                                    lambda: make_client(bad, multiprocess=False, asyncio=False,
                                                        trace=trace),
                                    "a client whose KV cache cannot hold one sequence")
            else:
                make_client(config, multiprocess=False, asyncio=False, trace=trace).shutdown()
            self.stats.coverage.add(trace)
            check_traces(trace)

    # -- faults -----------------------------------------------------------------------------

    @precondition(lambda self: self.alive and self.faults and (
        self._life >= self.min_life
        # A client that never had a request is READY, the only way to READY -ENGINE_DIED->
        # DEAD; in-process only, where a new engine costs milliseconds, not an interpreter.
        or (self.kind == "inproc" and not self.oracle.requests)))
    @rule(how=st.sampled_from(["sigkill", "step_raise", "step_exit"]),
          observers=st.booleans())
    def crash(self, how: str, observers: bool) -> None:
        """The engine dies. With ``observers``, a get_output is blocked and (for SIGKILL) a
        utility call is pending when it does: both must fail with EngineDeadError at once."""
        with self._rule("crash", locals()):
            if not self.multiprocess:
                how = "step_raise"  # no process to kill in-process
            elif how.startswith("step") and self.oracle.paused:
                how = "sigkill"  # a paused subprocess engine does not step
            self.stats.faults[how] += 1
            blocked: list[concurrent.futures.Future[Any]] = []
            observers = observers or how == "sigkill"  # a SIGKILL always has witnesses
            if observers and self.multiprocess:
                self._quiesce()  # no output may satisfy the blocked read
                blocked.append(self.cut.submit("get_output"))
                # The read is waiting once a round trip issued after it has completed.
                self.cut.call_utility("echo", 0)
            if how.startswith("step"):
                self._crash_in_step(how, blocked)
                return
            pid = self.cut.engine_pid
            assert pid is not None
            if observers:
                cf.stop_process(pid)  # the call below stays pending
                try:
                    blocked.append(self.cut.submit("call_utility", "echo", "pending"))
                    self._wait_pending(1, blocked[-1])
                except BaseException:
                    os.kill(pid, signal.SIGKILL)
                    raise
            os.kill(pid, signal.SIGKILL)
            self._await_death(blocked, time.monotonic(), how)

    def _crash_in_step(self, how: str, blocked: list[concurrent.futures.Future[Any]]) -> None:
        action = "raise" if how == "step_raise" else "exit"
        # In-process, get_output steps the engine in any state; a subprocess engine steps only
        # when awake (the rule falls back to SIGKILL while paused).
        start = time.monotonic()
        try:
            self._arm(f"step:1:{action}")
            if self.multiprocess:  # a subprocess engine steps only with work to do
                rid = self._fresh_id()
                n = self.limits.cap(2, 4)
                self.oracle.add(rid, n, None, None)
                self.cut.add_request(EngineCoreRequest(rid, self._prompt(3, 4),
                                                       SamplingParams(max_tokens=n)))
        except EngineDeadError:
            # With requests running, the armed step may fire before the arm's reply (or the
            # ADD) got through: an exit does not flush the engine's output. The death is what
            # this rule asked for; the loop below sees it at once.
            if not self.multiprocess:
                raise

        deadline = start + DEATH_BOUND_S + 3
        while True:
            try:
                self._poll(0.2)
            except EngineDeadError:
                break
            if time.monotonic() > deadline:
                raise OracleViolation(f"{how}: the engine did not die")
        self.oracle.died()
        if self.multiprocess:
            self._await_death(blocked, start, how)

    @precondition(lambda self: self.alive and self.faults and self.multiprocess)
    @rule(frames=st.sampled_from(_MALFORMED) | st.lists(st.binary(max_size=6), min_size=1,
                                                         max_size=3).map(
        lambda f: [b"\x09" + part for part in f]))  # an unknown type byte on every part
    def malformed_frame(self, frames: list[bytes]) -> None:
        """Garbage on the wire is rejected; the engine keeps serving."""
        with self._rule("malformed_frame", locals()):
            self.stats.faults["malformed_frame"] += 1
            self.cut.client.send_raw_frames(list(frames))
            try:
                ok = self.cut.call_utility("echo", "still serving", timeout=WAIT_S)
            except EngineDeadError:
                raise OracleViolation(f"the engine died on malformed frames {frames!r}") from None
            assert ok == "still serving"

    @precondition(lambda self: self.faults and self.orphan_config is not None
                  and self._orphans == 0 and self._life >= self.orphan_min_life)
    @rule()
    def orphaned_engine(self) -> None:
        """A client process SIGKILLed: its engine exits by itself (one per example: slow)."""
        with self._rule("orphaned_engine", locals()):
            self._orphans += 1
            self.stats.faults["client_sigkill"] += 1
            assert self.orphan_config is not None
            _check_orphan_exits(self.orphan_config)

    # -- shutdown and restart ---------------------------------------------------------------

    @precondition(lambda self: self.oracle.phase is not Phase.CLOSED
                  and self._life >= 2 * self.min_life)
    @rule(with_pending=st.booleans())
    def shutdown(self, with_pending: bool) -> None:
        """Shutdown is clean: blocked calls fail with ClientClosedError, never EngineDeadError;
        it is bounded and releases everything. ``with_pending`` blocks a read and, only when
        faults are on, a utility call held pending by a SIGSTOPped engine. With faults on
        every shutdown has them: a shutdown runs about once per client in a short run, and
        a coin flip left the pending case (what shows a shutdown that fails calls with the
        wrong error) to the luck of the derandomized draw."""
        with_pending = with_pending or self.faults
        with self._rule("shutdown", locals()):
            pending: list[concurrent.futures.Future[Any]] = []
            pid = self.cut.engine_pid
            stopped = False
            if with_pending and self.alive and self.multiprocess:
                self._quiesce()
                pending.append(self.cut.submit("get_output"))
                self.cut.call_utility("echo", 0)
            if pending and self.faults:
                assert pid is not None
                cf.stop_process(pid)  # keeps the next call pending
                stopped = True
                self.stats.faults["sigstop"] += 1
                pending.append(self.cut.submit("call_utility", "echo", "pending"))
                self._wait_pending(1, pending[-1])
            try:
                start = time.monotonic()
                self.cut.client.shutdown(timeout=0.5 if stopped else None)
                took = time.monotonic() - start
            finally:
                if stopped and pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            for fut in pending:
                try:
                    fut.result(timeout=DEATH_BOUND_S + 3)
                except ClientClosedError:
                    continue
                except concurrent.futures.TimeoutError:
                    raise OracleViolation("a call blocked at shutdown was never woken") from None
                except BaseException as e:
                    raise OracleViolation(
                        f"a call blocked at shutdown raised {type(e).__name__}, not"
                        " ClientClosedError") from None
                raise OracleViolation("a call blocked at shutdown returned a value")
            if took > SHUTDOWN_BOUND_S:
                raise OracleViolation(f"shutdown took {took:.1f} s (bound {SHUTDOWN_BOUND_S} s)")
            self.oracle.closed()
            self.cut.client.shutdown()  # idempotent
            # Threads and fds are checked once the driver's loop is closed too (teardown or
            # restart); the process and the ipc files must be gone now.
            check_released(self.live.before, engine_pid=self.live.engine_pid,
                           ipc_path=self.live.ipc_path, threads_fds=False)

    @precondition(lambda self: self.oracle.phase is not Phase.ALIVE)
    @rule()
    def restart(self) -> None:
        with self._rule("restart", locals()):
            self._finish_client(check=True)
            self.live = self.pool.acquire()
            self.oracle = Oracle(exact_tokens=self.exact_tokens)
            self._cached.clear()
            self._prompt_lens.clear()
            self._life = 0

    # -- invariants and teardown ------------------------------------------------------------

    @invariant()
    def client_state_matches_model(self) -> None:
        if self._busy is not None:
            return
        state = self.cut.client.state
        allowed = self.oracle.expected_client_states()
        if state not in allowed:
            err = OracleViolation(
                f"client is {state.name}; the model allows {sorted(s.name for s in allowed)}")
            # Recorded like a rule's failure: Hypothesis may replace it by a Flaky report.
            self.stats.record_failure("invariant client_state_matches_model", err,
                                      self._program)
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
        """Shut this incarnation down (teardown liveness checks when ``check``)."""
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.oracle.max_in_flight)
        live = self.live
        if live.cut.closed and not check:
            return
        try:
            if not live.cut.closed:
                close_and_check(live, check=check)
            elif check:
                check_released(live.before, engine_pid=live.engine_pid, ipc_path=live.ipc_path)
        finally:
            # After the close, so that shutdown's own transitions are judged and counted.
            self._record_trace()

    def teardown(self) -> None:
        self._program.append("state.teardown()")
        try:
            self._teardown()
        except BaseException as e:
            self.stats.record_failure("teardown", e, self._program)
            raise

    def _teardown(self) -> None:
        try:
            if self._busy is not None:
                _note(f"rule {self._busy} did not finish; discarding its client")
                self._finish_client(check=False)
                return
            if self.oracle.phase is not Phase.ALIVE:
                self._finish_client(check=True)
                return
            # Hot obligations: every request that can end does; no call is left pending.
            self._drain()
            if self._pending_calls():
                raise OracleViolation(f"{self._pending_calls()} utility call(s) still pending")
            # Reset for the next example: end what is left, wake, drain.
            live = self.oracle.live_ids()
            if live:
                self.cut.abort_requests(live)
                self.oracle.abort(live)
            if self.oracle.paused:
                assert self.cut.wake_up(None) is True
                self.oracle.wake(None)
            self._drain(self.oracle.live_ids())
            if self.oracle.phase is not Phase.ALIVE:
                raise OracleViolation("the engine died during teardown")
            self._record_trace()
        except BaseException:
            with contextlib.suppress(Exception):
                self._finish_client(check=False)
            raise
        if self._own_pool:
            self._finish_client(check=True)
        else:
            self.pool.release(self.live)


# --- an engine started on its own, front end after front end --------------------------------

# The attached clients' heartbeat deadline, and the engine's beat (as tests/runtime/
# test_reattach.py): only the heartbeat reports the death of an engine the client did not start.
ATTACHED_HEARTBEAT_TIMEOUT_S = 5.0
STANDALONE_HEARTBEAT_S = 0.1
# handover's left-behind requests and its probes after the attach: seeds that differ, so an
# old output taken for a probe that reuses its id shows as a wrong token (null model).
LEFT_SEED = 21
PROBE_SEED = 22
PROBE_TOKENS = 8
ATTACH_KINDS = ("sync", "async")
STANDALONE_DIR_PREFIX = "enginewire-standalone-"


def _no_abort() -> None:
    """Stands in for a client's ``_abort_left_behind``: the front end goes without a word."""


class StandaloneEngine:
    """An engine process started on its own (what ``enginewire engine`` runs): front ends
    attach to it one after another at the same ipc addresses, and it outlives each of them.

    ``close`` stops it (SIGTERM) and checks that it exited cleanly and that nothing it or its
    front ends held is left: its process, the socket files, this process's threads and fds."""

    def __init__(self, config: Any, *, faults: bool = True) -> None:
        import multiprocessing

        import msgspec

        from ..runtime.engine_proc import _process_main
        from ..runtime.faults import FaultPlan

        with contextlib.suppress(Exception):
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()  # process-wide, once: not a leak
        self.config = config
        self.before = ResourceSnapshot.take()
        # Owned by this process: a campaign killed outright leaves it, and the next standalone
        # engine to start removes it.
        self.dir = str(owned_tempdir(STANDALONE_DIR_PREFIX))
        self.input_address = f"ipc://{self.dir}/in"
        self.output_address = f"ipc://{self.dir}/out"
        # parent_pid: this engine waits for front ends without a deadline, so a campaign killed
        # before close() (a CI timeout's SIGTERM) would leave it running for good.
        kwargs: dict[str, Any] = {"input_address": self.input_address,
                                  "output_address": self.output_address,
                                  "heartbeat_interval_s": STANDALONE_HEARTBEAT_S,
                                  "parent_pid": os.getpid()}
        if faults:  # the fault rules arm what they inject through a utility call
            kwargs["fault"] = FaultPlan(allow_arm=True)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=_process_main, name="StandaloneEngine", daemon=True,
                               args=(type(config), msgspec.msgpack.encode(config), kwargs))
        self.proc.start()
        assert self.proc.pid is not None  # started
        self.pid: int = self.proc.pid
        self._closed = False

    def attach(self, kind: str) -> cf.ClientUnderTest:
        """A new front end of ``kind`` (sync or async), attached to this engine."""
        if kind not in ATTACH_KINDS:
            raise ValueError(f"a front end attaching to a standalone engine is one of"
                             f" {ATTACH_KINDS}, not {kind!r}")
        return cf.open_client(kind, self.config, launch_engine=False,
                              input_address=self.input_address,
                              output_address=self.output_address,
                              engine_heartbeat_timeout_s=ATTACHED_HEARTBEAT_TIMEOUT_S,
                              ready_timeout_s=WAIT_S)

    def close(self, *, check: bool = True) -> None:
        """Stop the engine; with ``check``, OracleViolation if anything was left behind."""
        import shutil

        if self._closed:
            return
        self._closed = True
        problems = []
        proc = self.proc
        if not proc.is_alive():
            problems.append(f"the standalone engine did not outlive its front ends (exit"
                            f" code {proc.exitcode})")
        else:
            os.kill(self.pid, signal.SIGTERM)
            proc.join(SHUTDOWN_BOUND_S)
            if proc.is_alive():
                problems.append(f"the standalone engine ignored SIGTERM for {SHUTDOWN_BOUND_S} s")
                proc.kill()
                proc.join(WAIT_S)
            elif proc.exitcode != 0:
                problems.append(f"the standalone engine exited with {proc.exitcode} on SIGTERM")
        with contextlib.suppress(ValueError):  # still running after a SIGKILL: keep its fd
            proc.close()  # its sentinel fd
        # Every front end removes the socket files it bound (the engine binds none).
        left = sorted(set(os.listdir(self.dir)) - {OWNER_FILE})
        if left:
            problems.append(f"socket files left behind by the front ends: {left}")
        shutil.rmtree(self.dir, ignore_errors=True)
        if check and problems:
            raise OracleViolation("; ".join(problems))
        if check:
            check_released(self.before, engine_pid=self.pid, ipc_path=self.dir)


class AttachPool(ClientPool):
    """A ``ClientPool`` over a ``StandaloneEngine``: a new client attaches to it rather than
    starting an engine. Every example starts on a client of ``kind``: its rules depend on
    the kind, so an idle client of another kind (left by a handover) is shut down first."""

    def __init__(self, engine: StandaloneEngine, stats: CampaignStats, kind: str = "sync"
                 ) -> None:
        super().__init__(lambda: engine.attach(kind), stats)
        self.engine = engine
        self.kind = kind

    def acquire(self) -> _Live:
        idle = self._idle
        if idle is not None and idle.cut.kind != self.kind:
            self._idle = None
            close_and_check(idle)
        if self._idle is not None:
            return super().acquire()
        return self.attach(self.kind)

    def attach(self, kind: str) -> _Live:
        before = ResourceSnapshot.take()
        start = time.monotonic()
        cut = self.engine.attach(kind)
        self.stats.seconds["(attach)"] += time.monotonic() - start
        return _Live(cut, before, None, None)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.engine.close()


class StandaloneEngineStateMachine(EngineClientStateMachine):
    """``EngineClientStateMachine`` on front ends attached to one ``StandaloneEngine``, with
    ``handover``: the front end goes (cleanly, or without a word like a SIGKILLed process)
    and a new one, sync or async, attaches and carries on, under a fresh oracle.

    What a user relies on, judged at each handover: the old client's calls and reads end
    (``ClientClosedError``, or a value that beat the shutdown) and it forgets its requests;
    the old client releases its threads and fds; the new client finds the engine awake and
    idle (no live request, every KV block free); no output of an old request reaches it, even
    for an id it reuses at once (its probes reuse the old live ids, with another seed, so an
    old output shows as a wrong token). ``crash``, ``shutdown`` and ``restart`` are not rules
    here: the engine is shared by every example, and only its heartbeat would report it dead."""

    def __init__(self, pool: AttachPool, **kwargs: Any) -> None:
        super().__init__(pool.factory, kind=pool.kind, pool=pool, orphan_config=None,
                         **kwargs)
        self.attach_pool = pool
        # Every id a previous front end of this example used: none may reach the current one.
        self._foreign: set[str] = set()

    # Not rules on a shared standalone engine (see the class docstring); same signatures.
    def crash(self, how: str, observers: bool) -> None:
        raise NotImplementedError("crash kills the standalone engine every example shares")

    def shutdown(self, with_pending: bool) -> None:
        raise NotImplementedError("a front end that goes is handover's case here")

    def restart(self) -> None:
        raise NotImplementedError("a front end that goes is handover's case here")

    def _observe(self, batch: EngineCoreOutputs) -> None:
        for out in batch.outputs:
            if out.request_id in self._foreign and out.request_id not in self.oracle.requests:
                raise OracleViolation(
                    f"the new front end received an output for {out.request_id!r}, a request"
                    " of the front end it replaced")
        super()._observe(batch)

    # Two rules, one per way to go, so that a program hands over about twice as often.
    @precondition(lambda self: self.alive)
    @rule(left=st.integers(0, 3), then=st.sampled_from(["running", "asleep", "paused", "pending"]),
          next_kind=st.sampled_from(ATTACH_KINDS))
    def handover_after_shutdown(self, left: int, then: str, next_kind: str) -> None:
        """The front end shuts down (it aborts what it leaves); see ``_handover``."""
        with self._rule("handover_after_shutdown", locals()):
            self._handover("shutdown", left, then, next_kind)

    @precondition(lambda self: self.alive)
    @rule(left=st.integers(0, 3), then=st.sampled_from(["running", "asleep", "paused", "pending"]),
          next_kind=st.sampled_from(ATTACH_KINDS))
    def handover_after_vanish(self, left: int, then: str, next_kind: str) -> None:
        """The front end goes without a word, like a SIGKILLed process; see ``_handover``."""
        with self._rule("handover_after_vanish", locals()):
            self._handover("vanish", left, then, next_kind)

    def _handover(self, how: str, left: int, then: str, next_kind: str) -> None:
        """The front end goes, ``how``: shut down (it aborts what it leaves) or vanished (no
        abort). It leaves ``left`` long requests behind, with the engine ``then`` running
        them, asleep (level 1, keep), paused (keep), or with a read blocked and a sleep(wait)
        deferred. A ``next_kind`` client attaches and the program goes on with it."""
        left_ids = self._leave_behind(left)
        waiters: list[concurrent.futures.Future[Any]] = []
        if then == "asleep":
            self.cut.sleep(1, "keep")
            self.oracle.pause("keep", 1)
        elif then == "paused":
            self.cut._call("pause_scheduler", "keep")
            self.oracle.pause("keep")
        elif then == "pending":
            waiters.append(self.cut.submit("get_output"))
            if not self.oracle.paused:  # paused, the engine replies at once
                waiters.append(self.cut.submit("sleep", 1, "wait"))
        self._go(how, waiters)
        self._foreign |= set(self.oracle.requests)
        old_live = self.oracle.live_ids()
        self.oracle.closed()
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.oracle.max_in_flight)

        self.live = self.attach_pool.attach(next_kind)
        self.kind = next_kind
        self.oracle = Oracle(exact_tokens=self.exact_tokens)
        self._cached.clear()
        self._prompt_lens.clear()
        self._check_fresh_engine()
        self._probe(sorted(set(left_ids) | set(old_live))[:MAX_LIVE])

    def _leave_behind(self, n: int) -> list[str]:
        """``n`` requests long enough to be running when their front end goes."""
        ids: list[str] = []
        for _ in range(n):
            if self._full("handover: left behind"):
                break
            rid = self._fresh_id()
            req, expected, _ = self._request(rid, self._prompt(7, 8, 9), LONG_MAX_TOKENS,
                                             LEFT_SEED, None, True, 0.0, 1.0)
            self.cut.add_request(req)
            self.oracle.add(rid, req.sampling_params.max_tokens, expected, None)
            ids.append(rid)
        return ids

    def _go(self, how: str, waiters: list[concurrent.futures.Future[Any]]) -> None:
        """The current front end goes; its waiters end and it releases what it held."""
        live, client = self.live, self.cut.client
        if waiters:
            # The read is waiting once a round trip issued after it has completed; the
            # deferred call once it is registered (or it already ended: nothing to drain).
            self.cut.call_utility("echo", 0)
            deadline = time.monotonic() + WAIT_S
            while len(waiters) > 1 and not waiters[1].done() and not self._pending_calls():
                if time.monotonic() > deadline:
                    raise OracleViolation("sleep(wait) was neither pending nor done")
                time.sleep(0.001)
        if how == "shutdown":  # it aborts what it leaves: a read may see those ABORTs
            self.oracle.abort(self.oracle.live_ids())
        else:
            # What a SIGKILLed front end leaves (tests/runtime/test_reattach.py kills a child
            # process; this costs no interpreter): its requests running, no ABORT sent.
            client._abort_left_behind = _no_abort
        start = time.monotonic()
        client.shutdown()  # the async loop stays up until its waiters are judged
        took = time.monotonic() - start
        if took > SHUTDOWN_BOUND_S:
            raise OracleViolation(f"{how}: the front end took {took:.1f} s to go (bound"
                                  f" {SHUTDOWN_BOUND_S} s)")
        for fut in waiters:
            try:
                got = fut.result(timeout=DEATH_BOUND_S + 3)
            except ClientClosedError:
                continue
            except concurrent.futures.TimeoutError:
                raise OracleViolation(f"{how}: a call blocked as the front end went was never"
                                      " woken") from None
            except BaseException as e:
                raise OracleViolation(f"{how}: a call blocked as the front end went raised"
                                      f" {type(e).__name__}: {e}, not ClientClosedError") from e
            if isinstance(got, EngineCoreOutputs):  # outputs that beat the shutdown: its own
                self._observe(got)
        live.cut.shutdown()  # the async driver's loop
        if client.live_requests():
            raise OracleViolation(f"{how}: the old front end still counts"
                                  f" {client.live_requests()} as live")
        self._expect_raises(ClientClosedError, client.ensure_alive, "a front end that went")
        self._record_trace()
        check_released(live.before, engine_pid=None, ipc_path=None)

    def _check_fresh_engine(self) -> None:
        """The engine as after start-up: awake, no request, every KV block free."""
        if self.cut.is_sleeping():
            raise OracleViolation("is_sleeping() is True right after a new front end attached")
        stats = self.cut.call_utility("get_stats")
        if (stats["state"], stats["num_live"]) != (EngineState.IDLE.name, 0) or (
                stats["num_free_blocks"] != stats["num_gpu_blocks"]):
            raise OracleViolation(
                f"the engine is not as after start-up once a new front end attached: state"
                f" {stats['state']}, {stats['num_live']} live request(s),"
                f" {stats['num_free_blocks']}/{stats['num_gpu_blocks']} KV blocks free")

    def _probe(self, reused: list[str]) -> None:
        """New requests complete; they reuse the old live ids (or one fresh id)."""
        ids = reused or [self._fresh_id()]
        for rid in ids:
            req, expected, _ = self._request(rid, self._prompt(5, 6), PROBE_TOKENS, PROBE_SEED,
                                             None, True, 0.0, 1.0)
            self.cut.add_request(req)
            self.oracle.add(rid, req.sampling_params.max_tokens, expected, None)
        self._drain(ids)
        for rid in ids:
            m = self.oracle.requests[rid]
            if m.finish is not FinishReason.LENGTH:
                raise OracleViolation(f"the new front end's request {rid!r} ended"
                                      f" {m.finish}, not LENGTH")
