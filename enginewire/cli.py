"""The ``enginewire`` command line: one entry point, one subcommand per job.

Exit codes mean the same thing everywhere:
0 the job ran and everything it checked held; 1 a check failed (a property, a campaign, a
fault cell, a benchmark bar) or the job stopped on an error nothing expected (a bug: one line
naming it and the private file holding its traceback, never the traceback itself); 2 bad
usage; 3 the environment is missing something (a tool, a model file); 130 interrupted; 141
stdout's reader went away (`| head`), quietly.
Each subcommand imports its machinery lazily so ``--help`` stays instant.

Bad usage is one line on stderr that names the flag, and exit status 2: a value out of range,
an unknown name, a malformed address, and an output path (``--results-dir``, ``--json``,
``--plot``, ``--out``) that cannot be created or written. Output paths are checked before a
long job starts, so a run is never lost to a typo at its end.

That plumbing (the exit codes, ``UsageError``, ``MissingError``, the parser, the path checks,
``run_handler``) is ``_command.py``'s, which the ``bench`` command (benchmarks/run.py: its
options and handler, built into its subcommand here) also runs on as a module of its own.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from ._command import (
    EXIT_ENV,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Handler,
    MissingError,
    UsageError,
    run_handler,
)
from ._command import Parser as _Parser
from ._command import require as _require
from ._command import writable_dir as _writable_dir
from ._command import writable_file as _writable_file  # noqa: F401 (tests/cli use it here)
from .benchmarks import run as bench_run

# EngineConfig's seed bound (seeds travel as msgpack uint64).
_MAX_SEED = (1 << 64) - 1


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            top = None if hi is None else "2**64 - 1" if hi == _MAX_SEED else str(hi)
            bound = f">= {lo}" if top is None else f"in [{lo}, {top}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _float_over(lo: float, *, inclusive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < lo or (value == lo and not inclusive):
            op = ">=" if inclusive else ">"
            raise argparse.ArgumentTypeError(f"must be a finite number {op} {lo:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _spec_check(args: argparse.Namespace) -> int:
    from .spec.compose import BUGS
    from .testing.spec_check import run_spec_check, spin_available

    if args.negative is not None and args.negative not in BUGS:
        raise UsageError(f"--negative: unknown negative control {args.negative!r}; "
                         f"choose one of: {', '.join(BUGS)}")
    if not args.no_spin and os.environ.get("CI") and not spin_available():
        # CI must not pass on the explorer alone: liveness is SPIN's job.
        raise MissingError("SPIN and gcc are required when CI is set (liveness is checked by "
                           "SPIN): install them (apt-get install spin gcc) or pass --no-spin")
    return int(run_spec_check(
        negative=args.negative,
        spin=False if args.no_spin else None,
        controls=args.controls,
        quick=args.quick,
        verbose=args.verbose,
    ))


def _spec_diagrams(args: argparse.Namespace) -> int:
    from ._tools.generate import write_diagrams

    out = _writable_dir("--out", args.out)
    try:
        paths = write_diagrams(out)
    except OSError as exc:  # e.g. a diagram's name is taken by a directory
        raise UsageError(f"--out {args.out}: {exc}") from None
    for path in paths:
        print(path)
    print(f"wrote {len(paths)} diagram files to {out.resolve()}", file=sys.stderr)
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    from ._generate import run_generate

    if args.engines > 1 and args.client == "inproc":
        raise UsageError(f"--engines {args.engines} needs --client sync or async: an"
                         " in-process client steps one engine in this thread")
    if (args.scale_to is None) != (args.after_tokens is None):
        raise UsageError("--scale-to and --after-tokens go together (scale to N engines once"
                         " that many tokens streamed)")
    if args.scale_to is not None and args.engines < 2:
        raise UsageError("--scale-to needs a data-parallel client: --engines 2 or more")

    name = args.model.lower()
    if name.endswith(".gguf") or name.startswith("smollm2"):
        for package in ("gguf", "tokenizers"):
            _require(package, f"--model {args.model}")

    return run_generate(
        model=args.model,
        prompt=args.prompt,
        prompt_tokens=args.prompt_tokens,
        client=args.client,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        engines=args.engines,
        scale=None if args.scale_to is None else (args.scale_to, args.after_tokens),
    )


_ENGINE_SCHEMES = ("tcp://", "ipc://")
# sockaddr_un.sun_path holds 108 bytes on Linux (104 on the BSDs), its NUL included.
_IPC_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
# The characters libzmq's connect() accepts in a tcp endpoint (socket_base.cpp's sanity
# check): host names, IPv4, [IPv6] with %zone, and its "source;destination" form.
_TCP_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:%;[]_")


def _check_address(flag: str, address: str) -> None:
    """An address an engine in another process can connect to, checked as text only.

    Nothing is connected: a trial connect() over tcp reaches the front end, and a CURVE front
    end then logs a refused peer (a failed handshake) per address per engine start."""
    if not address.startswith(_ENGINE_SCHEMES):
        raise UsageError(f"{flag} {address!r}: expected tcp://HOST:PORT or ipc://PATH")
    if address.startswith("ipc://"):
        path = address.removeprefix("ipc://")
        if not path:
            raise UsageError(f"{flag} {address!r}: expected ipc://PATH, the path is empty")
        if len(path.encode()) > _IPC_PATH_MAX:
            raise UsageError(f"{flag} {address!r}: the path is longer than {_IPC_PATH_MAX} "
                             "bytes, the most a unix socket path holds")
        return
    endpoint = address.removeprefix("tcp://")
    host, sep, port = endpoint.rpartition(":")
    if not (sep and host and host[0] != ";" and set(host) <= _TCP_CHARS
            and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise UsageError(f"{flag} {address!r}: expected tcp://HOST:PORT, port in [1, 65535]")


def _engine_curve(args: argparse.Namespace) -> Any:
    """The engine's CurveConfig from its flags (None without CURVE). Unusable key material is
    the environment's fault (exit 3, raised as OSError or ValueError); a peer list the engine
    cannot pick its front end's key from is bad usage."""
    from .runtime import security

    key = args.curve_key
    if (key is None) != (not args.curve_peer) or (args.curve_server_key and key is None):
        # A usage mistake (exit 2), not an unusable key file (exit 3).
        raise UsageError("CURVE needs both --curve-key FILE and at least one --curve-peer"
                         " KEY|FILE|DIR")
    secret = None if key is None else Path(key).expanduser()
    created = secret is not None and not secret.exists()
    curve = security.curve_from_options(key, args.curve_peer or [],
                                        server_key=args.curve_server_key)
    if created and curve is not None and secret is not None:
        # Logged at INFO only, which the CLI does not show: the operator needs the public
        # half to give the front end.
        print(f"enginewire engine: created CURVE key pair {secret} (public half in "
              f"{security.public_key_file(secret)}); public key: "
              f"{curve.keypair.public.decode('ascii')}", flush=True)
    if curve is not None and curve.server_key is None and len(curve.peer_keys) > 1:
        raise UsageError(f"--curve-peer gave {len(curve.peer_keys)} keys: name the front end's"
                         " with --curve-server-key KEY|FILE")
    return curve


def _startup_exit(error: BaseException) -> int:
    """One line for an engine that could not start, and its exit code."""
    from .spec import EngineStartupError

    chain = [error]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    if isinstance(error, EngineStartupError) and "ready handshake" in str(error):
        print(f"enginewire engine: {error}", file=sys.stderr)
        return EXIT_ENV
    root = chain[-1]
    print(f"enginewire engine: error: could not start: {type(root).__name__}: {root}",
          file=sys.stderr)
    if any(isinstance(e, FileNotFoundError) for e in chain):
        return EXIT_ENV
    if any(isinstance(e, ValueError) for e in chain):
        return EXIT_USAGE  # a config the engine refused (e.g. an unknown --model)
    return EXIT_FAILED


def _engine_logging() -> None:
    """A served engine logs its events (up, attach, signal, errors) at INFO with a time and
    its pid: without this only warnings showed, bare, and a stop left no line at all."""
    import logging

    level = os.environ.get("ENGINEWIRE_ENGINE_LOG_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise UsageError(f"ENGINEWIRE_ENGINE_LOG_LEVEL={level!r}: expected DEBUG, INFO, "
                         "WARNING, ERROR or CRITICAL")
    # A no-op where the root logger has handlers already (an embedding program, pytest).
    logging.basicConfig(level=level,
                        format="%(asctime)s enginewire engine[%(process)d] %(levelname)s "
                               "%(message)s")


def _engine(args: argparse.Namespace) -> int:
    from .runtime import engine_proc
    from .runtime.config import EngineConfig

    for address in args.input_address:
        _check_address("--input-address", address)
    for address in args.output_address:
        _check_address("--output-address", address)
    if len(args.input_address) != len(args.output_address):
        raise UsageError(f"{len(args.input_address)} --input-address but"
                         f" {len(args.output_address)} --output-address: give one pair per"
                         " front end")
    try:
        curve = _engine_curve(args)
    except (OSError, ValueError) as exc:  # unreadable, unsafe or malformed key material
        print(f"enginewire engine: {exc}", file=sys.stderr)
        return EXIT_ENV
    tcp = [a for a in (*args.input_address, *args.output_address) if a.startswith("tcp://")]
    if tcp and curve is None and not args.allow_insecure_tcp:
        raise UsageError(f"refusing plain tcp at {', '.join(tcp)}: anyone who can reach it can"
                         " submit work and read outputs. Pass --curve-key FILE and --curve-peer"
                         " KEY (docs/security.md), or --allow-insecure-tcp on a trusted network")
    try:
        config = EngineConfig(model=args.model, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _engine_logging()
    try:
        rc: int = engine_proc.run_engine_core(
            config,
            input_address=args.input_address,
            output_address=args.output_address,
            engine_index=args.engine_index,
            heartbeat_interval_s=args.heartbeat_interval,
            curve=curve,
            allow_insecure_tcp=args.allow_insecure_tcp,
            integrity=args.integrity,
            raise_startup_errors=True,
            front_end_timeout_s=(args.front_end_timeout if args.front_end_timeout is not None
                                 else 10.0 if len(args.input_address) > 1 else None),
        )
    except Exception as exc:
        return _startup_exit(exc)
    return rc


def _address_pair(flag: str, text: str) -> tuple[str, str]:
    parts = text.split(",")
    if len(parts) != 2:
        raise UsageError(f"{flag} {text!r}: expected IN_ADDR,OUT_ADDR")
    for address in parts:
        _check_address(flag, address)
        if address.startswith("tcp://"):
            raise UsageError(f"{flag} {address}: the monitor does not pass CURVE through yet,"
                             " and a plain tcp relay would carry a secured link in the clear;"
                             " run it on ipc addresses (docs/monitor.md)")
    return parts[0], parts[1]


def _monitor(args: argparse.Namespace) -> int:
    import signal
    import threading
    import time

    from .protocol import ProtocolError
    from .testing import monitor

    if args.report:
        _writable_dir("--report", args.report)
    if args.replay:
        if args.front or args.engine or args.capture:
            raise UsageError("--replay judges a capture: not with --front, --engine or"
                             " --capture")
        try:
            report = monitor.replay(args.replay, abort_bound_s=args.abort_bound)
        except (OSError, ProtocolError) as exc:
            print(f"enginewire monitor: {exc}", file=sys.stderr)
            return EXIT_FAILED
    else:
        if not (args.front and args.engine):
            raise UsageError("give --front IN,OUT and --engine IN,OUT (or --replay CAPTURE)")
        front = _address_pair("--front", args.front)
        engine = _address_pair("--engine", args.engine)
        stop = threading.Event()
        mon = monitor.Monitor(wire=args.wire, engine=engine, capture=args.capture,
                              fail_fast=args.fail_fast, abort_bound_s=args.abort_bound,
                              engine_index=args.engine_index)
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            mon.start()
            mon.attach(*front)
            print(f"monitor: relaying {front[0]},{front[1]} <-> {engine[0]},{engine[1]}",
                  file=sys.stderr, flush=True)
            deadline = None if args.duration is None else time.monotonic() + args.duration
            while not stop.is_set() and not mon.failed.is_set() and (
                    deadline is None or time.monotonic() < deadline):
                stop.wait(0.1)
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a live run ends: the verdict follows
        finally:
            signal.signal(signal.SIGTERM, previous)
            report = mon.stop()
    if args.report:
        report["report"] = str(monitor.write_report(report, args.report))
    print(monitor.summary(report))
    return EXIT_FAILED if report["violations"] else EXIT_OK


def _check_model(model: str) -> None:
    """``--model``: a name an engine can load (tiny, null, a .gguf path, smollm2-135m, a
    registered source), refused before anything starts."""
    if model == "null":
        return
    from .runtime.model import resolve_weight_source

    try:
        resolve_weight_source(model, 0)
    except FileNotFoundError as exc:
        raise MissingError(f"--model {model}: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None


def _campaign(args: argparse.Namespace) -> int:
    from .testing.campaign import run_campaign

    if args.mutant is not None:
        from .testing import mutants

        if args.mutants is not None:
            raise UsageError("--mutant and --mutants: give one of them")
        if args.mutant not in mutants.BANK:
            raise UsageError(f"--mutant {args.mutant}: no such mutant; the bank has "
                             + ", ".join(sorted(mutants.BANK)))
    _writable_dir("--results-dir", args.results_dir)
    _check_model(args.model)
    _require("hypothesis", "enginewire campaign")
    if args.factory is not None:
        from .testing.campaign import load_factory

        if args.client not in ("inproc", "sync", "async"):
            raise UsageError("--factory builds clients of one kind: give --client inproc, sync"
                             " or async with it")
        if args.mutant is not None or args.mutants is not None:
            raise UsageError("--factory with --mutant/--mutants: the mutant bank seeds bugs"
                             " in the built-in clients only")
        try:
            load_factory(args.factory)
        except ValueError as exc:
            raise UsageError(f"--factory: {exc}") from None
    if args.front_ends > 1:
        if args.client != "all" or args.factory is not None or args.elastic or (
                args.backend != "mp") or args.model_coverage:
            raise UsageError("--front-ends 2 drives its own front ends (sync and async) over"
                             " local engines: drop --client, --factory, --elastic, --backend"
                             " and --model-coverage")
        if args.engines > 1 and (args.mutant is not None or args.mutants is not None):
            raise UsageError("--front-ends 2 with --mutant/--mutants: the front-end mutants"
                             " run over one engine; drop --engines")
    elif args.engines > 1 or args.backend != "mp":
        what = f"--engines {args.engines}" + (f" --backend {args.backend}"
                                              if args.backend != "mp" else "")
        if args.client not in ("sync", "async", "all"):
            raise UsageError(f"{what}: the data-parallel machine drives --client sync, async"
                             f" or all, not {args.client} (an in-process client has one engine)")
        if args.factory is not None or args.mutant is not None or args.mutants is not None:
            raise UsageError(f"{what}: the data-parallel machine runs the built-in clients,"
                             " without --factory, --mutant or --mutants")
        if args.backend == "ray":
            _require("ray", f"enginewire campaign {what}")
    if args.elastic and (args.engines < 2 or args.backend != "mp"):
        raise UsageError("--elastic scales a data-parallel client of local engines: give it"
                         " with --engines 2 or more on --backend mp")
    return int(run_campaign(
        client=args.client,
        examples=args.examples,
        steps=args.steps,
        seed=args.seed,
        faults=args.faults == "on",
        duration=args.duration,
        model=args.model,
        mutant=args.mutant,
        mutants_all=args.mutants == "all",
        results_dir=args.results_dir,
        profile=args.profile,
        verbose=args.verbose,
        factory=args.factory,
        engines=args.engines,
        backend=args.backend,
        model_coverage=args.model_coverage,
        elastic=args.elastic,
        monitor=args.monitor,
        front_ends=args.front_ends,
    ))


def _faults_matrix(args: argparse.Namespace) -> int:
    from .faults import run_fault_matrix
    from .runtime.config import EngineConfig

    _writable_dir("--results-dir", args.results_dir)
    factory = None
    if args.factory is not None:
        from .testing.campaign import load_factory

        if args.engines > 1:
            raise UsageError(f"--factory with --engines {args.engines}: the data-parallel cells"
                             " run the built-in clients only")
        if args.model is not None:
            # Silently running the factory's model instead would be worse than refusing.
            raise UsageError("--factory with --model: the factory builds its clients with its"
                             " own config; drop --model")
        try:
            factory = load_factory(args.factory)  # before any cell: a bad reference costs nothing
        except ValueError as exc:
            raise UsageError(f"--factory: {exc}") from None
    model = args.model if args.model is not None else "tiny"
    _check_model(model)  # before any cell: every one would read startup_error
    if args.engines > 1 and args.client and "inproc" in args.client:
        raise UsageError(f"--engines {args.engines}: the data-parallel cells need --client sync"
                         " or async (an in-process client has one engine)")
    if args.engines > 1 and args.monitor:
        raise UsageError(f"--monitor with --engines {args.engines}: a monitor relays one"
                         " engine's link; the data-parallel cells have several")
    config = EngineConfig(model=model, max_num_seqs=4)
    if args.front_ends > 1:
        if args.engines > 1 or args.factory is not None:
            raise UsageError("--front-ends 2: the front-end cells run the built-in clients on"
                             " one engine; drop --engines and --factory")
        if args.client and "inproc" in args.client:
            raise UsageError("--front-ends 2: the front ends are sync or async clients (an"
                             " in-process client has no engine to share)")
        from .testing.fault_matrix import run_fe_fault_matrix

        return int(run_fe_fault_matrix(args.client or None, quick=args.quick,
                                       results_dir=args.results_dir, config=config))
    if args.engines > 1:
        from .faults import run_dp_fault_matrix

        return int(run_dp_fault_matrix(args.client or None, quick=args.quick,
                                       results_dir=args.results_dir, engines=args.engines,
                                       config=config))
    rc: int = run_fault_matrix(args.client or None, quick=args.quick,
                               results_dir=args.results_dir, config=config, factory=factory,
                               monitor=args.monitor)
    return rc


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="enginewire",
        description=(
            "A formally specified front-end <-> engine-core protocol for LLM inference engines: "
            "model-check the spec, run campaigns and fault matrices against a real engine, "
            "benchmark the IPC layer, or serve an engine."
        ),
        epilog="Exit codes: 0 ok, 1 a check failed, or an unexpected error (one line on stderr "
        "naming it and the file holding its traceback), 2 bad usage (one line on stderr: a bad "
        "value, an unknown name, an output path that cannot be written), 3 missing tool or "
        "file, 130 interrupted, 141 stdout closed by its reader.",
    )
    parser.add_argument("--version", action="version", version=f"enginewire {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    spec = sub.add_parser("spec", help="check the lifecycle state machines or draw them")
    spec_sub = spec.add_subparsers(dest="spec_command", metavar="ACTION", required=True)
    check = spec_sub.add_parser(
        "check",
        help="model-check the spec: exhaustive explorer for safety, SPIN for liveness",
        description="Explore every machine and the composed model, run SPIN on the generated "
        "Promela, and prove every negative control is rejected.",
    )
    check.add_argument(
        "--no-spin", action="store_true", help="skip SPIN (explorer only; liveness unchecked)"
    )
    check.add_argument(
        "--controls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run every deliberately broken variant and require both checkers to reject "
        "it (default on)",
    )
    check.add_argument(
        "--quick",
        action="store_true",
        help="every property on the spec, but only a few of the negative controls (about a"
        " minute on 2 cores; the full check takes a few minutes), summarised in a screen",
    )
    check.add_argument(
        "--verbose", action="store_true",
        help="with --quick: every table in full (each SPIN run, each control, each declared"
        " unexercised row), as the full check prints them",
    )
    check.add_argument(
        "--negative",
        metavar="NAME",
        help="check one broken variant as if it were the spec: exits 1 with its shortest "
        "counterexample",
    )
    check.set_defaults(handler=_spec_check)
    diagrams = spec_sub.add_parser(
        "diagrams",
        help="write Mermaid and DOT diagrams of every machine",
        description="Render every machine's diagram (Mermaid and DOT) into a directory.",
    )
    diagrams.add_argument(
        "--out",
        default="docs/diagrams",
        metavar="DIR",
        help="output directory, created if missing (default: %(default)s, relative to the "
        "current directory)",
    )
    diagrams.set_defaults(handler=_spec_diagrams)

    camp = sub.add_parser(
        "campaign",
        help="run Hypothesis stateful campaigns against a real engine, judged by the spec",
        description="Drive random add/abort/utility/sleep/crash/shutdown sequences through "
        "each client against a real engine, with the spec machines as oracle; report coverage, "
        "faults injected and failures (shrunk to a Python reproducer).",
    )
    camp.add_argument(
        "--client",
        choices=("inproc", "sync", "async", "standalone", "all"),
        default="all",
        help="which client to drive (default: all). standalone: sync and async front ends"
        " taking turns on one engine started on its own. all: every kind, the time split"
        " evenly: inproc, sync, async and standalone on one engine each, then dp-sync and"
        " dp-async, the data-parallel clients on 2 engines (the fewest with a membership to"
        " lose one of; about half of a short run's time on 2 cores); with --engines N only"
        " the data-parallel clients, on N; with --mutant/--mutants each mutant's own kinds"
        " (the front-end mutants' fe among them); two front ends at once: --front-ends 2",
    )
    camp.add_argument("--examples", type=_int_in(1), default=10,
                      help="Hypothesis examples per client (>= 1)")
    camp.add_argument("--steps", type=_int_in(1), default=25,
                      help="maximum rules per example (>= 1)")
    camp.add_argument(
        "--seed",
        type=_int_in(0, _MAX_SEED),
        help="seed for a reproducible run; when unset a randomized run picks one, prints it and "
        "records it in the JSON report",
    )
    camp.add_argument(
        "--faults", choices=("on", "off"), default="on", help="include crash and fault rules"
    )
    camp.add_argument(
        "--duration",
        type=_float_over(0.0, inclusive=False),
        metavar="SECONDS",
        help="run until this much time has passed (> 0)",
    )
    camp.add_argument(
        "--model", default="null", metavar="NAME",
        help="engine model to drive (default: null): tiny, smollm2-135m, a .gguf path, or a"
        " source named in ENGINEWIRE_WEIGHT_SOURCES (as faults matrix --model)",
    )
    camp.add_argument("--mutant", metavar="NAME", help="run with one seeded bug switched on")
    camp.add_argument(
        "--factory", metavar="MODULE:FUNCTION",
        help="drive the clients your own factory builds (the conformance suite's ClientFactory"
        " contract; docs/campaigns.md), of the one kind --client names",
    )
    camp.add_argument("--verbose", action="store_true",
                      help="also print every transition never reached, with its reason (the"
                      " JSON report always lists them)")
    camp.add_argument(
        "--model-coverage", action="store_true",
        help="also measure coverage against the transitions the composed model reaches (one"
        " exhaustive exploration, tens of seconds; --client all, whose kinds run on one engine"
        " and on two, against what either model reaches: two; in the JSON as"
        " coverage.composed_model)")
    camp.add_argument(
        "--mutants",
        choices=("all",),
        help="run every seeded bug and print the detection table",
    )
    camp.add_argument(
        "--profile",
        choices=("ci", "campaign"),
        default="ci",
        help="ci: small and deterministic; campaign: randomized, persistent example database",
    )
    camp.add_argument(
        "--results-dir",
        default="results",
        help="directory for the JSON report (created; checked writable before the run)",
    )
    camp.add_argument(
        "--engines", type=_int_in(1), default=1, metavar="N",
        help="engine cores per client (default 1; --client all adds the data-parallel clients"
        " on 2); N > 1 runs only the data-parallel machine (kill one of N, restarts,"
        " broadcast utilities) on the sync and async clients",
    )
    camp.add_argument(
        "--backend", choices=("mp", "ray"), default="mp",
        help="where the data-parallel engines run: mp (local processes) or ray (Ray actors;"
        " EngineConfig.data_parallel_backend)",
    )
    camp.add_argument(
        "--elastic", action="store_true",
        help="with --engines N (mp): the data-parallel machine also scales its client up and"
        " down (1 to 3 engines) while requests stream, a call is pending or an engine dies"
        " (model_tests/stateful_dp_elastic.py)",
    )
    camp.add_argument(
        "--monitor", action="store_true",
        help="put enginewire monitor on every client's link (sync, async, a factory's): its"
        " violations fail the run, and the report gains the coverage read from the wire"
        " (docs/monitor.md)",
    )
    camp.add_argument(
        "--front-ends", type=_int_in(1, 2), default=1, metavar="K",
        help="2: two front ends (sync and async clients, one of them going and attaching"
        " again) served at once by the same engine, or with --engines N by the same N"
        " engines (model_tests/stateful_fe.py; isolation, a front end's loss, exactly-once"
        " ends, the power view); default 1, the other machines",
    )
    camp.set_defaults(handler=_campaign)

    faults = sub.add_parser("faults", help="the failure-injection harness")
    faults_sub = faults.add_subparsers(dest="faults_command", metavar="ACTION", required=True)
    matrix = faults_sub.add_parser(
        "matrix",
        help="inject every fault at every point and check each outcome against the spec",
        description="Run every fault at every applicable point and lifecycle state on each "
        "client; print fault x point -> outcome, detection latency and leaks; exits 1 if any "
        "cell differs from the spec.",
    )
    matrix.add_argument(
        "--client",
        action="append",
        choices=("inproc", "sync", "async"),
        help="client to test (repeatable); default: all three",
    )
    matrix.add_argument(
        "--quick", action="store_true", help="the bounded subset CI runs (a few minutes)"
    )
    matrix.add_argument(
        "--model",
        metavar="NAME",
        help="the engine's model: tiny, null, a .gguf path, or a weight source of your own "
        "registered by name in ENGINEWIRE_WEIGHT_SOURCES (docs/faults.md) (default: tiny; "
        "not with --factory, whose config names its model)",
    )
    matrix.add_argument(
        "--results-dir",
        default="results",
        help="directory for fault_matrix.json (created; checked writable before the run)",
    )
    matrix.add_argument(
        "--engines", type=_int_in(1, 16), default=1, metavar="N",
        help="data parallel: the cells where one engine of N is killed, stopped, crashes or "
        "gets corrupted frames while the others serve (instead of the one-engine matrix)")
    matrix.add_argument(
        "--front-ends", type=_int_in(1, 2), default=1, metavar="K",
        help="2: the cells where one of two front ends served by the same engine is killed"
        " (SIGKILL), stopped past the front-end timeout, or sends garbage frames (with and"
        " without frame integrity) while the other streams on (instead of the one-engine"
        " matrix; the null model, whatever --model)")
    matrix.add_argument(
        "--factory", metavar="MODULE:FUNCTION",
        help="run the cells on the clients your own factory builds (the conformance suite's "
        "ClientFactory contract, with its own config; docs/faults.md): the kind it builds is "
        "the default --client, and a cell whose options it refuses is n/a, not a failure",
    )
    matrix.add_argument(
        "--monitor", action="store_true",
        help="put enginewire monitor on each cell's link (not the in-process client's, nor"
        " the interposer cells'): fault_matrix.json gains what it saw, violations and coverage"
        " read from the wire, reported beside the cells' verdicts (docs/monitor.md)",
    )
    matrix.set_defaults(handler=_faults_matrix)

    mon = sub.add_parser(
        "monitor",
        help="relay a front end <-> engine conversation and judge it against the spec",
        description="A transparent relay between a front end's bound sockets (--front) and an "
        "engine that connects to --engine instead: every message is sent on unchanged and in "
        "order, and judged, off the forwarding path, against the spec's machines as far as the "
        "wire shows them. Each violation is printed on stderr as it is seen; on exit "
        "(SIGINT/SIGTERM, --duration, or --fail-fast's first violation) the verdict, the "
        "coverage and the JSON + HTML report (--report). --replay judges a capture offline "
        "(docs/monitor.md).",
        epilog="Exit codes: 0 no violation, 1 a violation (or a cut or corrupt capture), 2 bad "
        "usage (a malformed address, tcp: CURVE is not passed through yet).",
    )
    mon.add_argument("--wire", choices=("enginewire", "vllm-0.33"), default="enginewire",
                     help="whose frames: enginewire's or vLLM 0.33's (default: %(default)s)")
    mon.add_argument("--front", metavar="IN_ADDR,OUT_ADDR",
                     help="the front end's bound input (ROUTER) and output (PULL) addresses")
    mon.add_argument("--engine", metavar="IN_ADDR,OUT_ADDR",
                     help="the addresses the monitor binds for the engine to connect to")
    mon.add_argument("--replay", metavar="CAPTURE",
                     help="judge a capture written with --capture instead of relaying")
    mon.add_argument("--capture", metavar="FILE", help="write every message relayed to FILE")
    mon.add_argument("--report", metavar="DIR",
                     help="write monitor-<time>.json and its coverage page to DIR")
    mon.add_argument("--fail-fast", action="store_true",
                     help="stop at the first violation (exit 1)")
    mon.add_argument("--duration", type=_float_over(0.0, inclusive=False), metavar="S",
                     help="stop after S seconds (default: at SIGINT/SIGTERM)")
    mon.add_argument("--engine-index", type=_int_in(0, 65535), default=0, metavar="I",
                     help="the engine's index (its identity on the front end's ROUTER): a"
                     " front end over N engines gets one monitor per engine (default:"
                     " %(default)s)")
    mon.add_argument("--abort-bound", type=_float_over(0.0, inclusive=False), metavar="S",
                     default=5.0,
                     help="seconds within which an abort must be answered (default: %(default)s)")
    mon.set_defaults(handler=_monitor)

    bench = sub.add_parser("bench", help=bench_run.HELP, description=bench_run.DESCRIPTION)
    bench_run.add_arguments(bench)
    bench.set_defaults(handler=bench_run.bench_command)

    gen = sub.add_parser(
        "generate",
        help="stream tokens for a prompt through a chosen client, with timing",
        description="Send one prompt through a client to a real engine and stream the tokens "
        "as they arrive; prints time to first token and tokens per second.",
    )
    gen.add_argument(
        "--model", default="tiny", help="engine model: tiny, null, smollm2-135m or a .gguf path"
    )
    gen.add_argument("--prompt", default="Hello", help="text prompt (tokenized by the model)")
    gen.add_argument(
        "--prompt-tokens", help="comma-separated token ids instead of text (for tiny/null)"
    )
    gen.add_argument(
        "--client",
        choices=("inproc", "sync", "async"),
        default="sync",
        help="which client carries the request",
    )
    gen.add_argument("--max-tokens", type=_int_in(1), default=32, help="tokens to generate (>= 1)")
    gen.add_argument(
        "--temperature", type=_float_over(0.0, inclusive=True), default=0.0,
        help="0 means greedy (>= 0)"
    )
    gen.add_argument("--seed", type=_int_in(0, _MAX_SEED), default=0, help="sampling seed (>= 0)")
    gen.add_argument(
        "--engines", type=_int_in(1, 256), default=1, metavar="N",
        help="data parallel: a client over N engine cores (not with --client inproc)")
    gen.add_argument(
        "--scale-to", type=_int_in(1, 256), default=None, metavar="N",
        help="data parallel: scale the client to N engines mid-stream (with --after-tokens)")
    gen.add_argument(
        "--after-tokens", type=_int_in(1), default=None, metavar="K",
        help="with --scale-to: scale once K tokens streamed")
    gen.set_defaults(handler=_generate)

    eng = sub.add_parser(
        "engine",
        help="run an engine process that connects to a front end's addresses",
        description="Start an engine core in this process and connect it to a front end that "
        "bound the given input and output addresses (like vLLM's headless engines). It serves "
        "front ends one after another: the next one to bind the addresses takes it over, and "
        "what the previous one left running is dropped. Repeat --input-address and "
        "--output-address to serve several front ends at once: the i-th pair is front end "
        "client_index i (docs/runtime.md, \"Several front ends\").",
        epilog="Exit codes: 0 stopped by SIGTERM/SIGINT/SIGHUP (an attached front end is "
        "told), 1 a fatal error while serving, 2 bad usage (a bad flag value or address, an "
        "unknown model, plain tcp without --allow-insecure-tcp), 3 unusable key files, or "
        "(CURVE only) no front end at --input-address within the handshake deadline (30 s); a "
        "plain engine waits for its front end. Logs go to stderr at INFO "
        "(ENGINEWIRE_ENGINE_LOG_LEVEL): start, each front end attached, the stop, errors.",
    )
    eng.add_argument(
        "--model", default="tiny", help="engine model: tiny, null, smollm2-135m or a .gguf path"
    )
    eng.add_argument("--input-address", required=True, action="append",
                     help="front end's ROUTER address; repeat for several front ends")
    eng.add_argument("--output-address", required=True, action="append",
                     help="front end's PULL address; repeat, one per --input-address")
    eng.add_argument(
        "--front-end-timeout",
        type=_float_over(0.0, inclusive=False),
        default=None,
        help="seconds of silence after which a front end is gone and its requests are "
        "aborted (its client sends heartbeats within it; a connection down for 1 s, or this "
        "if shorter, is gone too); with several front ends the default is 10",
    )
    eng.add_argument(
        "--engine-index", type=_int_in(0, 65535), default=0, help="this engine's rank (0-65535)"
    )
    eng.add_argument(
        "--seed", type=_int_in(0, _MAX_SEED), default=0, help="weights and sampling seed (>= 0)"
    )
    eng.add_argument(
        "--heartbeat-interval",
        type=_float_over(0.0, inclusive=False),
        default=1.0,
        help="seconds between idle heartbeats, so the front end can tell a live engine "
        "from a vanished one",
    )
    eng.add_argument(
        "--curve-key",
        metavar="FILE",
        help="this engine's CURVE secret key file (ZeroMQ certificate format, mode 0600); "
        "created on first use",
    )
    eng.add_argument(
        "--curve-peer",
        metavar="KEY|FILE|DIR",
        action="append",
        help="a front end's public key (Z85 text, key file or directory of them) allowed to "
        "talk to this engine; repeatable",
    )
    eng.add_argument(
        "--curve-server-key",
        metavar="KEY|FILE",
        help="the public key (Z85 text or key file) of the front end this engine connects to; "
        "needed when --curve-peer gives several keys",
    )
    eng.add_argument(
        "--allow-insecure-tcp",
        action="store_true",
        help="permit plain tcp without CURVE (logged as a warning); never for untrusted networks",
    )
    eng.add_argument(
        "--integrity",
        action="store_true",
        help="add a sequence number and CRC-32 trailer to every message (the front end must "
        "enable frame_integrity too)",
    )
    eng.set_defaults(handler=_engine)
    return parser


def _prog(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    words = [args.command, getattr(args, "spec_command", None),
             getattr(args, "faults_command", None)]
    return " ".join([parser.prog, *(w for w in words if w)])


# Options whose value may be a Z85 public key: 40 characters, which may start with "-" or "--".
_KEY_OPTIONS = frozenset({"--curve-peer", "--curve-server-key"})
_Z85_KEY_LEN = 40
_Z85_ALPHABET = ("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                 ".-:+=^!/*?&<>()[]{}@%$#")
_Z85_VALUE = {c: i for i, c in enumerate(_Z85_ALPHABET)}


def _is_z85_key(text: str) -> bool:
    """40 Z85 characters that decode to 32 bytes (each 5-character group below 2**32)."""
    if len(text) != _Z85_KEY_LEN or not all(c in _Z85_VALUE for c in text):
        return False
    for i in range(0, _Z85_KEY_LEN, 5):
        value = 0
        for c in text[i:i + 5]:
            value = value * 85 + _Z85_VALUE[c]
        if value >= 1 << 32:
            return False
    return True


def _long_options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Every ``--option`` of ``parser`` and of its subcommands, at any depth."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _long_options(sub)
    return frozenset(found)


def _names_an_option(token: str, options: frozenset[str]) -> bool:
    # "--name" or "--name=value" for a real option. Exact names only: with abbreviations too,
    # every key starting "--=" (one "--" key in 85) would read as an option.
    return token.partition("=")[0] in options


def _attach_key_values(argv: Sequence[str],
                       parser: argparse.ArgumentParser | None = None) -> list[str]:
    """``--curve-peer -k3y...`` as ``--curve-peer=-k3y...``: argparse takes a value that starts
    with "-" for an option (one random Z85 key in ~85 does, one in ~7000 with "--") and says
    the option has no value. The token after a key option is its value when it is a valid Z85
    key, unless it spells one of the command line's ``--options`` as ``--name`` or
    ``--name=value`` (a missing value then a real option: argparse reports the missing value).
    Only a key that itself starts "--<option name>=" is taken for an option that way;
    ``--curve-peer=KEY`` reads every key."""
    options = _long_options(parser or build_parser())
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if (arg in _KEY_OPTIONS and nxt is not None and nxt.startswith("-")
                and _is_z85_key(nxt)
                and not (nxt.startswith("--") and _names_an_option(nxt, options))):
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_key_values(sys.argv[1:] if argv is None else argv,
                                                parser))
    handler: Handler = args.handler
    return run_handler(handler, args, _prog(parser, args))

if __name__ == "__main__":
    sys.exit(main())
