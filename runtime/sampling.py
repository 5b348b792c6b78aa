"""Per-request seeded sampling: greedy, temperature, top-k, top-p.

Greedy rows are decided together with one argmax. A random row draws from the request's own
``torch.Generator`` (created from its seed on first use, on the CPU so the draw sequence does
not depend on the device), so a seeded request gives the same tokens whatever else shares its
batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # imported where used: only the torch models sample (runtime/model.py)
    import torch

__all__ = ["SamplingState", "sample"]

# vLLM's _SAMPLING_EPS: a temperature below it samples greedily. Dividing logits by a smaller
# one overflows them to inf and softmax to NaN (temperature=1e-45 killed the engine).
_GREEDY_BELOW = 1e-5


class SamplingState(Protocol):
    temperature: float
    top_k: int
    top_p: float
    seed: int
    generator: torch.Generator | None


def _filtered_probs(row: torch.Tensor, temperature: float, top_k: int,
                    top_p: float) -> torch.Tensor:
    import torch

    row = row.float() / temperature
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        # Said, not assumed: a top_p below float32's smallest value compares as 0 and would
        # drop every token (all -inf, NaN probabilities, a dead engine).
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.empty_like(row).scatter_(0, order, sorted_logits)
    return torch.softmax(row, dim=-1)


def sample(logits: torch.Tensor, reqs: Sequence[SamplingState]) -> list[int]:
    """One token per row of ``logits`` [N, vocab], row i sampled with ``reqs[i]``'s params."""
    import torch

    out = logits.argmax(dim=-1).tolist()
    cpu_logits: torch.Tensor | None = None
    for i, r in enumerate(reqs):
        if r.temperature < _GREEDY_BELOW:
            continue
        if cpu_logits is None:
            cpu_logits = logits.float().cpu()
        if r.generator is None:
            r.generator = torch.Generator().manual_seed(r.seed)
        probs = _filtered_probs(cpu_logits[i], r.temperature, r.top_k, r.top_p)
        out[i] = int(torch.multinomial(probs, 1, generator=r.generator))
    return out
