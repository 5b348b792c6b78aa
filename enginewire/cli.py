"""The ``enginewire`` command line: one entry point, one subcommand per job.

Exit codes mean the same thing everywhere:
0 the job ran and everything it checked held; 1 a check failed (a property, a campaign, a
fault cell, a benchmark bar); 2 bad usage; 3 the environment is missing something (a tool,
a model file). Each subcommand imports its machinery lazily so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENV = 0, 1, 2, 3

Handler = Callable[[argparse.Namespace], int]


def _spec_check(args: argparse.Namespace) -> int:
    from .testing.spec_check import run_spec_check

    return run_spec_check(
        negative=args.negative,
        spin=False if args.no_spin else None,
        controls=args.controls,
    )


def _spec_diagrams(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .testing.generate import write_diagrams

    for path in write_diagrams(Path(args.out)):
        print(path)
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    from ._generate import run_generate

    return run_generate(
        model=args.model,
        prompt=args.prompt,
        prompt_tokens=args.prompt_tokens,
        client=args.client,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )


def _engine(args: argparse.Namespace) -> int:
    from .runtime import security
    from .runtime.config import EngineConfig
    from .runtime.engine_proc import run_engine_core

    try:
        curve = security.curve_from_options(args.curve_key, args.curve_peer or [])
    except (OSError, ValueError) as exc:  # unreadable, unsafe or malformed key material
        print(f"enginewire engine: {exc}", file=sys.stderr)
        return EXIT_ENV
    return run_engine_core(
        EngineConfig(model=args.model, seed=args.seed),
        input_address=args.input_address,
        output_address=args.output_address,
        engine_index=args.engine_index,
        heartbeat_interval_s=args.heartbeat_interval,
        curve=curve,
        allow_insecure_tcp=args.allow_insecure_tcp,
        integrity=args.integrity,
    )


def _campaign(args: argparse.Namespace) -> int:
    from .testing.campaign import run_campaign

    return run_campaign(
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
    )


def _faults_matrix(args: argparse.Namespace) -> int:
    from .faults import run_fault_matrix

    return run_fault_matrix(args.client or None, quick=args.quick, results_dir=args.results_dir)


def _bench(args: argparse.Namespace) -> int:
    from .benchmarks.run import run_bench

    only = [x for x in args.only.split(",") if x] if args.only else None
    return run_bench(quick=args.quick, json_out=args.json, plot_out=args.plot, only=only)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="enginewire",
        description=(
            "A formally specified front-end <-> engine-core protocol for LLM inference engines: "
            "model-check the spec, run campaigns and fault matrices against a real engine, "
            "benchmark the IPC layer, or serve an engine."
        ),
        epilog="Exit codes: 0 ok, 1 a check failed, 2 bad usage, 3 missing tool or file.",
    )
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
    diagrams.add_argument("--out", default="docs/diagrams", help="output directory")
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
        choices=("inproc", "sync", "async", "all"),
        default="all",
        help="which client to drive (default: all three)",
    )
    camp.add_argument("--examples", type=int, default=10, help="Hypothesis examples per client")
    camp.add_argument("--steps", type=int, default=25, help="maximum rules per example")
    camp.add_argument("--seed", type=int, help="seed for a reproducible run (printed when unset)")
    camp.add_argument(
        "--faults", choices=("on", "off"), default="on", help="include crash and fault rules"
    )
    camp.add_argument(
        "--duration", type=float, metavar="SECONDS", help="run until this much time has passed"
    )
    camp.add_argument(
        "--model", choices=("tiny", "null"), default="null", help="engine model to drive"
    )
    camp.add_argument("--mutant", metavar="NAME", help="run with one seeded bug switched on")
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
        "--results-dir", default="results", help="directory for the JSON report"
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
        "--results-dir", default="results", help="directory for fault_matrix.json"
    )
    matrix.set_defaults(handler=_faults_matrix)

    bench = sub.add_parser(
        "bench",
        help="measure IPC cost against a raw pyzmq floor measured in the same run",
        description="Run every measurement next to its floor in one invocation and print "
        "medians, spreads and ratios with the target bars; exits 1 if a bar is missed.",
    )
    bench.add_argument("--quick", action="store_true", help="small counts (under 2 minutes)")
    bench.add_argument("--json", metavar="PATH", help="write every row as JSON to PATH")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG plot of the ratios to PATH")
    bench.add_argument(
        "--only",
        metavar="SECTIONS",
        help="comma-separated subset of: echo, delivery, compute, codec, spec, inproc, engine, "
        "model",
    )
    bench.set_defaults(handler=_bench)

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
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.set_defaults(handler=_generate)

    eng = sub.add_parser(
        "engine",
        help="run an engine process that connects to a front end's addresses",
        description="Start an engine core in this process and connect it to a front end that "
        "bound the given input and output addresses (like vLLM's headless engines).",
    )
    eng.add_argument("--model", default="tiny", help="engine model: tiny, null")
    eng.add_argument("--input-address", required=True, help="front end's ROUTER address")
    eng.add_argument("--output-address", required=True, help="front end's PULL address")
    eng.add_argument("--engine-index", type=int, default=0, help="this engine's rank")
    eng.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    eng.add_argument(
        "--heartbeat-interval",
        type=float,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
