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

Optionally, a factory hands each client it builds an ``Injector`` (``ClientUnderTest(...,
inject=...)``): requests counted as sent without sending them, batches queued as if the
engine had sent them, an in-process rejection. The scenarios that play a misbehaving engine
or front end (``check_forbidden_output``, ``check_malformed_frames``, and in-process
``check_rejected_add_spares_live_request``) use it and nothing else of the client's insides;
without one they raise ``NotApplicable`` saying so. ``open_client`` gives the built-in
clients theirs.

Skips. A scenario that cannot run on the client under test (a kill or an injected frame on
an in-process client, prefix caching on a config without it) raises ``NotApplicable``,
never returns quietly. It subclasses ``unittest.SkipTest``, which pytest and unittest
report as a skip; elsewhere it is an exception that says why. Limits come from the client's
config: ``max_tokens`` is clamped to what ``max_model_len`` leaves after the prompt. Every
wait is bounded; death must be seen within ``DEATH_BOUND_S``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SamplingParams,
)
from ..spec import (
    ClientState,
    SpecViolation,
    UtilityError,
)

# The driver, the helpers and the engine-breaking scenarios: one import for every user.
from ._conformance_driver import (
    CLIENT_KINDS,
    PROMPT,
    WAIT_S,
    ClientFactory,
    ClientUnderTest,
    Declared,
    Finished,
    Injector,
    NotApplicable,
    check_trace,
    collect,
    fit,
    injector,
    max_new_tokens,
    open_client,
    request,
    stop_process,
)
from .bounds import DEATH_BOUND_S, ORPHAN_BOUND_S
from .conformance_breaking import (
    check_client_kill_engine_exits,
    check_construction_failure_leaks_nothing,
    check_engine_fatal_error,
    check_exits_with_parent,
    check_kill_during_get_output,
    check_kill_during_handshake,
    check_kill_during_utility,
)

__all__ = [
    "CLIENT_KINDS",
    "DEATH_BOUND_S",
    "ORPHAN_BOUND_S",
    "ClientFactory",
    "ClientUnderTest",
    "Declared",
    "Finished",
    "Injector",
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
    "stop_process",
]

# --- scenarios on a live client (safe on a shared, warm engine) ------------------------------


def _expect_echo(cut: ClientUnderTest, value: Any, **kwargs: Any) -> None:
    """``echo`` returns what it was sent (``kwargs``: the call's timeout)."""
    got = cut.call_utility("echo", value, **kwargs)
    assert got == value, f"echo({value!r}) returned {got!r}"


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
        max_tokens = fit(cut, 20, "check_generate")
    elif room is not None and max_tokens > room:
        raise ValueError(f"check_generate(max_tokens={max_tokens}): max_model_len leaves"
                         f" {room} tokens after a {len(PROMPT)}-token prompt")
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
    long_n = fit(cut, 200, "check_abort_half")
    short_n = fit(cut, 20, "check_abort_half")
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
    _expect_echo(cut, value)
    _expect_echo(cut, None)
    try:
        cut.call_utility("profile", "not-an-action")
    except UtilityError as e:
        assert e.method == "profile" and "not-an-action" in e.remote_message, e
    else:
        raise AssertionError("a raising utility must raise UtilityError")
    try:
        cut.call_utility("_private_or_unknown")
    except UtilityError as e:
        assert e.method == "_private_or_unknown", (
            f"the error names {e.method!r}, not the method called")
    else:
        raise AssertionError("an unknown utility must raise UtilityError")
    # An array result travels as an aux frame: a reply of two parts, then a plain one.
    arr = np.arange(100, dtype=np.int64)
    got = cut.call_utility("echo", arr)
    assert np.array_equal(got, arr), f"echo of an array returned {got!r}"
    # The client survives failed calls.
    _expect_echo(cut, 42)
    if cut.multiprocess:
        assert cut.client.pending_utility_calls() == 0, (
            f"{cut.client.pending_utility_calls()} utility calls left pending")
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
    n = fit(cut, 6, "check_bad_arguments")
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
    _expect_echo(cut, 5, timeout=float("inf"))
    _expect_echo(cut, 6, timeout=1e9)
    rid = f"{prefix}-inf"
    cut.add_request(request(rid, max_tokens=1))
    for timeout in (float("inf"), -1.0):
        got = call("get_output", timeout=timeout)
        assert isinstance(got, EngineCoreOutputs), f"get_output(timeout={timeout}) returned {got!r}"
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
        assert cut.client.pending_utility_calls() == 0, (
            f"{cut.client.pending_utility_calls()} utility calls left pending")
    check_trace(cut)


def check_duplicate_request_id(cut: ClientUnderTest, prefix: str = "dup") -> None:
    """A live duplicate id is refused before sending; reuse after finish is fine."""
    rid = f"{prefix}-0"
    n = fit(cut, 5, "check_duplicate_request_id")
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
    n = fit(cut, 20, "check_sleep_wake")
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
    assert cut.is_sleeping(), "is_sleeping() is False right after sleep()"
    assert cut.client.state is ClientState.SLEEPING, (
        f"asleep, the client is {cut.client.state.name}")
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
    assert cut.wake_up() is True, "wake_up() of everything did not report a full wake-up"
    assert not cut.is_sleeping(), "is_sleeping() is True after a full wake_up()"
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
    injector(cut, "check_malformed_frames").track_as_sent(request(rid))
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
    _expect_echo(cut, "still serving")


def check_rejected_add_spares_live_request(cut: ClientUnderTest, prefix: str = "reuse") -> None:
    """A malformed ADD that reuses the id of a live request is dropped: the live request is
    neither finished nor touched (an ERROR under its id, then its stream going on, is
    outputs after a finish), and the engine serves on. Multi-process: the malformed frames
    go on the wire; in-process: the engine's rejection path is driven directly."""
    import msgspec

    # In-process there is no wire: the engine's rejection path is driven through the factory's
    # injector, asked for first so a client without one is left as it was found.
    reject = (None if cut.multiprocess
              else injector(cut, "check_rejected_add_spares_live_request in-process").reject)
    rid = f"{prefix}-0"
    # Long enough to be live still when the pause lands (on a data-parallel client the pause
    # goes to every engine, after the ADD went to one).
    n = fit(cut, 64, "check_rejected_add_spares_live_request")
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
            assert reject is not None
            assert not reject(rid, "malformed request: test"), f"rejecting {rid!r} failed"
        _expect_echo(cut, "after")
    finally:
        cut._call("resume_scheduler")
    got = collect(cut, [rid])[rid]
    _expect_length(rid, got, n)
    check_generate(cut, n=1, prefix=f"{prefix}-after")
    check_trace(cut)


def check_forbidden_output(cut: ClientUnderTest, prefix: str = "forbidden") -> None:
    """An engine output the spec forbids (here, one for an id never sent) costs its batch
    nothing else: ``get_output`` raises SpecViolation naming that id, once, and the next
    call returns the batch's legal outputs, each of which advanced its request once; the
    batches after it follow in order. Needs an idle client: the batches are injected."""
    client = cut.client
    inject = injector(cut, "check_forbidden_output")
    if client.live_requests():
        raise NotApplicable("the injected batches need a client with no live request")
    r1, r2, ghost = f"{prefix}-1", f"{prefix}-2", f"{prefix}-never-sent"
    # Tracked as sent, never sent: the engine produces nothing for them.
    inject.track_as_sent(request(r1))
    inject.track_as_sent(request(r2))
    inject.deliver(EngineCoreOutputs(outputs=[
        EngineCoreOutput(r1, [7], FinishReason.LENGTH),
        EngineCoreOutput(ghost, [8]),
        EngineCoreOutput(r2, [9]),
    ]))
    inject.deliver(EngineCoreOutputs(outputs=[EngineCoreOutput(r2, [10], FinishReason.STOP)]))

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
    assert client.live_requests() == [], f"still live: {client.live_requests()}"
    left = cut.get_output(timeout=0).outputs
    assert left == [], f"the violation was raised once, yet a read returned {left}"
    assert client.queued_outputs() == 0, f"{client.queued_outputs()} batches left queued"


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
    assert cut.client.state is ClientState.SHUTDOWN, (
        f"shut down, the client is {cut.client.state.name}")
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
