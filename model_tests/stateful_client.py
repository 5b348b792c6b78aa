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

The rules, invariants and teardown this machine shares with the data-parallel one are
``stateful_base.CampaignMachine``'s; the clients and their pool are ``pools.py``'s; the
bounds, ``bounds.py``'s. ``StandaloneEngineStateMachine`` (``stateful_standalone.py``) runs
the same rules on front ends attached to one engine started on its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from ..protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SamplingParams,
)
from ..spec.errors import (
    EngineDeadError,
    EngineStartupError,
    UtilityError,
    UtilityTimeoutError,
)
from . import conformance as cf
from ._conformance_driver import declared_contract
from ._harness import wait_until
from .bounds import (
    ABORT_GAP_S,
    MAX_LIVE,
    MIN_JUDGED_LONG_TOKENS,
    MIN_MODEL_LEN,
    ORPHAN_MIN_LIFE,
    RULE_DEATH_BOUND_S,
    TIMEOUT_CALL_S,
    TIMEOUT_REPLY_DELAY_S,
    WAIT_S,
    RuleLimits,
    check_shutdown_took,
)
from .campaign_stats import CampaignStats
from .oracle import (
    Oracle,
    OracleViolation,
    Phase,
    check_released,
    check_traces,
    null_tokens,
)
from .pools import ClientFactory, ClientPool, Live, check_orphan_exits, close_and_check
from .stateful_base import ADD_DRAWS, CampaignMachine, safe_note

__all__ = ["EngineClientStateMachine"]

MALFORMED = (
    [b"\x07\x90"],  # unknown request type
    [RequestType.ADD.value + b"\xc1"],  # not msgpack
    [RequestType.ABORT.value + b"\x91\x07"],  # ids must be strings
    [RequestType.ADD.value],  # a type byte and no payload
    [b"", b"", b""],  # empty frames, each a message of its own
    [RequestType.UTILITY.value + b"\x93\x00"],  # truncated
    [RequestType.ABORT.value + b"\x90", b"\x07stray"],  # a part nothing refers to
)


class EngineClientStateMachine(CampaignMachine):
    """Random add/abort/utility/sleep/pause/crash/shutdown sequences, judged by the oracle."""

    live: Live
    # How long an engine's death may take to be seen. A launched engine's exit is seen at
    # once (its process sentinel); StandaloneEngineStateMachine widens it by the heartbeat
    # deadline, all that tells an attached client of a death.
    death_bound_s = RULE_DEATH_BOUND_S

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
        super().__init__(kind=kind, kinds=cf.CLIENT_KINDS, faults=faults, vocab_size=vocab_size,
                         stats=stats if stats is not None else CampaignStats(),
                         min_life=min_life)
        self.pool = pool if pool is not None else ClientPool(factory, self.stats)
        self._own_pool = pool is None
        self.contract = declared_contract(factory)
        self.orphan_config = orphan_config
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
            safe_note(line)
        # Tokens of prompts as the engine reported them cached (num_cached_tokens), by id.
        self._cached: dict[str, int] = {}
        self._prompt_lens: dict[str, int] = {}
        self.oracle = Oracle(exact_tokens=self.exact_tokens)
        self._orphans = 0
        self.orphan_min_life = orphan_min_life
        self.stats.examples += 1

    # -- plumbing ---------------------------------------------------------------------------

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

    def _observe(self, batch: EngineCoreOutputs) -> None:
        super()._observe(batch)
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

    def _arm(self, spec: str) -> None:
        if not self.faults:
            # Every fault rule is gated on ``faults``; one that is not must fail loudly here,
            # never inject into a run that promised none (``--faults off``).
            raise OracleViolation(f"fault {spec!r} armed in a run with faults off")
        if self.multiprocess:
            self.cut.call_utility("arm_fault", spec)
        else:
            self.cut.client.engine.fault_hook.arm(spec)

    def _echo_back(self, value: str, when: str) -> None:
        """An echo ``when`` something that must not disturb the next reply: it comes back."""
        got = self.cut.call_utility("echo", value)
        if got != value:
            raise OracleViolation(f"echo({value!r}) {when} returned {got!r}")

    def _engine_pid(self) -> int | None:
        """The pid of the engine process the fault rules kill or stop (None: in-process)."""
        return self.cut.engine_pid

    def _await_death(self, futs: list[concurrent.futures.Future[Any]], start: float,
                     what: str) -> None:
        """Each of ``futs`` (blocked calls) must fail with EngineDeadError within the bound."""
        for fut in futs:
            try:
                fut.result(timeout=self.death_bound_s + 3)
            except EngineDeadError:
                self._read_ended(fut)
            except concurrent.futures.TimeoutError:
                raise OracleViolation(
                    f"{what}: a blocked call was not woken by the engine's death") from None
            else:
                raise OracleViolation(f"{what}: returned instead of raising EngineDeadError")
        if not wait_until(lambda: self.cut.client.is_dead,
                          start + self.death_bound_s - time.monotonic(), poll=0.002):
            raise OracleViolation(f"{what}: death not seen within {self.death_bound_s} s")
        self.oracle.died()

    def _wait_pending(self, n: int, call: concurrent.futures.Future[Any] | None = None) -> None:
        if wait_until(lambda: self._pending_calls() == n
                      or (n and call is not None and call.done()), WAIT_S, poll=0.001) and (
                self._pending_calls() == n):
            return
        why = ""
        if call is not None and call.done():  # it ended instead of staying pending
            err = call.exception()
            why = (f"; the call ended: {type(err).__name__}: {err}" if err is not None
                   else f"; the call returned {call.result()!r}")
        raise OracleViolation(
            f"{self._pending_calls()} utility calls pending, not {n} (client"
            f" {self.cut.client.state.name}){why}")

    # -- requests ---------------------------------------------------------------------------

    def _request(self, rid: str, prompt: list[int], *args: Any, **kwargs: Any
                 ) -> tuple[EngineCoreRequest, list[int] | None, int | None]:
        self._prompt_lens[rid] = len(prompt)  # what _check_cached judges against
        return super()._request(rid, prompt, *args, **kwargs)

    @precondition(lambda self: self.alive)
    @rule(**ADD_DRAWS, ignore_eos=st.booleans(), temperature=st.sampled_from([0.0, 0.7, 1.0]),
          top_p=st.sampled_from([1.0, 0.9]))
    def add(self, prompt: list[int], max_tokens: int, seed: int, stop_at: int | None,
            ignore_eos: bool, temperature: float, top_p: float, reuse: int) -> None:
        with self._rule("add", locals()):
            if self._full("add"):
                return
            prompt = self._prompt(*prompt)[:self.limits.max_model_len - 1]
            rid = self._pick_id(reuse)
            req, expected, stop_index = self._request(rid, prompt, max_tokens, seed, stop_at,
                                                      ignore_eos, temperature, top_p)
            self._send(req, expected, stop_index)

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
                safe_note(f"add_then_abort: {n}-token requests (max_model_len) may outrun the"
                     " abort; not judged")
                return
            if gap > ABORT_GAP_S:
                safe_note(f"add_then_abort: {gap * 1000:.1f} ms between the sends; not judged")
                return
            self._expect_aborted(ids, "right after its ADD", "the abort overtook its ADD")

    # -- utilities --------------------------------------------------------------------------

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
            self._echo_back("slow", "delayed by an armed fault")
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
            self._echo_back("after", "after a timed-out call (its late reply must be dropped)")

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
            self._echo_back("after", "after a cancelled call (its late reply must be dropped)")

    # -- sleep, wake, pause -----------------------------------------------------------------

    def _read_queued(self) -> bool:
        # The reply means "idle": the outputs it waited for arrived before it, so they are
        # already queued. Read exactly those (reading on would let a late drain catch up).
        # In-process they are the batches stepped while the call drove the drain.
        client = self.cut.client
        qsize = getattr(getattr(client, "_outputs", None), "qsize", None)
        if qsize is None:
            qsize = getattr(client, "queued_outputs", None)
        queued = qsize() if qsize is not None else None
        with contextlib.suppress(EngineDeadError):
            if queued is None:  # a user's client: read what comes within a short window
                while self._poll(0.01).outputs:
                    pass
            for _ in range(queued or 0):
                self._poll(WAIT_S)
        return queued is not None

    @precondition(lambda self: self.alive and not self.oracle.paused)
    @rule(level=st.sampled_from([None, 0, 1, 2]))
    def wait_mode(self, level: int | None) -> None:
        """sleep(level, 'wait') (or pause(wait) when ``level`` is None) with requests running:
        the reply means every one of them finished, and each output arrives once; then a
        full wake-up. In-process see ``_wait_in_process``."""
        with self._rule("wait_mode", locals()):
            self._work_in_flight("wait")
            if not self.multiprocess:
                self._wait_in_process(level)
            elif level is None:
                self.cut._call("pause_scheduler", "wait")
            else:
                self.cut.sleep(level, "wait")
            self._after_pause("wait", level)
            if not self.multiprocess:
                # Every batch of the drain was read: a paused engine's next step has nothing.
                extra = self._poll(0).outputs
                if extra:
                    raise OracleViolation(
                        f"a step after the in-process {'pause' if level is None else 'sleep'}"
                        f"(wait) returned {[o.request_id for o in extra]}: the drain's"
                        " outputs did not all come with it")
            if self.alive:
                self._audit()  # the deferred reply is gone from the engine's books
            if self.cut.wake_up(None) is not True:
                raise OracleViolation("wake_up(None) after a wait-mode sleep was not full")
            self.oracle.wake(None)

    def _wait_in_process(self, level: int | None) -> None:
        """``wait_mode`` on the in-process client, whose typed ``sleep`` and
        ``pause_scheduler`` refuse wait mode (nothing would step the engine while they
        wait). The raw utility is served: the engine's deferred reply (a Future) resolves in
        the step that drains its last request, and the client steps the engine inside the
        call until then, keeping each step's batch for later reads
        (``InprocClient._drive_deferred``). Outputs are in flight around it: the requests
        have streamed a step, read here, and the rest of the drain, the resolving step's
        outputs included, waits to be read after the reply (``_read_queued``)."""
        self._poll(0)
        if level is None:
            self.cut.call_utility("pause_scheduler", "wait")
        else:
            self.cut.call_utility("sleep", level, "wait")

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
        self._send(req, expected, None)
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
                safe_note("engine_duplicate: nothing live in the engine")
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
                self._send(req, expected, None)
                self._drain([rid])
                ids.append(rid)
            if others:
                safe_note(f"prefix_cache_hit: {others} live; the cache hit is not judged")
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
            self._crash(how, observers)

    def _crash(self, how: str, observers: bool) -> str:
        """``crash``'s body (the standalone machine's too); returns how the engine died, a
        step fault having become a SIGKILL on a paused engine. ``how`` may also be
        ``sigstop``: the engine is stopped and left so, alive but silent, a hang that only a
        heartbeat deadline reveals (whoever stopped it kills it afterwards)."""
        if not self.multiprocess:
            how = "step_raise"  # no process to kill in-process
        elif how.startswith("step") and self.oracle.paused:
            how = "sigkill"  # a paused subprocess engine does not step
        self.stats.faults[how] += 1
        blocked: list[concurrent.futures.Future[Any]] = []
        # A SIGKILL and a SIGSTOP always have witnesses.
        observers = observers or how in ("sigkill", "sigstop")
        if observers and self.multiprocess:
            self._quiesce()  # no output may satisfy the blocked read
            blocked.append(self._submit_read())
            # The read is waiting once a round trip issued after it has completed.
            self.cut.call_utility("echo", 0)
        if how.startswith("step"):
            self._crash_in_step(how, blocked)
            return how
        pid = self._engine_pid()
        assert pid is not None
        start = time.monotonic()
        if observers:
            cf.stop_process(pid)  # the call below stays pending
            # The engine's last message came before this: a heartbeat deadline runs from here.
            start = time.monotonic()
            try:
                blocked.append(self.cut.submit("call_utility", "echo", "pending"))
                self._wait_pending(1, blocked[-1])
            except BaseException:
                os.kill(pid, signal.SIGKILL)
                raise
        if how == "sigkill":
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
        self._await_death(blocked, start, how)
        return how

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

        deadline = start + self.death_bound_s + 3
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
    @rule(frames=st.sampled_from(MALFORMED) | st.lists(st.binary(max_size=6), min_size=1,
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
            if ok != "still serving":
                raise OracleViolation(f"echo('still serving') after malformed frames"
                                      f" {frames!r} returned {ok!r}")

    @precondition(lambda self: self.faults and self.orphan_config is not None
                  and self._orphans == 0 and self._life >= self.orphan_min_life)
    @rule()
    def orphaned_engine(self) -> None:
        """A client process SIGKILLed: its engine exits by itself (one per example: slow)."""
        with self._rule("orphaned_engine", locals()):
            self._orphans += 1
            self.stats.faults["client_sigkill"] += 1
            assert self.orphan_config is not None
            check_orphan_exits(self.orphan_config)

    # -- shutdown and restart ---------------------------------------------------------------

    @precondition(lambda self: self.oracle.phase is not Phase.CLOSED
                  and self._life >= 2 * self.min_life)
    @rule(with_pending=st.booleans())
    def shutdown(self, with_pending: bool) -> None:
        """Shutdown is clean: blocked calls fail with ClientClosedError, never EngineDeadError
        (either, where the factory declares CLOSED_IS_DEAD); it is bounded and releases
        everything. ``with_pending`` blocks a read and, only when faults are on, a utility
        call held pending by a SIGSTOPped engine. With faults on every shutdown has them: a
        shutdown runs about once per client in a short run, and a coin flip left the pending
        case (what shows a shutdown that fails calls with the wrong error) to the luck of
        the derandomized draw."""
        with_pending = with_pending or self.faults
        with self._rule("shutdown", locals()):
            pending: list[concurrent.futures.Future[Any]] = []
            pid = self.cut.engine_pid
            stopped = False
            if with_pending and self.alive and self.multiprocess:
                self._quiesce()
                pending.append(self._submit_read())
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
            self._expect_closed(pending, "a call blocked at shutdown")
            check_shutdown_took(took)
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
            self._check_restarted()

    def _check_restarted(self) -> None:
        """What ``restart`` judges of the new client (nothing here)."""

    # -- invariants and teardown ------------------------------------------------------------

    @invariant()
    def client_state_matches_model(self) -> None:
        if self._busy is not None:
            return
        problem = self._client_state_problem()
        if problem is not None:
            self._invariant_failed("client_state_matches_model", problem)

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

    def _hand_back(self) -> None:
        if self._own_pool:
            self._finish_client(check=True)
        else:
            self.pool.release(self.live)
