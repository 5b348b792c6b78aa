"""The campaign runner: ``EngineClientStateMachine`` on every client, a report, the mutant table.

Theory of operation
-------------------
``run_campaign`` runs the stateful machine (``stateful.py``) on each requested client kind,
sharing one warm engine per kind across examples (``ClientPool``), and writes a report: a text
table and a JSON file under ``results_dir`` with examples, steps, steps/s per client, faults
injected per kind, spec states and transitions covered (and which were never reached, with
the reason when it is known), and every failure with its reproducer printed as a Python
program; beside the JSON, an HTML page of the same report (``coverage_html.py``).

Profiles: ``ci`` is small and deterministic (derandomized, no example database: every run
replays the same examples); ``campaign`` is randomized and keeps a persistent example database
under ``results_dir`` so a long run resumes from what earlier runs found.

Budget: a ``duration`` run gives each client what is left of it split among the clients
still to run, in rounds sized to fit that share (``_share``, ``_round_examples``).

Seeds: a randomized run (the ``campaign`` profile, or any ``duration`` run) without a seed
picks one, prints it and records it in the report, so ``--seed`` replays it; round ``k`` of a
duration run uses ``seed + k`` and each client records its round seeds. A ``ci`` run without
``duration`` or seed is derandomized: every run replays the same examples.

Mutants (``mutants.py``: seeded bugs as source patches of the clean runtime) are switched on
by ``ENGINEWIRE_TESTING_MUTANT``: ``run_campaign(mutant=NAME)`` re-runs itself in a child
process with that variable set, whose ``run_campaign`` applies the mutant first (and so, through
the runtime's preload hook, every engine process the child starts); the child's report says
whether the campaign found the bug (one derandomized round, or with ``duration`` a seeded
duration run of that length). ``mutants_all=True`` does this for the
whole bank and prints the detection table; a mutant none of the requested clients can show is
"n/a" there (not run, and not counted as undetected).

The CLI (``enginewire campaign``) only parses arguments and calls ``run_campaign``; the exit
status is 0 when nothing failed (or, for ``mutants_all``, every applicable mutant was
detected) and 1 otherwise (for a single ``mutant``: 1 means the campaign found it).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .coverage_html import write_coverage_html, write_reproducers
from .mutant_runs import MUTANT_ERROR, new_report_path, run_mutant, run_mutant_table
from .reproducer import reproducer_program
from .unreached import UNREACHED, why_unreached

__all__ = [
    "ALL_CLIENTS",
    "CLIENTS",
    "PROFILES",
    "UNREACHED",
    "ClientResult",
    "load_factory",
    "run_campaign",
]

# "standalone": sync and async front ends taking turns on one engine started on its own
# (stateful.StandaloneEngineStateMachine). A handover costs a client start and an attach (the
# engine answers at the new connection's handshake, about 10 ms after the bind). The mutants
# of the attach path name it alone (only an engine that outlives its front end can show them).
CLIENTS = ("inproc", "sync", "async", "standalone")
PROFILES = ("ci", "campaign")
# The data-parallel machine (stateful_dp.py): its clients, and the backends that place engines.
DP_CLIENTS = ("sync", "async")
DP_BACKENDS = ("mp", "ray")
# "all" is every client kind: a bug that shows only on an engine started on its own (its
# heartbeat, its hand-over) or only over several engines (membership, a broadcast) must be
# in the campaign a user runs by default. The data-parallel clients get 2 engines: the
# fewest that have a membership to lose one of, and what 2 cores run without queueing; they
# add about half to the README's quick run (29 of 60 s on the tiny model, 2 cores).
ALL_DP_ENGINES = 2
ALL_CLIENTS = (*CLIENTS, *(f"dp-{k}" for k in DP_CLIENTS))
# Several front ends over shared engines (stateful_fe.py): two front ends, sync and async
# drawn at each attach, over one engine ("fe") or a data-parallel group ("fe-dp"). Not in
# "all" (a run of its own: ``front_ends=2``); the mutant table runs "fe" for its own class.
FE_CLIENTS = ("fe", "fe-dp")
_THREADS_ENV = "ENGINEWIRE_ENGINE_THREADS"

@dataclass
class ClientResult:
    client: str
    engine_cores: int = 1  # per client: more than one on the data-parallel machine
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    engines_started: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    rules: dict[str, int] = field(default_factory=dict)
    rule_seconds: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    # Errors rules raised before the failure (Hypothesis may report a flaky replay instead).
    errors: list[str] = field(default_factory=list)
    # What Hypothesis raised when it reported its replay as flaky; ``failure`` is then the
    # error that failed the example first, and ``reproducer`` that example's program.
    flaky: str | None = None
    reproducer: str | None = None
    first_failure: tuple[int, float] | None = None
    # The Hypothesis seed of each round (None: derandomized); the last one is the failing
    # round's when ``failure`` is set (``--seed`` replays it).
    round_seeds: list[int | None] = field(default_factory=list)
    # With ``monitor``: what the monitors on this client's links found (monitor.MonitorSink's
    # report less its coverage, which the campaign report's ``monitor`` section merges).
    monitor: dict[str, Any] | None = None

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    @property
    def steps_per_s_warm(self) -> float:
        """Steps per second not counting engine starts and the orphan check (seconds each:
        a spawned interpreter imports torch)."""
        cold = sum(self.rule_seconds.get(k, 0.0)
                   for k in ("(engine start)", "orphaned_engine"))
        # restart includes an engine start, already counted under "(engine start)".
        warm = self.seconds - cold
        return self.steps / warm if warm > 0 else 0.0


def load_factory(ref: str) -> Any:
    """The client factory ``ref`` names as ``module:function`` (the ``ClientFactory`` contract
    of ``enginewire.testing.conformance``); ``ValueError`` naming what is wrong."""
    import importlib

    module, sep, qualname = ref.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"factory {ref!r}: expected module:function, e.g. my_tests.factories:sync")
    if os.getcwd() not in sys.path and "" not in sys.path:
        # As `python -m` does: a factory module beside the caller imports (the console
        # script's sys.path has only its own directory and site-packages).
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"factory {ref!r}: cannot import {module!r}: {e}") from e
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"factory {ref!r}: {module!r} has no {qualname!r}") from None
    if not callable(obj):
        raise ValueError(f"factory {ref!r} is a {type(obj).__name__}, not a callable")
    return obj


def _vocab_size(model: str) -> int:
    """The token ids the campaign draws prompts from: the tiny model's range (every built-in
    and GGUF model has at least that many), narrowed to a smaller vocabulary of the model's."""
    from ..runtime.model import TINY_ARCH, resolve_weight_source

    if model in ("null", "tiny"):
        return TINY_ARCH.vocab_size
    source: Any = resolve_weight_source(model, 0)
    read_arch = getattr(source, "read_arch", None)  # a GGUF file: its header, no tensors
    arch = read_arch() if read_arch is not None else source.load()[0]
    del source, read_arch
    gc.collect()  # the reader's memory map (an open fd) goes with it, not at some later GC
    return min(TINY_ARCH.vocab_size, int(arch.vocab_size))


def _config(model: str, engines: int = 1, backend: str = "mp") -> Any:
    from ..runtime.config import EngineConfig

    dp: dict[str, Any] = {}
    if engines != 1 or backend != "mp":  # the data-parallel machine (stateful_dp.py)
        dp = {"data_parallel_size": engines, "data_parallel_backend": backend}
    # Room for stateful.LONG_MAX_TOKENS on top of short prompts.
    if model in ("null", "tiny"):
        return EngineConfig(model=model, max_num_seqs=16, max_model_len=2048, seed=0, **dp)
    # A real model's blocks are far larger than the tiny one's (SmolLM2-135M: 720 KiB per
    # 16 tokens): room for a few full-length sequences, the rest preempted.
    return EngineConfig(model=model, max_num_seqs=16, max_model_len=2048, seed=0,
                        kv_cache_memory_bytes=512 << 20, **dp)


def _settings(profile: str, examples: int, steps: int, seed: int | None, results_dir: Path,
              shrink: bool) -> Any:
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if shrink:
        phases.append(Phase.shrink)
    common: dict[str, Any] = {
        "max_examples": examples,
        "stateful_step_count": steps,
        "deadline": None,
        "suppress_health_check": list(HealthCheck),
        "phases": phases,
        "report_multiple_bugs": False,
        "print_blob": True,
    }
    if profile == "ci" and seed is None:
        return settings(derandomize=True, database=None, **common)
    db = None
    if profile == "campaign":
        db = DirectoryBasedExampleDatabase(str(results_dir / ".hypothesis-db"))
    return settings(derandomize=False, database=db, **common)


def _describe(e: BaseException) -> str:
    """The error, what is inside a group (Hypothesis' FlakyFailure), and what it was raised
    while handling: a flaky-replay report raised as a test's error ended names that error."""
    text = f"{type(e).__name__}: {e}"
    for sub in getattr(e, "exceptions", ()):
        text += f" | {type(sub).__name__}: {sub}"
    seen = {id(e)}
    cause = e.__cause__ or e.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text += f"\n  while handling {type(cause).__name__}: {cause}"
        cause = cause.__cause__ or cause.__context__
    return text


@contextlib.contextmanager
def _seed_only_draws() -> Iterator[None]:
    """Hypothesis' draws depend on the seed alone while this holds. Hypothesis mixes into
    them constants it reads from the source of every local module imported so far
    (``hypothesis.internal.conjecture.providers``), so the modules an entry point has
    loaded (the CLI, a mutant's child, a test) or a rule imported lazily changed the
    examples a seed gives: one derandomized in-process run found length_limit_off_by_one
    from ``python -c`` and missed it from the ``enginewire`` script. Without that pool a
    seed replays the same examples everywhere (Hypothesis' own constants stay)."""
    from hypothesis.internal.conjecture import providers

    original = getattr(providers, "_get_local_constants", None)
    make_empty = getattr(providers, "Constants", None)
    if original is None or make_empty is None:  # a Hypothesis without the pool
        yield
        return
    empty = make_empty()
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()  # it holds the pool's values per draw type
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()


def _failure_of(e: BaseException, stats: Any) -> tuple[str, str | None, list[str] | None]:
    """A failed round's headline, what Hypothesis reported instead (None unless flaky), and
    the program to print instead of the one Hypothesis printed (None: Hypothesis' own).
    When Hypothesis reports its replay of the failing example as flaky (``Flaky``: the
    replay failed otherwise, not at all, or drew differently, as a timing-dependent failure
    or an engine the failure left changed can make it), the headline is the error that
    failed the example first, where it was raised, and that example's program."""
    from hypothesis.errors import Flaky

    if not isinstance(e, Flaky) or stats.first_error is None:
        return _describe(e), None, None
    where, error = stats.first_error
    return f"{error} (in {where})", _describe(e), stats.first_program or None


def _run_client(kind: str, *, examples: int, steps: int, seed: int | None, faults: bool,
                duration: float | None, model: str, profile: str, results_dir: Path,
                shrink: bool, progress: Any,
                factory: str | None = None,
                dp: tuple[int, str] | None = None,
                elastic: bool = False, monitor: Any = None,
                front_ends: int = 1) -> tuple[ClientResult, Any]:
    import hypothesis.core
    from hypothesis.reporting import with_reporter
    from hypothesis.stateful import run_state_machine_as_test

    from .reference import DifferentialOracle, reference_unavailable
    from .stateful import (
        ORPHAN_MIN_LIFE,
        AttachPool,
        CampaignStats,
        ClientPool,
        EngineClientStateMachine,
        StandaloneEngine,
        StandaloneEngineStateMachine,
        builtin_factory,
    )

    vocab_size = _vocab_size(model)  # before any snapshot: a GGUF header read maps the file
    if factory is not None:
        from ..runtime.model import TINY_ARCH

        vocab_size = TINY_ARCH.vocab_size  # the machine's default; the factory's engine
    config = _config(model) if dp is None else _config(model, *dp)
    # The differential oracle (reference.py) for a real model's tokens; built before any
    # client, as it loads the model here and the leak checks snapshot this process.
    reference = None
    if front_ends > 1:  # its oracle judges the null model's exact tokens, or none
        from .stateful_fe import fe_config

        config = fe_config(config)
    elif factory is None and reference_unavailable(config) is None:
        reference = DifferentialOracle.for_config(config)
    stats = CampaignStats()
    if progress is not None:
        stats.on_step = progress
    pool: Any
    if front_ends > 1:
        from .stateful_fe import FrontEndsEngine

        start = time.monotonic()
        pool = FrontEndsEngine(config, front_ends=front_ends,
                               engines=1 if dp is None else dp[0])
        stats.engines_started += pool.engines
        stats.seconds["(engine start)"] += time.monotonic() - start
    elif dp is not None:
        from .stateful_dp import DPClientPool, dp_factory

        pool = DPClientPool(dp_factory(kind, config), stats)
    elif kind == "standalone":
        start = time.monotonic()
        pool = AttachPool(StandaloneEngine(config, faults=faults), stats)
        stats.engines_started += 1
        stats.seconds["(engine start)"] += time.monotonic() - start
    elif factory is not None:
        pool = ClientPool(_monitored(load_factory(factory), monitor, faults), stats)
    else:
        pool = ClientPool(_monitored(builtin_factory(kind, config, faults=faults), monitor,
                                     faults, kind), stats)
    orphan = None
    if kind == "sync" and faults and factory is None and dp is None:  # spawns our engine
        orphan = {"model": model, "max_num_seqs": 16, "max_model_len": 2048}

    # Longer programs let each engine live longer before a crash or shutdown may end it (an
    # engine start, about 0.7 s, is most of what a campaign spends), and space out the orphan
    # check (two interpreter starts). CI and mutant runs (steps <= 25) keep the defaults.
    min_life = 3 if steps <= 25 else steps // 4
    orphan_min_life = ORPHAN_MIN_LIFE if steps <= 25 else steps * 3 // 4

    # ``make``'s source is the derandomized seed of a ci run (Hypothesis digests the factory
    # it is given): an edit of its text draws other examples for every client, and the
    # mutant table's detections were measured on these. A new machine gets a factory of its
    # own (``make_elastic``) rather than a branch in this one.
    def make() -> Any:
        machine: Any
        if dp is not None:
            from .stateful_dp import DataParallelStateMachine

            machine = DataParallelStateMachine(pool, kind=kind, faults=faults,
                                               exact_tokens=model == "null",
                                               vocab_size=vocab_size, stats=stats,
                                               min_life=min_life)
        elif isinstance(pool, AttachPool):
            machine = StandaloneEngineStateMachine(pool, faults=faults,
                                                   exact_tokens=model == "null",
                                                   vocab_size=vocab_size, stats=stats,
                                                   min_life=min_life)
        else:
            machine = EngineClientStateMachine(
                pool.factory, kind=kind, faults=faults,
                # a factory's config says its model (None: ask it)
                exact_tokens=None if factory else model == "null", vocab_size=vocab_size,
                pool=pool, stats=stats, orphan_config=orphan, min_life=min_life,
                orphan_min_life=orphan_min_life)
        machine.reference = reference
        return machine

    def make_elastic() -> Any:
        from .stateful_dp_elastic import ElasticDPStateMachine

        machine = ElasticDPStateMachine(pool, kind=kind, faults=faults,
                                        exact_tokens=model == "null", vocab_size=vocab_size,
                                        stats=stats, min_life=min_life)
        machine.reference = reference
        return machine

    def make_fe() -> Any:
        from .stateful_fe import FrontEndsStateMachine

        return FrontEndsStateMachine(pool, exact_tokens=model == "null",
                                     vocab_size=vocab_size, stats=stats)

    result = ClientResult(kind)
    lines: list[str] = []
    deadline = None if duration is None else time.monotonic() + duration
    start = time.monotonic()
    round_seed = seed
    round_examples = examples
    try:
        while True:
            sets = _settings(profile, round_examples, steps, round_seed, results_dir, shrink)
            saved: Any = hypothesis.core.global_force_seed
            # Untyped on purpose: Hypothesis' annotations of these two differ between releases.
            core: Any = hypothesis.core
            runner: Any = run_state_machine_as_test
            if round_seed is not None:
                core.global_force_seed = round_seed
            result.round_seeds.append(round_seed)
            stats.begin_round()
            try:
                with with_reporter(lambda text: lines.append(str(text))), _seed_only_draws():
                    runner(make_fe if front_ends > 1 else
                           make_elastic if elastic and dp is not None else make,
                           settings=sets)
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                result.failure, result.flaky, first = _failure_of(e, stats)
                notes = [str(n) for n in getattr(e, "__notes__", [])]
                # A flaky report's printed steps are its replay's: the first program wins.
                result.reproducer = reproducer_program([] if first else lines + notes, kind, model,
                                                       faults, first or stats.failed_program,
                                                       factory, dp, elastic=elastic,
                                                       front_ends=front_ends)
                if reference is not None:
                    result.reproducer = _with_reference(result.reproducer, model, dp)
                break
            finally:
                hypothesis.core.global_force_seed = saved
            if deadline is None:
                break
            now = time.monotonic()
            round_examples = _round_examples(examples, deadline - now, stats.examples,
                                             now - start)
            if not round_examples:
                break
            # Another round, differently seeded: a duration run keeps exploring (run_campaign
            # gave it a seed, so each round can be replayed with --seed).
            round_seed = None if round_seed is None else round_seed + 1
    finally:
        try:
            pool.close()
        except BaseException as e:  # a leak found when the last engine is shut down
            if result.failure is None:
                result.failure = f"{type(e).__name__} at final shutdown: {e}"
    result.seconds = time.monotonic() - start
    result.examples = stats.examples
    result.steps = stats.steps
    result.engines_started = stats.engines_started
    result.faults = dict(sorted(stats.faults.items()))
    result.rules = dict(sorted(stats.rules.items()))
    result.rule_seconds = {k: round(v, 3) for k, v in
                           sorted(stats.seconds.items(), key=lambda kv: -kv[1])}
    result.first_failure = stats.first_failure
    if result.failure is not None:
        result.errors = list(stats.errors)
    return result, stats.coverage


def _monitored(factory: Any, sink: Any, faults: bool, kind: str | None = None) -> Any:
    """``factory`` with a monitor on each client's link when ``sink`` (a MonitorSink) is
    given and the client has a link (not the in-process one)."""
    if sink is None or kind == "inproc":
        return factory
    from ._conformance_driver import Declared, declared_contract
    from .monitor import ABORT_BOUND_S, monitored

    wire = "vllm-0.33" if Declared.VLLM_WIRE in declared_contract(factory) else "enginewire"
    # Faults stop and kill engines: an abort then goes unanswered by design (the client's
    # death ends it), which the monitor cannot tell from a lost answer.
    return monitored(factory, sink, wire=wire,
                     abort_bound_s=math.inf if faults else ABORT_BOUND_S)


def _kind_of(label: str, dp: tuple[int, str] | None) -> tuple[str, tuple[int, str] | None]:
    """The client kind and the data-parallel setting (engines, backend; None: one engine) a
    run's entry drives: ``dp-sync`` and ``dp-async`` (``all``'s) are the data-parallel clients
    on ``ALL_DP_ENGINES`` local engines; any other kind runs as the whole run does (``dp``)."""
    if label.startswith("dp-"):
        return label.removeprefix("dp-"), (ALL_DP_ENGINES, "mp")
    return label, dp


def _round_examples(examples: int, left_s: float, ran: int, took_s: float) -> int:
    """The examples of a duration run's next round: ``examples``, or as many as the
    ``left_s`` seconds hold at the pace so far (``ran`` examples in ``took_s``); 0 when not
    one does. So a client stops within about one example of its share, where whole rounds
    of ``examples`` overran it (a sync round is 10 examples of about 0.6 s)."""
    if left_s <= 0:
        return 0
    if ran <= 0 or took_s <= 0:
        return examples
    return min(examples, int(left_s * ran / took_s))


def _share(duration: float, clients: int, spent_s: float, done: int) -> float:
    """The seconds of a duration run the next client gets: what is left of ``duration``
    after ``spent_s``, split evenly among the ``clients - done`` still to run. A client
    that stopped early (at a failure) or ran over leaves the others the difference, so
    the run keeps its length and the clients after it share alike."""
    return max(0.0, duration - spent_s) / (clients - done)


def _with_reference(program: str, model: str, dp: tuple[int, str] | None) -> str:
    """``program`` (a reproducer) with the differential oracle the campaign gave its machine:
    built before the first client, as ``_run_client`` does, and set on ``state``."""
    config = f"_config({model!r})" if dp is None else f"_config({model!r}, {dp[0]!r}, {dp[1]!r})"
    out: list[str] = []
    for ln in program.splitlines():
        if ln.startswith("state = "):
            out += [f"reference = DifferentialOracle.for_config({config})", ln,
                    "state.reference = reference"]
        else:
            out.append(ln)
            if ln == "from enginewire.testing.campaign import _config":
                out.append("from enginewire.testing.reference import DifferentialOracle")
    return "\n".join(out)


# How why_unreached words a transition nothing explains (a gap, not a declared reason).
_GAP = "NOT REACHED in this run"


def _print_report(results: list[ClientResult], coverage: dict[str, Any], out: Any,
                  verbose: bool = False) -> None:
    w = out.write
    w("\nenginewire campaign\n")
    w(f"{'client':<10} {'examples':>8} {'steps':>7} {'seconds':>8} {'steps/s':>8} "
      f"{'warm/s':>8} {'engines':>7}  result\n")
    for r in results:
        verdict = "ok" if r.failure is None else "FAILED"
        w(f"{r.client:<10} {r.examples:>8} {r.steps:>7} {r.seconds:>8.1f} {r.steps_per_s:>8.1f}"
          f" {r.steps_per_s_warm:>8.1f} {r.engines_started:>7}  {verdict}\n")
    faults: dict[str, int] = {}
    for r in results:
        for k, v in r.faults.items():
            faults[k] = faults.get(k, 0) + v
    w("faults injected: " + (", ".join(f"{k}={v}" for k, v in sorted(faults.items()))
                             or "none") + "\n")
    w(f"spec coverage: {coverage['states_reached']}/{coverage['states_declared']} states, "
      f"{coverage['transitions_reached']}/{coverage['transitions_declared']} transitions\n")
    for name, c in coverage["per_machine"].items():
        w(f"  {name:<15} {c['reached']:>3}/{c['transitions']:<3} transitions\n")
    missing = coverage["never_reached"]
    if missing and verbose:
        w(f"never reached ({len(missing)}):\n")
        for item in missing:
            w(f"  {item['transition']}  -- {item['why']}\n")
    elif missing:
        gaps = sum(1 for item in missing if item["why"].startswith(_GAP))
        w(f"never reached: {len(missing)} transitions ({len(missing) - gaps} with a declared"
          f" reason, {gaps} not reached in this run); each with its reason in the report,"
          " or with --verbose\n")
    model = coverage.get("composed_model")
    if model is not None:
        models = "models" if " and " in model["model"] else "model"
        w(f"against the {model['model']} composed {models}:"
          f" {model['reached']}/{model['reaches']}"
          f" of the transitions it reaches ({model['percent']} %); {len(model['missed'])}"
          f" missed, {len(model['beyond_model'])} reached beyond its bounds\n")
        if verbose:
            for item in model["missed"]:
                w(f"  missed {item['transition']}  -- {item['why']}\n")
    for r in results:
        if r.failure is not None:
            w(f"\nFAILURE on {r.client}: {r.failure}\n")
            if r.flaky:
                w(f"  then Hypothesis reported its replay as flaky:"
                  f" {r.flaky.splitlines()[0][:300]}\n")
            for err in r.errors:
                w(f"  raised in {err}\n")
            if r.round_seeds and r.round_seeds[-1] is not None:
                w(f"  failing round's seed: {r.round_seeds[-1]} (replay with --seed"
                  f" {r.round_seeds[-1]})\n")
            if r.reproducer:
                w(r.reproducer + "\n")


def _progress_bar(total_steps: int | None) -> tuple[Any, Any]:
    """A rich progress bar with live steps/s, only on a terminal."""
    if not sys.stdout.isatty():
        return None, None
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None, None
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                    TextColumn("{task.completed} steps"), TextColumn("{task.fields[rate]}"),
                    TimeElapsedColumn())
    return prog, total_steps


def run_campaign(
    client: str = "all",
    examples: int = 10,
    steps: int = 25,
    seed: int | None = None,
    faults: bool = True,
    duration: float | None = None,
    model: str = "null",
    mutant: str | None = None,
    mutants_all: bool = False,
    results_dir: str = "results",
    profile: str = "ci",
    verbose: bool = False,
    factory: str | None = None,
    engines: int = 1,
    backend: str = "mp",
    model_coverage: bool = False,
    elastic: bool = False,
    monitor: bool = False,
    front_ends: int = 1,
) -> int:
    """Run a campaign; return 0 when nothing failed, 1 when a failure was found (or, with
    ``mutants_all``, when a mutant went undetected). See the module docstring. ``verbose``
    prints every transition never reached, with its reason (the report always has them).
    ``factory`` (``module:function``) drives clients a factory of the user's builds, of the
    one kind ``client`` names, instead of the built-in ones. ``engines`` > 1 (or ``backend``
    "ray") runs the data-parallel machine (``stateful_dp.py``) on sync and async clients over
    that many engine cores (``EngineConfig.data_parallel_size``/``data_parallel_backend``).
    ``model_coverage`` adds the coverage of what the composed model reaches to the report
    (model_coverage.py; one exploration, tens of seconds). ``elastic`` runs the
    data-parallel machine with its scale rules (``stateful_dp_elastic.py``): engines join
    and leave while requests stream; it needs the data-parallel machine on the 'mp'
    backend (or a mutant of the bank's "elastic" class). ``front_ends`` 2 runs the
    machine of two front ends over shared engines instead (``stateful_fe.py``; "fe" on one
    engine, "fe-dp" on ``engines`` > 1), the built-in clients only."""
    from . import mutants

    mutants.apply_from_env()  # a mutant child's first step (module docstring)
    if client != "all" and client not in CLIENTS:
        raise ValueError(f"client must be 'all' or one of {CLIENTS}, got {client!r}")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must name a model, got {model!r}")
    if model != "null":  # before any engine: every start would fail on it
        from ..runtime.model import resolve_weight_source

        resolve_weight_source(model, 0)  # ValueError, or FileNotFoundError for a .gguf
    for name, value in (("examples", examples), ("steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if duration is not None and not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"duration must be a finite number of seconds > 0, got {duration!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 1 << 64):
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if mutant is not None and mutant not in mutants.BANK:
        raise ValueError(f"no mutant {mutant!r}; the bank has {sorted(mutants.BANK)}")
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise ValueError(f"engines must be an integer >= 1, got {engines!r}")
    if backend not in DP_BACKENDS:
        raise ValueError(f"backend must be one of {DP_BACKENDS}, got {backend!r}")
    dp = None if engines == 1 and backend == "mp" else (engines, backend)
    if isinstance(front_ends, bool) or front_ends not in (1, 2):
        raise ValueError(f"front_ends must be 1 or 2 (the machine of several front ends"
                         f" drives two), got {front_ends!r}")
    if front_ends > 1:
        if client != "all":
            raise ValueError(f"front_ends={front_ends}: the machine draws its own clients"
                             f" (sync and async front ends); give client 'all', not {client!r}")
        if factory is not None or elastic or backend != "mp" or model_coverage:
            raise ValueError(f"front_ends={front_ends}: the built-in front ends over local"
                             " engines, without a factory, elastic, backend 'ray' or"
                             " model_coverage")
        if dp is not None and (mutant is not None or mutants_all):
            raise ValueError(f"front_ends={front_ends}, engines={engines}: the mutants of"
                             " several front ends run over one engine; drop engines")
    elif dp is not None:
        if client not in ("all", *DP_CLIENTS):
            raise ValueError(f"engines={engines}, backend={backend!r}: the data-parallel"
                             f" machine drives {' and '.join(DP_CLIENTS)} clients (or all"
                             f" of them), not {client!r}")
        if factory is not None or mutant is not None or mutants_all:
            raise ValueError(f"engines={engines}, backend={backend!r}: the data-parallel"
                             " machine runs the built-in clients without the mutant bank:"
                             " drop the factory or the mutants")
    if not isinstance(elastic, bool):
        raise ValueError(f"elastic must be True or False, got {elastic!r}")
    if elastic and mutants.active() is None and (dp is None or backend != "mp"):
        raise ValueError(f"elastic: scales a data-parallel client of local engines; give"
                         f" engines >= 2 with backend 'mp' (got engines={engines},"
                         f" backend={backend!r})")
    if model_coverage and (mutant is not None or mutants_all):
        raise ValueError("model_coverage: a mutant run reports detections, not coverage")
    if factory is not None:
        if client not in CLIENTS or client == "standalone":
            raise ValueError(f"a factory builds clients of one kind: give client as one of"
                             f" {[c for c in CLIENTS if c != 'standalone']}, not {client!r}")
        if mutant is not None or mutants_all:
            raise ValueError("the mutant bank seeds bugs in the built-in clients, not in a"
                             " factory's: drop the factory or the mutants")
        load_factory(factory)  # before the run: a bad reference costs nothing
    # Before the run, so a bad path costs nothing.
    out_dir = Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PermissionError(f"results_dir {results_dir!r} is not writable")
    kinds = list(ALL_CLIENTS) if client == "all" else [client]
    if dp is not None:
        kinds = list(DP_CLIENTS) if client == "all" else [client]
        if client == "all":
            print(f"data parallel: {engines} engines ({backend}) on sync and async; inproc"
                  " does not apply (one engine in this process)", flush=True)
    if front_ends > 1:
        kinds = [FE_CLIENTS[0] if dp is None else FE_CLIENTS[1]]
    elif client == "all" and (mutants_all or mutant is not None or mutants.active()):
        # Each mutant runs only on the clients its bank entry names: the one-engine kinds for
        # most, the data-parallel ones (dp-sync, dp-async) for the membership class, "fe"
        # (two front ends over one engine) for the front-end class.
        kinds = [*ALL_CLIENTS, FE_CLIENTS[0]]
    if (mutants_all or mutant is not None) and mutants.active() is None and (
            duration is not None and seed is None):
        seed = _choose_seed()  # each mutant's child runs seeded rounds, replayable with it
    if mutants_all:
        return run_mutant_table(kinds, examples=examples, steps=steps, seed=seed, model=model,
                                results_dir=out_dir, duration=duration)
    if mutant is not None and mutants.active() != mutant:
        row = run_mutant(mutant, kinds, examples=examples, steps=steps, seed=seed,
                         model=model, results_dir=out_dir, duration=duration)
        if row.get("error"):
            print(f"mutant {mutant}: ERROR ({row['detail']})", file=sys.stderr)
            return MUTANT_ERROR
        verdict = (f"DETECTED in {row['seconds']} s (example {row['examples']})"
                   if row["detected"] else "not detected" if row["applicable"]
                   else "not applicable")
        print(f"mutant {mutant}: {verdict} ({row['detail']})")
        return 1 if row["detected"] else 0
    on = mutants.active()
    if on is not None:
        # Running inside a mutant child: only the clients that can show this bug.
        wanted = mutants.BANK[on].clients
        kinds = [k for k in kinds if k in wanted] or kinds
    elif seed is None and (profile == "campaign" or duration is not None):
        seed = _choose_seed()
    elif seed is None:
        print("seed: none (ci profile: derandomized, every run replays the same examples)",
              flush=True)

    # Spawned engines inherit the environment: one torch thread each on a shared machine (a
    # null engine ignores the setting and never loads torch).
    saved_threads = os.environ.get(_THREADS_ENV)
    os.environ[_THREADS_ENV] = saved_threads or "1"
    if model != "null":
        import torch

        torch.set_num_threads(1)
    saved_home = _hypothesis_home(out_dir)
    try:
        with contextlib.ExitStack() as stack:
            if dp is not None and dp[1] == "ray":
                from ..runtime.ray_backend import ray_session

                # One Ray for the whole campaign, up before any client's leak snapshot.
                stack.enter_context(ray_session())
            return _run_kinds(kinds, client=client, examples=examples, steps=steps,
                              seed=seed, faults=faults, duration=duration, model=model,
                              profile=profile, out_dir=out_dir, verbose=verbose,
                              factory=factory, dp=dp, model_coverage=model_coverage,
                              elastic=elastic, monitor=monitor,
                              front_ends=front_ends)
    finally:
        if saved_threads is None:
            os.environ.pop(_THREADS_ENV, None)
        from hypothesis.configuration import set_hypothesis_home_dir

        set_hypothesis_home_dir(saved_home)


def _choose_seed() -> int:
    """A randomized run must be replayable: the seed is chosen here, and said."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed: {seed} (chosen at random; replay with --seed {seed})", flush=True)
    return seed


def _hypothesis_home(out_dir: Path) -> Path | None:
    """Point Hypothesis' storage (its constants cache, any default database) at
    ``out_dir/.hypothesis`` rather than the current directory; return the home to restore.
    A ``HYPOTHESIS_STORAGE_DIRECTORY`` the user set wins, as Hypothesis documents."""
    from hypothesis.configuration import set_hypothesis_home_dir, storage_directory

    previous = storage_directory(intent_to_write=False).home_directory
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        set_hypothesis_home_dir(out_dir / ".hypothesis")
    return previous


def _run_kinds(kinds: list[str], *, client: str, examples: int, steps: int, seed: int | None,
               faults: bool, duration: float | None, model: str, profile: str,
               out_dir: Path, verbose: bool = False, factory: str | None = None,
               dp: tuple[int, str] | None = None, model_coverage: bool = False,
               elastic: bool = False, monitor: bool = False,
               front_ends: int = 1) -> int:
    from ..runtime._engine_trace import ENGINE_TRACE_ENV
    from ..runtime.engine_proc import ENGINE_LOG_FILE_ENV, INJECTED_FAULTS_ENV

    # Engine processes log to a file in the results directory, not the terminal: most of what
    # they say in a campaign is about the faults it injects (named as such there).
    engine_log: Path | None = out_dir / f"engines-{os.getpid()}.log"
    saved_env = {k: os.environ.get(k)
                 for k in (ENGINE_LOG_FILE_ENV, INJECTED_FAULTS_ENV, ENGINE_TRACE_ENV)}
    # Every engine process records its trace, drained and cross-checked at the machines'
    # sync points (stateful_base._check_engine_trace): its side of the spec is judged too.
    os.environ[ENGINE_TRACE_ENV] = "on"
    if os.environ.get(ENGINE_LOG_FILE_ENV):
        engine_log = None  # the user's own choice wins
    else:
        os.environ[ENGINE_LOG_FILE_ENV] = str(engine_log)
    if faults:
        os.environ[INJECTED_FAULTS_ENV] = "malformed_frame"
    try:
        return _run_kinds_logged(kinds, client=client, examples=examples, steps=steps,
                                 seed=seed, faults=faults, duration=duration, model=model,
                                 profile=profile, out_dir=out_dir, verbose=verbose,
                                 engine_log=engine_log, factory=factory, dp=dp,
                                 model_coverage=model_coverage, elastic=elastic,
                                 monitor=monitor, front_ends=front_ends)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_kinds_logged(kinds: list[str], *, client: str, examples: int, steps: int,
                      seed: int | None, faults: bool, duration: float | None, model: str,
                      profile: str, out_dir: Path, verbose: bool,
                      engine_log: Path | None, factory: str | None = None,
                      dp: tuple[int, str] | None = None, model_coverage: bool = False,
                      elastic: bool = False, monitor: bool = False,
                      front_ends: int = 1) -> int:
    from . import mutants
    from .oracle import Coverage

    stop_at_first = mutants.active() is not None
    prog, _ = _progress_bar(None)
    results: list[ClientResult] = []
    coverage = Coverage()
    wire_coverage = Coverage()  # with ``monitor``: every link's, from the wire
    started = time.monotonic()
    if prog is not None:
        prog.start()
    try:
        for i, kind in enumerate(kinds):
            share = None if duration is None else _share(duration, len(kinds),
                                                          time.monotonic() - started, i)
            tick = None
            if prog is not None:
                task = prog.add_task(kind, total=None if duration else examples * steps,
                                     rate="")
                t0 = time.monotonic()
                count = [0]

                def tick(task: Any = task, t0: float = t0, count: list[int] = count) -> None:
                    count[0] += 1
                    if count[0] % 5 == 0:
                        rate = count[0] / max(1e-9, time.monotonic() - t0)
                        prog.update(task, completed=count[0], rate=f"{rate:.1f} steps/s")

            machine_kind, kind_dp = _kind_of(kind, dp)
            sink = None
            if monitor and kind_dp is None:
                from .monitor import MonitorSink

                sink = MonitorSink()
            res, cov = _run_client(machine_kind, examples=examples, steps=steps, seed=seed,
                                   faults=faults, duration=share, model=model,
                                   profile=profile, results_dir=out_dir,
                                   shrink=not stop_at_first, progress=tick, factory=factory,
                                   dp=kind_dp, elastic=elastic and kind_dp is not None,
                                   monitor=sink,
                                   front_ends=front_ends if kind in FE_CLIENTS else 1)
            res.client, res.engine_cores = kind, 1 if kind_dp is None else kind_dp[0]
            if sink is not None and sink.links:
                wire_coverage.merge(sink.coverage)
                res.monitor = {k: v for k, v in sink.report().items() if k != "coverage"}
                if res.monitor["violations"] and res.failure is None:
                    first = res.monitor["violations"][0]
                    res.failure = (f"monitor: {first['machine']}: {first['event']} in"
                                   f" {first['state']}: {first['detail']}")
            results.append(res)
            coverage.merge(cov)
            if stop_at_first and res.failure is not None:
                break
    finally:
        if prog is not None:
            prog.stop()
        from .reference import release_references

        release_references()
    cov = coverage.report()
    # An engine-side machine is observed where a drained engine trace had any step of it.
    observed = frozenset(k[0] for k in coverage.seen)
    data_parallel = [_kind_of(r.client, dp)[1] is not None for r in results]
    never = [{"transition": t,
              "why": why_unreached(t, observed=observed, data_parallel=any(data_parallel))}
             for t in cov.pop("never_reached_transitions")]
    cov["never_reached"] = never
    # Hits per transition reached (the HTML page colours each by its count).
    cov["transition_counts"] = {"{} {} -{}-> {}".format(*k): n
                                for k, n in sorted(coverage.seen.items())}
    if model_coverage:
        from .model_coverage import compare_with_model

        # A run of one-engine and data-parallel clients ("all") is measured against what
        # either model reaches (None), as each kind drives only its own model's rows.
        cov["composed_model"] = compare_with_model(
            cov, data_parallel=(None if any(data_parallel) and not all(data_parallel)
                                else any(data_parallel)))
    _print_report(results, cov, sys.stdout, verbose=verbose)
    wire_section = None
    if monitor:
        from .monitor import coverage_section

        wire_section = coverage_section(wire_coverage)
        links = sum((r.monitor or {}).get("links", 0) for r in results)
        print(f"monitor: {links} link(s) judged from the wire,"
              f" {sum(len((r.monitor or {}).get('violations', [])) for r in results)}"
              f" violation(s); coverage {wire_section['transitions_reached']}/"
              f"{wire_section['transitions_declared']} transitions")
    report = {
        "clients": [dict(r.__dict__, steps_per_s=round(r.steps_per_s, 2),
                         steps_per_s_warm=round(r.steps_per_s_warm, 2)) for r in results],
        "coverage": cov,
        "settings": {"client": client, "examples": examples, "steps": steps, "seed": seed,
                     "faults": faults, "duration": duration, "model": model,
                     "profile": profile, "mutant": mutants.active(), "factory": factory,
                     "engines": 1 if dp is None else dp[0],
                     "backend": "mp" if dp is None else dp[1], "elastic": elastic,
                     "front_ends": front_ends},
        "seconds": round(time.monotonic() - started, 2),
        "failed": any(r.failure is not None for r in results),
    }
    if wire_section is not None:
        report["monitor"] = {"coverage": wire_section}
    prefix = "campaign" if mutants.active() is None else f"mutant-{mutants.active()}"
    path = new_report_path(out_dir, prefix)
    # Beside the JSON, which names them: the coverage page and each failure's reproducer file.
    write_reproducers(report, out_dir, path.stem)
    html_path = path.with_suffix(".html")
    report["html"] = html_path.name
    path.write_text(json.dumps(report, indent=2, default=str))
    try:
        write_coverage_html(report, html_path)
    except Exception as e:  # the page is a view of the JSON: never the run's verdict
        print(f"coverage page not written: {e!r}", file=sys.stderr)
    report_to = os.environ.get("_ENGINEWIRE_CAMPAIGN_REPORT")
    if report_to:
        Path(report_to).write_text(json.dumps(report, default=str))
    failed = [r.client for r in results if r.failure is not None]
    print(f"verdict: {'FAILED on ' + ', '.join(failed) if failed else 'OK'}"
          f" ({len(results)} client{'s' if len(results) != 1 else ''},"
          f" {sum(r.steps for r in results)} steps, {report['seconds']:.0f} s)")
    print(f"report: {path} (coverage diagrams:"
          f" {html_path if html_path.exists() else 'not written'})")
    if engine_log is not None and engine_log.exists() and engine_log.stat().st_size:
        lines = len(engine_log.read_bytes().splitlines())
        print(f"engine logs: {engine_log} ({lines} lines; the engines' warnings about the"
              " faults this run injected are there, each saying so)")
    return 1 if report["failed"] else 0
