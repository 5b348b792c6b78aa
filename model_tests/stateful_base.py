"""What every campaign machine shares: ``CampaignStats`` (campaign_stats.py),
the counters of a campaign, and ``CampaignMachine``, the base of ``EngineClientStateMachine``
(one engine) and ``DataParallelStateMachine`` (N engines); how it judges a client after its
end is ``_after_end.py``.

``CampaignMachine`` holds the plumbing (a rule counted, timed and written to the example's
program; ids, prompts and requests; reads judged by the oracle; drains), the rules both
machines run with the same strategies (``add_duplicate``, ``abort``, ``add_at_limit``,
``abort_mid_generation``, ``abort_while_paused``, ``drain``, ``poll``, ``echo``, ``sleep``,
``pause``, ``wake_up``, ``sleep_then_wake``, ``resume``, ``call_after_end``), and the
teardown's liveness obligations. Where the two differ, a rule calls a hook its machine
overrides (``_check_*``, ``_read_queued``, ``_drain_context``, ``_unexpected_death``).
Hypothesis orders rules by name, wherever they are defined, so a rule here draws as it did in
its machine's own file. The theory of operation is ``stateful_client.py``'s; the
data-parallel differences are ``stateful_dp.py``'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict

import msgspec
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from ..protocol.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason, SamplingParams
from ..runtime.engine import WAKE_TAGS
from ..spec.errors import ClientClosedError, EngineDeadError, SpecViolation, UtilityError
from . import conformance as cf
from ._after_end import check_calls_refused
from ._after_end import names as _names
from ._conformance_driver import Declared
from .bounds import (
    MAX_LIVE,
    RULE_DEATH_BOUND_S,
    WAIT_MODE_TOKENS,
    WAIT_S,
    RuleLimits,
)
from .campaign_stats import CampaignStats
from .oracle import (
    Oracle,
    OracleViolation,
    Phase,
    RequestModel,
    check_traces,
    null_tokens,
)

if TYPE_CHECKING:
    from .reference import DifferentialOracle


def safe_note(text: str) -> None:
    """``hypothesis.note`` inside a test; nothing when a reproducer runs as a plain program
    (where ``note`` raises)."""
    with contextlib.suppress(InvalidArgument):
        note(text)


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6,
)
_WAKE_TAG_LISTS = st.lists(st.sampled_from(WAKE_TAGS), unique=True, max_size=len(WAKE_TAGS))
_WAKE_TAG_SETS = st.one_of(st.none(), _WAKE_TAG_LISTS)


class _AddDraws(TypedDict):
    prompt: st.SearchStrategy[list[int]]
    max_tokens: st.SearchStrategy[int]
    seed: st.SearchStrategy[int]
    stop_at: st.SearchStrategy[int | None]
    reuse: st.SearchStrategy[int]


# What every machine's ``add`` draws (each adds its own): a prompt (folded into the
# vocabulary), max_tokens, a seed, where a stop token falls, and ``reuse`` (``_pick_id``).
# A stop position counts from the end when negative (-1: the last token allowed), drawn as
# often as one from the start: a stop on the last position is a boundary (vLLM's check_stop
# tested the length cap first), which a uniform draw met once in 24.
ADD_DRAWS = _AddDraws(prompt=st.lists(st.integers(3, 511), min_size=1, max_size=8),
                      max_tokens=st.integers(1, 24), seed=st.integers(0, 2**31 - 1),
                      stop_at=st.none() | st.sampled_from([-1, -2]) | st.integers(0, 23),
                      reuse=st.integers(0, 7))


class CampaignMachine(RuleBasedStateMachine):
    """The plumbing, shared rules and teardown of the campaign machines (see the module
    docstring); not a machine of its own. ``live`` is the client incarnation (``None``
    between two data-parallel clients), ``cut`` its ``ClientUnderTest``."""

    live: Any
    oracle: Oracle
    pool: Any
    limits: RuleLimits
    exact_tokens: bool
    # Set by whoever builds the machine (the campaign, for a real model): every finished
    # greedy request is compared with its lone run (reference.py). None: not compared.
    reference: DifferentialOracle | None = None
    # What the client's factory declares where its contract differs from enginewire's
    # (``Declared``, _conformance_driver.py): the judgements that read it say so. The
    # built-in clients declare nothing.
    contract: Mapping[str, str] = types.MappingProxyType({})

    def __init__(self, *, kind: str, kinds: tuple[str, ...], faults: bool, vocab_size: int,
                 stats: CampaignStats, min_life: int) -> None:
        super().__init__()
        if kind not in kinds:
            raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
        self.kind = kind
        self.faults = faults
        self.vocab_size = vocab_size
        self.stats = stats
        self.multiprocess = kind != "inproc"
        # This example as a program (Hypothesis' own printout of it is lost when it reports
        # the replay as flaky, as a timing-dependent failure can make it).
        self._program = [f"state = {type(self).__name__}()"]
        self._ids = 0
        self._busy: str | None = None
        # Steps this client incarnation has lived: crash and shutdown wait for ``min_life``
        # so that most steps run on a live engine (an engine start costs seconds).
        self._life = 0
        self.min_life = min_life
        # The last request built under each id (what the differential oracle replays alone),
        # and the finished ones waiting for their comparison at the end of the rule.
        self._sent: dict[str, EngineCoreRequest] = {}
        self._to_compare: list[tuple[RequestModel, EngineCoreRequest]] = []
        # The model whose engine trace was drained last (``_check_engine_trace``): a new one
        # (a new example, client or front end) first drains what came before it, unjudged.
        self._trace_oracle: Oracle | None = None
        # Reads left blocked (``_submit_read``) not yet judged: a death one of them delivers
        # counts as delivered (``Oracle.death_read``).
        self._blocked_reads: list[concurrent.futures.Future[Any]] = []

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def cut(self) -> cf.ClientUnderTest:
        assert self.live is not None
        cut: cf.ClientUnderTest = self.live.cut
        return cut

    @property
    def alive(self) -> bool:
        return self.live is not None and self.oracle.phase is Phase.ALIVE

    @property
    def client_checks_ids(self) -> bool:
        """Whether the client refuses a live request id itself. One whose factory declares
        NO_DUPLICATE_ID_CHECK relies on the layer above it, which never sends one: neither
        does this machine."""
        return Declared.NO_DUPLICATE_ID_CHECK not in self.contract

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
        was_alive = self.alive
        try:
            self._trace_baseline()
            yield
            if was_alive and self.live is not None and not self.alive:
                # The engine died, or the client was shut, in this rule: at once, every call
                # must now refuse (a silently accepted one is found where it happens).
                self._check_calls_refused()
            took = time.monotonic() - start
            self._compare_finished()  # after the rule's bounded waits, outside its time
        except BaseException as e:
            self.stats.record_failure(name, e, self._program)
            raise
        self.stats.seconds[name] += took
        self._busy = None

    def _fresh_id(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    def _pick_id(self, reuse: int) -> str:
        """``add``'s id: now and then (``reuse`` < 2) a finished one, which may be reused once
        its request finished; else a fresh one."""
        done = self.oracle.finished_ids
        return done[-1 - reuse % len(done)] if reuse < 2 and done else self._fresh_id()

    def _token(self, t: int) -> int:
        """A drawn token id folded into the vocabulary (ids below 3 are reserved)."""
        if self.vocab_size <= 3:
            return t % self.vocab_size
        return t if t < self.vocab_size else 3 + (t - 3) % (self.vocab_size - 3)

    def _prompt(self, *tokens: int) -> list[int]:
        return [self._token(t) for t in tokens]

    def _full(self, rule: str, n: int = 1) -> bool:
        """Whether ``n`` more requests would pass MAX_LIVE. Checked in the rule, not in a
        precondition: how many are live depends on how far the engine got, and a rule choice
        that depends on timing cannot be replayed (Hypothesis reports it as flaky)."""
        if len(self.oracle.live_ids()) + n <= MAX_LIVE:
            return False
        safe_note(f"{rule}: {MAX_LIVE} requests live already; skipped")
        return True

    def _closed_refusal(self) -> tuple[type[BaseException], ...]:
        """What a call owes the caller once the client was shut: ClientClosedError, or
        EngineDeadError too where the factory declares CLOSED_IS_DEAD."""
        if Declared.CLOSED_IS_DEAD in self.contract:
            return (ClientClosedError, EngineDeadError)
        return (ClientClosedError,)

    def _refusal(self) -> tuple[type[BaseException], ...]:
        """What every call owes the caller once the engine died or the client was shut."""
        return (EngineDeadError,) if self.oracle.phase is Phase.DEAD else self._closed_refusal()

    def _closed_as_dead(self) -> bool:
        """A shut-down client whose factory declares CLOSED_IS_DEAD: its aborts and reads are
        judged as a dead one's."""
        return self.oracle.phase is Phase.CLOSED and Declared.CLOSED_IS_DEAD in self.contract

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

    def _expect_closed(self, futs: list[concurrent.futures.Future[Any]], what: str, *,
                       returned_ok: bool = False) -> None:
        """Each of ``futs``, ``what`` (calls blocked as the client went), ends with
        ClientClosedError (``_closed_refusal``) within the bound; with ``returned_ok`` a value
        that beat the shutdown is allowed too (and judged, when it is a batch of outputs)."""
        closed = self._closed_refusal()
        for fut in futs:
            try:
                got = fut.result(timeout=RULE_DEATH_BOUND_S + 3)
            except closed:
                self._read_ended(fut)
                continue
            except concurrent.futures.TimeoutError:
                raise OracleViolation(f"{what} was never woken") from None
            except BaseException as e:
                raise OracleViolation(f"{what} raised {type(e).__name__}: {e}, not"
                                      f" {_names(closed)}") from e
            if not returned_ok:
                raise OracleViolation(f"{what} returned a value")
            if isinstance(got, EngineCoreOutputs):
                self._observe(got)

    def _observe(self, batch: EngineCoreOutputs) -> None:
        if not batch.outputs:
            return
        done = self.oracle.observe(batch)
        if done and self.reference is not None:
            self._queue_comparisons(done)

    def _queue_comparisons(self, done: list[str]) -> None:
        """The requests of ``done`` the differential oracle judges: ended LENGTH or STOP,
        greedy, built by this machine. Compared at the end of the rule (``_rule``), not
        here: a read inside a bounded wait must not wait for a lone run."""
        assert self.reference is not None
        for rid in done:
            m, req = self.oracle.requests[rid], self._sent.get(rid)
            if (req is not None and m.finish in (FinishReason.LENGTH, FinishReason.STOP)
                    and self.reference.applies(req)):
                # The model object, not the id: a reused id gets a new one.
                self._to_compare.append((m, req))

    def _compare_finished(self) -> None:
        """Judge the queued finished requests against their lone runs (OracleViolation)."""
        if not self._to_compare:
            return
        assert self.reference is not None
        start = time.monotonic()
        try:
            while self._to_compare:
                m, req = self._to_compare.pop(0)
                assert m.finish is not None
                self.stats.reference_compared += 1
                self.stats.reference_ties += self.reference.check(
                    req, m.tokens, m.finish, rid=m.rid, history=m.describe_history())
        finally:
            self.stats.seconds["(differential oracle)"] += time.monotonic() - start

    def _poll(self, timeout: float) -> EngineCoreOutputs:
        try:
            batch = self.cut.get_output(timeout=timeout)
        except EngineDeadError:
            self.oracle.death_read()
            raise
        self._observe(batch)
        return batch

    def _submit_read(self) -> concurrent.futures.Future[Any]:
        """A get_output left blocked; whoever judges its end calls ``_read_ended``."""
        fut = self.cut.submit("get_output")
        self._blocked_reads.append(fut)
        return fut

    def _read_ended(self, fut: concurrent.futures.Future[Any]) -> None:
        """``fut`` ended: if it is a read of ``_submit_read`` that raised EngineDeadError,
        the death reached the caller (what DEAD_DELIVERED_ONCE counts)."""
        if fut not in self._blocked_reads:
            return
        self._blocked_reads.remove(fut)
        if fut.done() and not fut.cancelled() and isinstance(fut.exception(), EngineDeadError):
            self.oracle.death_read()

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
                raise OracleViolation(f"drain: {left} did not finish within {bound} s"
                                      f" ({self._drain_context(left)})")
            try:
                self._poll(0.2)
            except EngineDeadError:
                if self.oracle.phase is Phase.ALIVE:
                    raise OracleViolation(self._unexpected_death()) from None
                self.oracle.died()
                return

    def _drain_context(self, left: list[str]) -> str:
        """What a drain that timed out says of the system, beside the ids ``left``."""
        return f"engine paused={self.oracle.paused}, client {self.cut.client.state.name}"

    def _unexpected_death(self) -> str:
        """What a read that raised EngineDeadError on a live model says."""
        return "the engine died without a fault being injected"

    def _quiesce(self) -> None:
        """End every live request (abort, drain): no output can then reach a blocked read."""
        live = self.oracle.live_ids()
        if live:
            self.cut.abort_requests(live)
            self.oracle.abort(live)
            self._drain(live)

    def _pending_calls(self) -> int:
        fn = getattr(self.cut.client, "pending_utility_calls", None)
        return 0 if fn is None else int(fn())

    def _request(self, rid: str, prompt: list[int], max_tokens: int, seed: int,
                 stop_at: int | None, ignore_eos: bool = False, temperature: float = 0.0,
                 top_p: float = 1.0, *, rank: int | None = None,
                 ) -> tuple[EngineCoreRequest, list[int] | None, int | None]:
        """The ADD for ``rid`` (``rank``: pinned to that engine), sized to fit max_model_len,
        with the null model's tokens and the index of its first stop token when exact
        (``stop_at``: where the stop token is, from the end when negative)."""
        expected = None
        stop_ids: list[int] = []
        stop_index = None
        max_tokens = self.limits.cap(len(prompt), max_tokens)
        if self.exact_tokens:
            expected = null_tokens(seed, len(prompt), max_tokens, self.vocab_size)
            if stop_at is not None and -max_tokens <= stop_at < max_tokens:
                stop_ids = [expected[stop_at]]
                stop_index = expected.index(expected[stop_at])  # the first hit stops it
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
        req = EngineCoreRequest(rid, prompt, sp, data_parallel_rank=rank)
        # Every machine builds its requests here (a reused id only once its last one
        # finished), so this is where the differential oracle learns what each id asked.
        self._sent[rid] = req
        return req, expected, stop_index

    def _send(self, req: EngineCoreRequest, expected: list[int] | None,
              stop_index: int | None) -> None:
        """Add ``req`` and tell the model."""
        self._sent[req.request_id] = req
        self._trace_baseline()
        self.cut.add_request(req)
        self.oracle.add(req.request_id, req.sampling_params.max_tokens, expected, stop_index)

    def _work_in_flight(self, mode: str) -> None:
        """A wait-mode pause is only interesting with requests to drain: add a long one (it
        cannot finish before the pause arrives, so the pause must really wait for it)."""
        if mode != "wait" or self.oracle.paused or len(self.oracle.live_ids()) >= MAX_LIVE:
            return
        rid = self._fresh_id()
        req, expected, _ = self._request(rid, self._prompt(5, 6, 7), WAIT_MODE_TOKENS, 11, None,
                                         True)
        self._send(req, expected, None)

    def _after_pause(self, mode: str, level: int | None) -> None:
        drained = self.oracle.pause(mode, level)
        if mode != "wait" or not drained:
            return
        self._read_queued()
        early = [r for r in drained if not self.oracle.requests[r].finished]
        if early:
            raise OracleViolation(f"sleep/pause(wait) replied before {early} finished")

    def _read_queued(self) -> bool:
        """After a pause's reply: read the outputs that arrived before it and are queued, and
        no more (reading on would let a late drain catch up). True when exactly those were
        read; False when the client's queue cannot be seen and a short window was read."""
        raise NotImplementedError

    def _record_trace(self) -> None:
        trace = self.cut.trace
        if trace is None:
            return
        self.stats.coverage.add(trace)
        try:
            check_traces(trace)
        finally:
            del trace[:]

    def _client_state_problem(self) -> str | None:
        """What is wrong with the client's state, as the model sees it (None: nothing)."""
        state = self.cut.client.state
        allowed = self.oracle.expected_client_states()
        if state in allowed:
            return None
        return f"client is {state.name}; the model allows {sorted(s.name for s in allowed)}"

    def _invariant_failed(self, name: str, problem: str) -> NoReturn:
        err = OracleViolation(problem)
        # Recorded like a rule's failure: Hypothesis may replace it by a Flaky report.
        self.stats.record_failure(f"invariant {name}", err, self._program)
        raise err

    # -- requests ---------------------------------------------------------------------------

    @precondition(lambda self: self.alive and self.client_checks_ids)
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def add_duplicate(self, pick: int) -> None:
        with self._rule("add_duplicate", locals()):
            # Live as the client sees it: not yet observed finished.
            live = self.oracle.live_ids()
            if not live:
                # All read finished (a multi-process engine runs between rules): one of its
                # own, live until a read sees it end, so that every draw of the rule judges
                # a duplicate (10 derandomized sync examples met none live).
                rid = self._fresh_id()
                req, expected, _ = self._request(rid, self._prompt(5, 6), 8, 17, None, True)
                self._send(req, expected, None)
                live = [rid]
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
            self.cut.abort_requests(ids)  # to each owner; silent on a dead engine
            self.oracle.abort(ids)
            if self.alive and ids[0] in live:
                # Read after the abort (one input queue): the aborted requests are gone from
                # the engine, so blocks they still hold show as held by no live request.
                self._audit()

    @precondition(lambda self: self.alive)
    @rule(limit=st.sampled_from(["model_len", "block", "stop_last"]),
          delta=st.sampled_from([-1, 0, 1]), seed=st.integers(0, 2**31 - 1))
    def add_at_limit(self, limit: str, delta: int, seed: int) -> None:
        """A request at a limit, where off-by-one bugs live: a prompt that leaves 1, 0 or -1
        tokens under ``max_model_len`` with more ``max_tokens`` than fit (the engine must end
        it LENGTH at the model length, exactly, or refuse an over-long prompt), a prompt one
        token short of, on, or past a whole number of KV blocks, a stop token on the last
        allowed position (STOP, not LENGTH). The oracle knows the exact count and reason,
        and judges it before the rule ends: the request is drained here (when the engine
        schedules). In-process nothing steps between two rules, so a limit request left to
        the later ones was mostly aborted, parked or killed before its last token, the one
        this rule is about (48 in-process examples never judged a stop on the last one)."""
        with self._rule("add_at_limit", locals()):
            if self._full("add_at_limit"):
                return
            if limit == "model_len" and getattr(self.cut.client, "config", None) is None:
                safe_note("add_at_limit: the client has no config; max_model_len unknown")
                return
            rid = self._fresh_id()
            self._add_at_limit(rid, limit, delta, seed)
            if not self.oracle.paused:
                self._drain([rid])

    def _add_at_limit(self, rid: str, limit: str, delta: int, seed: int) -> None:
        """``add_at_limit``'s request, sent and told to the model."""
        lim = self.limits
        if limit == "model_len":
            n = lim.max_model_len - 1 + delta  # leaves 1, 0 tokens, or one too many
            if n > lim.max_model_len:
                prompt = self._prompt(*range(3, 3 + n))
                self.cut.add_request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=4)))
                self.oracle.add(rid, 4, None, None, invalid=True)
                return
            asked, stop_at = 8, None
        elif limit == "block":
            n = max(1, 2 * lim.block_size + delta)
            asked, stop_at = 6, None
        else:
            n, asked = 4, 6
            stop_at = asked - 1 + min(delta, 0)  # the last position, or the one before
        prompt = self._prompt(*range(3, 3 + n))
        req, expected, stop_index = self._request(rid, prompt, asked, seed, stop_at, True)
        if req.sampling_params.max_tokens != asked:
            # Ask for more than fits: the engine, not this harness, must clamp it.
            req = msgspec.structs.replace(req, sampling_params=msgspec.structs.replace(
                req.sampling_params, max_tokens=asked))
            self._sent[rid] = req
            self.cut.add_request(req)
            self.oracle.add(rid, self.limits.cap(n, asked), expected, stop_index)
        else:
            self._send(req, expected, stop_index)

    @precondition(lambda self: self.alive and not self.oracle.paused)
    @rule(k=st.integers(1, 3), mix=st.sampled_from(["live", "mixed", "repeated"]))
    def abort_mid_generation(self, k: int, mix: str) -> None:
        """Requests aborted once they generate (so they hold KV blocks), in one list that may
        mix in a finished, an unknown and repeated ids: each live one ends once, with ABORT
        or a finish that raced it (in-process nothing can race it: ABORT), nothing else
        changes, and the books balance after."""
        with self._rule("abort_mid_generation", locals()):
            if self._full("abort_mid_generation", k):
                return
            ids = self._generating("abort_mid_generation", k)
            batch = self._abort_list(ids, k, mix)
            # Live when the abort goes (a small max_model_len can end one in the poll above).
            live = [r for r in ids if not self.oracle.requests[r].finished]
            self.cut.abort_requests(batch)
            self.oracle.abort(batch)
            self._audit()
            self._drain(ids)
            self._audit()
            if not self.multiprocess:
                # The in-process abort reaches the engine before its next step: only ABORT can
                # end a request that was live when it went.
                self._expect_aborted(live, f"mid-generation (in {batch})", "the abort was lost")

    @precondition(lambda self: self.alive and not self.oracle.paused)
    @rule(k=st.integers(1, 3), mix=st.sampled_from(["mixed", "repeated"]))
    def abort_while_paused(self, k: int, mix: str) -> None:
        """A mixed abort list sent while the scheduler is paused (keep mode): no step can end
        a request between the send and the engine reading the list, so on every client each
        request still live once the pause's reply was read must end ABORT; then a resume."""
        with self._rule("abort_while_paused", locals()):
            if self._full("abort_while_paused", k):
                return
            ids = self._generating("abort_while_paused", k)
            self.cut._call("pause_scheduler", "keep")
            self._after_pause("keep", None)
            # Outputs of the steps before the pause arrived before its reply: read them, so
            # that what is live now is what the engine holds.
            exact = self._read_queued()
            live = [r for r in ids if not self.oracle.requests[r].finished]
            batch = self._abort_list(ids, k, mix)
            self.cut.abort_requests(batch)
            self.oracle.abort(batch)
            self.cut._call("resume_scheduler")
            self.oracle.resume()
            self._drain(ids)
            self._audit()
            if exact:  # a user's client whose queue cannot be read judges only the drain
                self._expect_aborted(live, f"while the scheduler was paused (in {batch})",
                                     "the abort was lost")

    def _generating(self, rule: str, k: int) -> list[str]:
        """``k`` long requests, returned once each produced a token (so each holds blocks)."""
        ids = []
        for i in range(k):
            rid = self._fresh_id()
            req, expected, _ = self._request(rid, self._prompt(4, 5, 6),
                                             self.limits.long_tokens, 7 + i, None, True)
            self._send(req, expected, None)
            ids.append(rid)
        deadline = time.monotonic() + WAIT_S
        while any(not (m := self.oracle.requests[r]).tokens and not m.finished for r in ids):
            if time.monotonic() > deadline:
                raise OracleViolation(f"{rule}: {ids} produced no token within {WAIT_S} s")
            self._poll(0.2)
        return ids

    def _abort_list(self, ids: list[str], k: int, mix: str) -> list[str]:
        """The list an abort rule sends for ``ids``: "live" (them alone), "mixed" (a finished
        and an unknown id first), "repeated" (mixed, then ``ids`` again, reversed)."""
        batch = list(ids)
        if mix != "live":
            # The ids the engine does not know come first: a list that stops at one of them
            # (a `break` for a `continue`) leaves the live ones after it running.
            batch = [*self.oracle.finished_ids[:1], f"never-sent-{k}", *batch]
        if mix == "repeated":
            batch += ids[::-1]
        return batch

    def _expect_aborted(self, ids: list[str], when: str, meaning: str) -> None:
        """Each of ``ids``, aborted ``when`` so that the abort must win, ended ABORT (or has not
        ended yet); any other ending is an OracleViolation that says what it means."""
        for rid in ids:
            m = self.oracle.requests[rid]
            if m.finish is not None and m.finish is not FinishReason.ABORT:
                raise OracleViolation(f"{rid!r} was aborted {when} yet ended {m.finish.name}"
                                      f" after {len(m.tokens)} tokens: {meaning}")

    def _closed_read_refused(self) -> bool:
        """On a shut-down client a read raises ClientClosedError: True when that was judged.
        Where the factory declares CLOSED_IS_DEAD it is read as a dead client is (``poll``):
        what was queued, or the error; ``_check_calls_refused`` judges that the error comes."""
        if self.oracle.phase is not Phase.CLOSED:
            return False
        if self._closed_as_dead():
            with contextlib.suppress(*self._refusal()):
                self._poll(0.01)
            return True
        self._expect_raises(ClientClosedError, lambda: self.cut.get_output(timeout=0.01),
                            "get_output after shutdown")
        return True

    @precondition(lambda self: self.live is not None)
    @rule()
    def drain(self) -> None:
        with self._rule("drain", locals()):
            if self._closed_read_refused():
                return
            self._drain()
            self._check_drained()

    # Whether the oracle knows what memory each audited engine has asleep (a data-parallel
    # engine restarted while the others slept wakes up alone: its machine says so).
    _audit_memory = True

    def _check_drained(self) -> None:
        """What the ``drain`` rule judges once its drain is done: the engine's books, which
        no output shows (a leaked KV block, a request left queued, a reply never sent)."""
        if self.alive:
            self._audit()

    def _audit(self) -> None:
        """``audit_resources`` on every engine, judged by the oracle (``check_audit``)."""
        audits = self.cut.call_utility("audit_resources")
        for i, audit in enumerate(audits if isinstance(audits, list) else [audits]):
            self.oracle.check_audit(audit, engine=f"engine {i}" if isinstance(audits, list)
                                    else "the engine", memory=self._audit_memory)
        self._check_engine_trace()

    # -- the engine's side: its own trace, drained at the sync points ------------------------

    def _trace_baseline(self) -> None:
        """Before a new model's first step reaches the engine: drain what came before it
        (judged against the spec, counted, never matched with this model's requests)."""
        if self.live is not None and self.oracle is not self._trace_oracle:
            self._check_engine_trace()

    def _engine_views(self, n: int) -> list[tuple[int, Any]]:
        """The label and client state of each engine whose drain came back (``n`` of them, in
        the order the client answered): one engine here, its client's state."""
        return [(0, self.cut.client.state)]

    def _check_engine_trace(self) -> None:
        """A sync point of the engine's side: ``drain_trace`` on every engine, judged by
        ``Oracle.judge_engine_traces`` (the spec, each request's ending on both sides, the
        sleep state on both sides, nothing live in the engine when nothing is on the client).
        A subprocess engine's records count toward coverage here (an in-process engine's are
        in the client's trace already). Off where the engines record no trace."""
        baseline = self.oracle is not self._trace_oracle
        self._trace_oracle = self.oracle
        if self.stats.engine_untraced or not self.alive:
            return
        start = time.monotonic()
        try:
            replies = self.cut.call_utility("drain_trace")
        except UtilityError as e:
            if "records no trace" not in str(e) and "no such utility" not in str(e):
                raise
            self.stats.engine_untraced = True
            safe_note(f"the engines keep no trace to drain ({e}): their side is not cross-checked")
            return
        replies = replies if isinstance(replies, list) else [replies]
        views = self._engine_views(len(replies))
        if len(views) != len(replies):
            raise OracleViolation(f"drain_trace answered for {len(replies)} engines; the"
                                  f" model has {len(views)} serving")
        if baseline and self.oracle.requests:  # it reached the engine before this drain
            self.oracle.engine_unjudged |= set(self.oracle.requests)
        dropped = self.oracle.trace_incomplete
        entries = self.oracle.judge_engine_traces(
            [(label, reply, view) for (label, view), reply in zip(views, replies, strict=True)],
            baseline=baseline)
        self.stats.engine_drains += 1
        self.stats.engine_records_dropped += self.oracle.trace_incomplete - dropped
        if self.multiprocess:
            self.stats.coverage.add(entries)
        self.stats.seconds["(engine trace)"] += time.monotonic() - start

    @precondition(lambda self: self.live is not None)
    @rule()
    def poll(self) -> None:
        """Always enabled: one short read, judged (or the refusal a dead/closed client owes)."""
        with self._rule("poll", locals()):
            if self._closed_read_refused():
                return
            try:
                self._poll(0.005)
            except EngineDeadError:
                if self.alive:
                    raise OracleViolation(self._unexpected_death()) from None

    # -- utilities --------------------------------------------------------------------------

    @precondition(lambda self: self.live is not None)
    @rule(value=_JSONISH)
    def echo(self, value: Any) -> None:
        """A round trip (on a data-parallel client, to one serving engine, whichever died)."""
        with self._rule("echo", locals()):
            if not self.alive:
                self._expect_raises(self._refusal(), lambda: self.cut.call_utility("echo", value),
                                    "echo on a dead/closed client")
                return
            got = self.cut.call_utility("echo", value)
            if got != value:
                raise OracleViolation(f"echo({value!r}) returned {got!r}")

    # -- sleep, wake, pause -----------------------------------------------------------------

    @precondition(lambda self: self.live is not None)
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
            self._sleep(level, mode)

    def _sleep(self, level: int, mode: str) -> None:
        """``sleep`` on a live client, judged."""
        self._work_in_flight(mode)
        self.cut.sleep(level, mode)
        self._after_pause(mode, level)
        self._check_asleep()
        if self.alive:
            self._audit()
        if not self.cut.is_sleeping():
            raise OracleViolation("is_sleeping() is False right after sleep()")

    def _check_asleep(self) -> None:
        """What ``sleep`` judges once it returned, beside ``is_sleeping()`` (nothing here)."""

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
            if self.alive:
                self._audit()  # what a pause ended or parked must hold its books

    @precondition(lambda self: self.live is not None)
    @rule(tags=_WAKE_TAG_SETS)
    def wake_up(self, tags: list[str] | None) -> None:
        with self._rule("wake_up", locals()):
            if not self.alive:
                self._expect_raises(self._refusal(), lambda: self.cut.wake_up(tags),
                                    "wake_up on a dead/closed client")
                return
            self._wake(tags)

    def _wake(self, tags: list[str] | None) -> None:
        """``wake_up`` on a live client, judged."""
        want = self.oracle.expect_wake(tags)
        got = self.cut.wake_up(tags)
        if got is not want:
            raise OracleViolation(f"wake_up({tags}) returned {got}; the model says {want}"
                                  f" (asleep: {sorted(self.oracle.asleep_tags)})")
        self.oracle.wake(tags)
        self._check_woken(want)
        self._check_engine_trace()  # the engine's state after the ack, as the client's

    @precondition(lambda self: self.alive)
    @rule(level=st.sampled_from([1, 2]), mode=st.sampled_from(["abort", "keep"]),
          tags=_WAKE_TAG_LISTS)
    def sleep_then_wake(self, level: int, mode: str, tags: list[str]) -> None:
        """A short deep sequence in one step: a sleep that releases memory, then at once a
        wake-up with ``tags`` (most draws partial: the engine must stay asleep and say so),
        each judged as ``sleep`` and ``wake_up`` judge it. Two rules in a row rarely drew
        it: in-process a third of the sleeps (wait mode) are refused, a level-0 one releases
        nothing, and a full wake-up, a resume or a crash came between (48 in-process
        examples never met a partial wake-up after a sleep; sync met one in its 4th)."""
        with self._rule("sleep_then_wake", locals()):
            self._sleep(level, mode)
            self._wake(tags)

    def _check_woken(self, full: bool) -> None:
        """What ``wake_up`` judges once the model woke (``full``: all of it; nothing here)."""

    @precondition(lambda self: self.alive)
    @rule()
    def resume(self) -> None:
        with self._rule("resume", locals()):
            if self.oracle.resume_allowed():
                self.cut._call("resume_scheduler")
                self.oracle.resume()
                self._check_engine_trace()
            else:
                # Scheduling cannot resume while memory is released: the engine says so.
                self._expect_raises(UtilityError, lambda: self.cut._call("resume_scheduler"),
                                    "resume_scheduler while asleep")

    @precondition(lambda self: self.live is not None and not self.alive)
    @rule()
    def call_after_end(self) -> None:
        """Every call once the engine died or the client was shut down owes the error the spec
        says (EngineDeadError, ClientClosedError); a silently accepted one is a failure. The
        one exception, as documented: an abort on a dead engine is a no-op (it must not
        raise twice on error paths), and a read first returns what was queued before."""
        with self._rule("call_after_end", locals()):
            self._check_calls_refused()

    def _check_calls_refused(self) -> None:
        """``call_after_end``'s checks, also run by every rule that ended the client."""
        check_calls_refused(self)

    # -- teardown ---------------------------------------------------------------------------

    def _finish_client(self, *, check: bool) -> None:
        """Shut this client down (its release checked when ``check``) and judge its trace."""
        raise NotImplementedError

    def _hand_back(self) -> None:
        """A healthy client at the end of an example: back to its pool."""
        raise NotImplementedError

    def teardown(self) -> None:
        self._program.append("state.teardown()")
        try:
            self._teardown()
            self._compare_finished()  # what the final drain finished
        except BaseException as e:
            self.stats.record_failure("teardown", e, self._program)
            raise

    def _teardown(self) -> None:
        if self.live is None:
            return
        try:
            if self._busy is not None:
                safe_note(f"rule {self._busy} did not finish; discarding its client")
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
            self._check_engine_trace()  # quiescence: the engine must have nothing live either
            self._record_trace()
        except BaseException:
            with contextlib.suppress(Exception):
                self._finish_client(check=False)
            raise
        self._hand_back()
