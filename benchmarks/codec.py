"""Codec cost: our Encoder/Decoder against hand-written msgspec Structs, in the same run.

The baseline is what perf-floor.md §2 calls ``array_omit_nogc``: Structs with the same fields
and config as ours, a bare ``msgspec.msgpack.Encoder`` and typed ``Decoder``. Contenders
alternate in short bursts and the ratio is the median of per-round ratios, because absolute
times on a shared 2-vCPU guest drift by +-30 % between runs (perf-floor.md, "How to read").
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ..protocol.codec import Decoder, Encoder
from ..protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    UtilityOutput,
)
from .floor import FloorSampling

__all__ = ["run_codec_bench"]

# The sampling struct is the same shape in both baselines; the others differ on purpose
# (here: exactly our fields, for byte-identical payloads; the floor: perf-floor's shapes).
_BaseSampling = FloorSampling


class _BaseRequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: _BaseSampling = _BaseSampling()
    arrival_time: float = 0.0
    priority: int = 0
    tensors: dict[str, Any] | None = None
    client_index: int = 0
    data_parallel_rank: int | None = None


class _BaseOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


class _BaseOutputs(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[_BaseOutput] = []
    timestamp: float = 0.0
    finished_requests: list[str] | None = None
    scheduler_stats: Any = None
    utility_output: Any = None
    stream_ids: list[str] = []
    stream_tokens: list[int] = []
    session: bytes | None = None
    refusal: str | None = None
    power: Any = None


class _BaseBlob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    call_id: int
    failure_message: str | None
    result: bytes


def _big_tensor_row(rounds: int) -> dict[str, Any]:
    """A 64 MiB tensor as a utility result: aux frame (ours) vs inline msgpack bytes."""
    import numpy as np
    import torch

    t = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)
    enc, dec = Encoder(), Decoder(UtilityOutput)
    benc, bdec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(_BaseBlob)

    def ours() -> object:
        return dec.decode(enc.encode(UtilityOutput(1, None, t))).result

    def base() -> object:
        blob = bdec.decode(benc.encode(_BaseBlob(1, None, t.numpy().tobytes()))).result
        return torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy())

    o_us, b_us, ratio = _interleaved(ours, base, rounds, 0.0)
    return {"name": "codec 64MiB tensor enc+dec", "ours_us": round(o_us, 3),
            "baseline_us": round(b_us, 3), "ratio": round(ratio, 4)}  # fmt: skip


def _request_id(rng: random.Random) -> str:
    return f"cmpl-{rng.getrandbits(128):032x}-0-{rng.getrandbits(32):08x}"


def _outputs(n: int, rng: random.Random) -> tuple[EngineCoreOutputs, _BaseOutputs]:
    """perf-floor §2 "outN": one token each, LENGTH 1 in 64, 256 cached tokens 1 in 4."""
    ours: list[EngineCoreOutput] = []
    base: list[_BaseOutput] = []
    for i in range(n):
        rid, tok = _request_id(rng), rng.randrange(150_000)
        fin = FinishReason.LENGTH if i % 64 == 63 else None
        cached = 256 if i % 4 == 0 else 0
        ours.append(EngineCoreOutput(rid, [tok], finish_reason=fin, num_cached_tokens=cached))
        base.append(
            _BaseOutput(rid, [tok], finish_reason=None if fin is None else int(fin),
                        num_cached_tokens=cached)
        )  # fmt: skip
    ts = time.monotonic()
    return EngineCoreOutputs(outputs=ours, timestamp=ts), _BaseOutputs(outputs=base, timestamp=ts)


def _add(rng: random.Random) -> tuple[EngineCoreRequest, _BaseRequest]:
    """perf-floor §2 "add": a 512-token prompt with six non-default sampling fields."""
    rid = _request_id(rng)
    prompt = [rng.randrange(150_000) for _ in range(512)]
    sp: dict[str, Any] = dict(
        max_tokens=64, temperature=0.7, top_p=0.95, top_k=50, seed=1234, stop_token_ids=[2]
    )
    now = time.time()
    return (
        EngineCoreRequest(rid, prompt, SamplingParams(**sp), arrival_time=now),
        _BaseRequest(rid, prompt, _BaseSampling(**sp), arrival_time=now),
    )


def _per_call_us(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def _interleaved(
    ours: Callable[[], object], base: Callable[[], object], rounds: int, burst_s: float
) -> tuple[float, float, float]:
    """Median µs of each and the median of per-round ratios ours/base."""
    iters = max(1, int(burst_s / max(_per_call_us(base, 20) * 1e-6, 1e-7)))
    ours_t: list[float] = []
    base_t: list[float] = []
    ratios: list[float] = []
    for r in range(rounds):
        # Alternate who goes first so warm caches favour neither side.
        if r % 2:
            o, b = _per_call_us(ours, iters), _per_call_us(base, iters)
        else:
            b, o = _per_call_us(base, iters), _per_call_us(ours, iters)
        ours_t.append(o)
        base_t.append(b)
        ratios.append(o / b)
    return statistics.median(ours_t), statistics.median(base_t), statistics.median(ratios)


def run_codec_bench(quick: bool) -> list[dict[str, Any]]:
    """Rows ``{name, ours_us, baseline_us, ratio}`` for encode+decode of each message."""
    rng = random.Random(0)
    rounds, burst_s = (21, 0.003) if quick else (41, 0.01)
    cases: list[tuple[str, object, object, Any, Any]] = []
    for n in (1, 32, 256, 1024):
        o, b = _outputs(n, rng)
        cases.append((f"outputs{n}", o, b, EngineCoreOutputs, _BaseOutputs))
    o_add, b_add = _add(rng)
    cases.append(("add512", o_add, b_add, EngineCoreRequest, _BaseRequest))

    rows: list[dict[str, Any]] = []
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # both sides alike; a collection mid-burst would skew one round only
    try:
        for name, ours_msg, base_msg, ours_type, base_type in cases:
            enc = Encoder()
            dec: Decoder[Any] = Decoder(ours_type)
            benc = msgspec.msgpack.Encoder()
            bdec = msgspec.msgpack.Decoder(base_type)
            # Same bytes on the wire, or the comparison is meaningless.
            assert enc.encode(ours_msg)[0] == benc.encode(base_msg), name

            def ours(m: object = ours_msg, e: Encoder = enc, d: Decoder[Any] = dec) -> object:
                return d.decode(e.encode(m))

            def base(
                m: object = base_msg,
                e: msgspec.msgpack.Encoder = benc,
                d: msgspec.msgpack.Decoder[Any] = bdec,
            ) -> object:
                return d.decode(e.encode(m))

            o_us, b_us, ratio = _interleaved(ours, base, rounds, burst_s)
            rows.append(
                {"name": f"codec {name} enc+dec", "ours_us": round(o_us, 3),
                 "baseline_us": round(b_us, 3), "ratio": round(ratio, 3)}
            )  # fmt: skip
            gc.collect()
        rows.append(_big_tensor_row(3 if quick else 9))
    finally:
        if was_enabled:
            gc.enable()
    return rows


if __name__ == "__main__":
    for row in run_codec_bench(quick=False):
        print(row)
