"""The differential oracle: a finished greedy request has the tokens it gets when run alone.

Theory of operation
-------------------
Rule 1: the reference is the engine itself, on its easiest path: one ``EngineCore`` in this
process, built from the campaign's config with prefix caching off and ``max_num_seqs=1``, that
runs one request at a time from an empty scheduler. Whatever batching, chunking beside other
requests, preemption, sleep/wake or prefix-cache reuse did to the engine under test, a correct
engine gives a greedy request the tokens the lone run gives it. The null model's tokens do
not read the KV cache (the ``Oracle`` predicts them exactly); only a real model's do, so this
check is what sees a stale or shared KV block.
Rule 2: a mismatch is a violation only where the reference's pick was clear. Batched and lone
runs are not bit-identical on the CPU: every logit row of the tiny model in float32 differed,
by at most 2.9e-6, between a batch of 16 and a lone run (800 requests, chunked prefill and
preemption included; tests/model_tests/test_reference.py keeps checking it), while the greedy
tokens were equal in all of them (2 000 requests). So the reference records, at each position,
the tokens whose logit lies within ``TIE_TOLERANCE`` of the top one; an engine that picked
another of those has legitimately diverged, and the rest of that request (a different
continuation) is not judged.
Rule 3: off the hot path. A request is looked up when the machine sees it finish and compared
once its rule is over (``CampaignMachine._compare_finished``), never inside a bounded wait;
each distinct (prompt, params) runs once and is cached. No thread: the campaign's teardown
counts this process's threads, and a helper thread would read as a leak.

The reference runs the same runtime, so a bug on the lone path itself (a mutant that changes
every request's tokens) is invisible here: this check judges what sharing an engine does to a
request, which is where KV bugs live.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from ..protocol.messages import EngineCoreRequest, FinishReason
from ..runtime.config import EngineConfig
from ..runtime.kv_cache import num_blocks_for
from ..runtime.model import LlamaModel
from .oracle import OracleViolation

if TYPE_CHECKING:
    import torch

    from ..runtime.engine import EngineCore

__all__ = [
    "TIE_TOLERANCE",
    "DifferentialOracle",
    "ReferenceEngine",
    "ReferenceRun",
    "ReferenceStatistics",
    "reference_config",
    "reference_unavailable",
    "release_references",
]

# Logits closer than this to the top one are a tie the two runs may break differently: 35x
# the largest batched-vs-lone difference measured (2.9e-6, module docstring), and small next
# to the tiny model's typical top-2 margin (O(0.1); about 1 pick in 400 falls under 1e-3).
TIE_TOLERANCE = 1e-4
# runtime/sampling.py's _GREEDY_BELOW: a lower temperature samples with argmax.
_GREEDY_BELOW = 1e-5
# How much of a token list a violation message shows.
_SHOWN = 24


def reference_unavailable(config: EngineConfig) -> str | None:
    """Why the differential oracle cannot judge ``config``'s engine (None: it can)."""
    if config.model == "null":
        return "the null model ignores the KV cache (the Oracle predicts its tokens exactly)"
    if config.dtype != "float32":
        return (f"dtype {config.dtype}: only float32's batched-vs-lone rounding is measured"
                f" (below {TIE_TOLERANCE:g})")
    if config.resolved_device() != "cpu":
        return (f"device {config.resolved_device()}: only the CPU's batched-vs-lone rounding"
                " is measured")
    return None


def reference_config(config: EngineConfig) -> EngineConfig:
    """``config`` for the lone reference: no prefix caching, one sequence, one engine, and
    just the blocks one sequence of ``max_model_len`` needs (so it never preempts)."""
    return msgspec.structs.replace(
        config, enable_prefix_caching=False, max_num_seqs=1, data_parallel_size=1,
        data_parallel_backend="mp",
        num_gpu_blocks_override=num_blocks_for(config.max_model_len, config.block_size) + 1)


@dataclass(frozen=True)
class ReferenceRun:
    """What a request gets alone: its tokens, its ending, and at each position the tokens
    within ``TIE_TOLERANCE`` of the top logit when there is more than one (else empty)."""

    tokens: tuple[int, ...]
    finish: FinishReason
    ties: tuple[frozenset[int], ...]
    error: str | None = None


@dataclass(frozen=True)
class ReferenceStatistics:
    compared: int  # finished greedy requests judged
    diverged_at_tie: int  # of which, judged only up to a near-tie the two runs broke apart
    reference_runs: int  # lone runs computed (the rest came from the cache)
    seconds: float  # spent computing lone runs and comparing


def _ties(row: torch.Tensor) -> frozenset[int]:
    import torch

    top = torch.topk(row, 2).values
    if float(top[0] - top[1]) >= TIE_TOLERANCE:
        return frozenset()
    return frozenset(torch.nonzero(row >= top[0] - TIE_TOLERANCE).flatten().tolist())


def _request_key(req: EngineCoreRequest) -> tuple[Any, ...]:
    # Greedy tokens depend on these only: seed, top_p and top_k are unused at temperature 0.
    sp = req.sampling_params
    return (tuple(req.prompt_token_ids), sp.max_tokens, tuple(sorted(set(sp.stop_token_ids))),
            sp.ignore_eos, req.priority)


class _RecordingModel(LlamaModel):
    """The engine's model (same weights, same forward), leaving each sampled row's near-ties
    in ``picks``: a lone request samples one row a step, so they line up with its tokens."""

    def __init__(self, model: LlamaModel, picks: list[frozenset[int]]) -> None:
        super().__init__(model.arch, model.params, model.device)
        self.picks = picks

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        self.picks.append(_ties(logits[-1]))
        return logits


class ReferenceEngine:
    """A fresh in-process engine that runs one request at a time (``run``, cached)."""

    def __init__(self, config: EngineConfig) -> None:
        from ..runtime.engine import EngineCore
        from ..runtime.executor import TorchWorker

        why = reference_unavailable(config)
        if why is not None:
            raise ValueError(f"no lone reference for model={config.model!r}: {why}")
        self.config = reference_config(config)
        self._engine: EngineCore = EngineCore(self.config)
        self._picks: list[frozenset[int]] = []
        assert self._engine.executor is not None
        worker = self._engine.executor.driver
        if not isinstance(worker, TorchWorker) or worker.model is None:
            raise ValueError(f"model {config.model!r} has no torch worker to run as reference")
        worker.model = _RecordingModel(worker.model, self._picks)
        self._cache: dict[tuple[Any, ...], ReferenceRun] = {}
        self.runs = 0

    def run(self, req: EngineCoreRequest) -> ReferenceRun:
        """``req`` alone (its id, arrival time and engine pin do not matter): cached per
        prompt and greedy-relevant params."""
        key = _request_key(req)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._run(req)
        return hit

    def _run(self, req: EngineCoreRequest) -> ReferenceRun:
        eng = self._engine
        self._picks.clear()
        eng.add_request(EngineCoreRequest("reference", list(req.prompt_token_ids),
                                          req.sampling_params, priority=req.priority))
        tokens: list[int] = []
        finish: FinishReason | None = None
        error: str | None = None
        # Prefill chunks plus one step per token, and slack: a loop past that is a bug here.
        for _ in range(len(req.prompt_token_ids) + req.sampling_params.max_tokens + 8):
            for out in eng.step().outputs:
                tokens.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    finish, error = FinishReason(out.finish_reason), out.error
            if finish is not None:
                break
        else:
            raise RuntimeError(f"the reference engine did not finish {req.request_id!r}")
        self.runs += 1
        ties = tuple(self._picks[:len(tokens)])
        return ReferenceRun(tuple(tokens), finish, ties, error)

    def close(self) -> None:
        self._engine.shutdown()


# One per reference config in this process: a campaign runs several client kinds (and tests
# several campaigns) on one config, and the lone runs are the same for all of them.
_ENGINES: dict[EngineConfig, ReferenceEngine] = {}


def release_references() -> None:
    """Shut every shared reference engine down (a campaign's end): each holds its model's
    weights, and a GGUF model's file stays open (read as a leaked fd) until then."""
    while _ENGINES:
        _, engine = _ENGINES.popitem()
        engine.close()


def _shown(tokens: list[int] | tuple[int, ...], at: int) -> str:
    lo = max(0, at - _SHOWN // 2)
    part = ", ".join(map(str, tokens[lo:lo + _SHOWN]))
    return (f"[{'..., ' if lo else ''}{part}{', ...' if lo + _SHOWN < len(tokens) else ''}]"
            f" ({len(tokens)} tokens)")


class DifferentialOracle:
    """Judges finished requests against their lone run on ``ReferenceEngine`` (``check``).

    Build it before any client of the campaign (``for_config``): the reference engine loads
    the model in this process, and a leak check that snapshots this process's threads and
    fds must see that done."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine
        self._compared = 0
        self._ties = 0
        self._runs_before = engine.runs
        self._seconds = 0.0

    @classmethod
    def for_config(cls, config: EngineConfig) -> DifferentialOracle:
        """A checker for engines built from ``config``; ValueError when it cannot judge them
        (``reference_unavailable``). The reference engine is shared per config."""
        key = reference_config(config)
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = ReferenceEngine(config)
        return cls(engine)

    @staticmethod
    def applies(req: EngineCoreRequest) -> bool:
        """Whether ``req``'s tokens are determined: greedy, from token ids alone."""
        return req.sampling_params.temperature < _GREEDY_BELOW and not req.tensors

    def check(self, req: EngineCoreRequest, tokens: list[int], finish: FinishReason, *,
              rid: str | None = None, history: str = "") -> bool:
        """Raise ``OracleViolation`` unless ``tokens`` and ``finish`` (a LENGTH or STOP
        ending) are the lone run's, up to a near-tie; True when the comparison stopped at a
        near-tie the runs broke apart. ``history``: what the request went through, for the
        message."""
        start = time.monotonic()
        self._compared += 1
        try:
            want = self.engine.run(req)
            diverged = self._compare(rid or req.request_id, want, tokens, finish, history)
        finally:
            self._seconds += time.monotonic() - start
        self._ties += diverged
        return diverged

    def _compare(self, rid: str, want: ReferenceRun, got: list[int], finish: FinishReason,
                 history: str) -> bool:
        for i, (g, w) in enumerate(zip(got, want.tokens, strict=False)):
            if g == w:
                continue
            if g in want.ties[i]:
                return True  # a near-tie broken the other way: what follows is not comparable
            self._violation(rid, i, want, got, finish, history)
        if len(got) != len(want.tokens) or finish is not want.finish:
            self._violation(rid, min(len(got), len(want.tokens)), want, got, finish, history)
        return False

    @staticmethod
    def _violation(rid: str, at: int, want: ReferenceRun, got: list[int], finish: FinishReason,
                   history: str) -> None:
        ending = want.finish.name + (f" ({want.error})" if want.error else "")
        raise OracleViolation(
            f"{rid!r} differs from its lone run (no batching, no prefix caching) at token"
            f" {at}: got {_shown(got, at)} ending {finish.name}, alone it gets"
            f" {_shown(want.tokens, at)} ending {ending}"
            + (f"; it {history}" if history else "")
            + " (a KV block stale, shared or written in the wrong place?)")

    def statistics(self) -> ReferenceStatistics:
        return ReferenceStatistics(self._compared, self._ties,
                                   self.engine.runs - self._runs_before, round(self._seconds, 3))
