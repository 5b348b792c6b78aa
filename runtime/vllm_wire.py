"""A vLLM 0.33 wire profile for enginewire's engine process: vLLM's unmodified clients attach.

Theory of operation
-------------------
Rule 1: only the bytes change. ``VllmWire`` is a wire profile (runtime/_engine_wire.py): it
decodes vLLM 0.33.0's engine-core wire (docs/vllm.md; the reference's §2-§3), encodes its
outputs, says its ready and its dead sentinel, and holds no thread, socket or queue. The
input and output threads, the busy loop, the ``EngineCore`` under it, the fault points, the
deferred replies and the heartbeat are enginewire's, untouched (``VllmWireEngineProc`` is an
``EngineCoreProc`` given this profile). So a fault plan armed through ``arm_fault`` fires in
the same places as on enginewire's own wire.
Rule 2: translate at the boundary, once. A vLLM message becomes an enginewire input item as
it is decoded (input thread); an enginewire output becomes a vLLM ``EngineCoreOutputs`` as it
is encoded (output path). Nothing in between knows which wire is spoken.

What vLLM's clients expect, and where it is met:

* handshake (``client_addresses`` mode, reference §3.2 step 6): the engine's DEALER
  (identity = rank, 2 bytes little-endian) connects to the client's ROUTER and speaks first,
  one frame ``msgpack(EngineCoreReadyResponse)`` (a map); the client binds both sockets.
* client -> engine: ``[type byte, msgpack payload, aux...]`` as separate frames (ADD 0x00 an
  ``EngineCoreRequest`` array, ABORT 0x01 a list of ids, UTILITY 0x03
  ``[client_index, call_id, method, args]``); reference §2.2-§2.3.
* engine -> client: ``[msgpack(EngineCoreOutputs)]``; a utility reply is a batch with
  ``utility_output = [call_id, failure_message, [type_info=nil, result]]``; death is the one
  frame ``b"ENGINE_CORE_DEAD"``.

The structs it translates to and from mirror vLLM 0.33.0's positional layouts
(protocol/vllm033.py, re-exported here) instead of importing them: importing
``vllm.v1.engine`` costs ~12 s of torch per engine start, and the campaign starts engines
often. This module does not import vllm at all; ``enginewire.testing.vllm_factory`` (the
client side) does, lazily.

Run one (what the factory launches)::

    python -m enginewire.runtime.vllm_wire --input-address ipc://... --output-address ipc://...
        [--config JSON] [--fault JSON] [--parent-pid PID] [--startup-delay-s S]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any

import msgspec
import zmq

from ..protocol.codec import Limits
from ..protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    SamplingParams,
    UtilityRequest,
)
from ..protocol.results import plain_result
from ..protocol.vllm033 import (
    VLLM_DEAD_SENTINEL,
    VLLM_VERSION,
    VllmEngineCoreOutput,
    VllmEngineCoreOutputs,
    VllmEngineCoreRequest,
    VllmPrefillStats,
    VllmReadyResponse,
    VllmRequestError,
    VllmSamplingParams,
    VllmUtilityOutput,
)
from ..spec.errors import ProtocolError
from ._engine_shared import Control
from ._engine_wire import Decode, WireProfile
from .engine_proc import EngineCoreProc, run_engine_core
from .zmq_io import ZMQ_RCVMORE, recv_rest

__all__ = [
    "VLLM_DEAD_SENTINEL",
    "VLLM_VERSION",
    "VllmEngineCoreOutput",
    "VllmEngineCoreOutputs",
    "VllmEngineCoreRequest",
    "VllmOutputEncoder",
    "VllmReadyResponse",
    "VllmSamplingParams",
    "VllmWire",
    "VllmWireEngineProc",
    "outputs_to_vllm",
    "request_from_vllm",
    "run_vllm_engine",
]

logger = logging.getLogger("enginewire.runtime.engine_proc")

# vLLM's request-type bytes (reference §2.2). 0x02 (START_DP_WAVE) comes from a coordinator,
# which a single engine has none of: it is dropped like any unknown type.
_ADD, _ABORT, _UTILITY = b"\x00", b"\x01", b"\x03"


# --- translation -----------------------------------------------------------------------------


def request_from_vllm(v: VllmEngineCoreRequest) -> EngineCoreRequest:
    """vLLM's ADD as enginewire's. What enginewire's engine cannot do is refused here, as a
    ``ValueError`` the caller turns into that request's ERROR (vLLM's own input thread turns
    pre-processing errors into per-request ERROR outputs, reference §4.2)."""
    if v.prompt_token_ids is None:
        raise ValueError("prompt_embeds/multimodal-only requests are not supported")
    if v.pooling_params is not None or v.lora_request is not None or v.mm_features:
        raise ValueError("pooling, LoRA and multimodal requests are not supported")
    sp = v.sampling_params or VllmSamplingParams()
    if sp.n != 1:
        raise ValueError(f"n={sp.n}: only n=1 is supported")
    return EngineCoreRequest(
        v.request_id,
        list(v.prompt_token_ids),
        SamplingParams(
            max_tokens=16 if sp.max_tokens is None else sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=max(0, sp.top_k),
            seed=sp.seed,
            stop_token_ids=list(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
        ),
        arrival_time=v.arrival_time,
        priority=v.priority,
        client_index=v.client_index,
        data_parallel_rank=v.data_parallel_rank,
    )


def _output_to_vllm(o: Any) -> VllmEngineCoreOutput:
    prefill = VllmPrefillStats(num_cached_tokens=o.num_cached_tokens) if o.num_cached_tokens \
        else None
    error = None if o.error is None else VllmRequestError("error", str(o.error))
    return VllmEngineCoreOutput(
        o.request_id, list(o.new_token_ids),
        finish_reason=None if o.finish_reason is None else int(o.finish_reason),
        stop_reason=o.stop_reason, prefill_stats=prefill, error=error)


def outputs_to_vllm(batch: EngineCoreOutputs) -> VllmEngineCoreOutputs:
    """enginewire's batch as vLLM's. Streamed tokens (``stream_ids``/``stream_tokens``, one
    token per id) become ordinary outputs; the session fields have no vLLM counterpart (no
    vLLM client attaches, so none is ever set here)."""
    outs = [_output_to_vllm(o) for o in batch.outputs]
    if batch.stream_ids:
        outs = [VllmEngineCoreOutput(rid, [tok]) for rid, tok in
                zip(batch.stream_ids, batch.stream_tokens, strict=True)] + outs
    u = batch.utility_output
    util = None
    if u is not None:
        # vLLM's wire has no EXT_STRUCT: a typed record (get_stats, drain_trace...) goes as
        # the map msgpack makes of it, as any struct result does there (type_info nil).
        util = VllmUtilityOutput(
            u.call_id, u.failure_message,
            None if u.failure_message is not None else [None, plain_result(u.result)])
    return VllmEngineCoreOutputs(
        engine_index=batch.engine_index, outputs=outs, timestamp=batch.timestamp,
        utility_output=util,
        finished_requests=None if batch.finished_requests is None
        else list(batch.finished_requests))


class VllmOutputEncoder:
    """The vLLM profile's encoder (``protocol.codec.Encoder``'s two methods): every batch
    leaves as vLLM's ``EngineCoreOutputs``."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> list[Any]:
        return [self._enc.encode(outputs_to_vllm(obj))]

    def encode_into(self, obj: Any, buf: bytearray) -> list[Any]:
        self._enc.encode_into(outputs_to_vllm(obj), buf)
        return [buf]


# Utilities vLLM's clients call with arguments enginewire's engine takes differently.
def _vllm_utility_args(method: str, args: list[Any]) -> list[Any]:
    if method == "pause_scheduler" and len(args) == 2:  # (mode, clear_cache): no cache option
        return args[:1]
    return args


# --- the profile -----------------------------------------------------------------------------


class VllmWire(WireProfile):
    """vLLM 0.33's wire (module docstring): no sessions, so one ready, queued as the DEALER
    connects, and the client's first message completes the handshake; no short call path
    (a call's payload is a frame of its own)."""

    name = "vllm-0.33"
    dead_sentinel = VLLM_DEAD_SENTINEL
    sessions = False

    def encoder(self) -> VllmOutputEncoder:
        return VllmOutputEncoder()

    def ready(self, engine: Any, engine_index: int, *,
              front_end_timeout_s: float | None = None) -> list[Any]:
        # No sessions on this wire, so never a front-end deadline (EngineCoreProc refuses one).
        info = engine.ready_info()
        cfg = engine.config
        blocks, block = int(info["num_gpu_blocks"]), int(info["block_size"])
        return [msgspec.msgpack.encode(VllmReadyResponse(
            max_model_len=int(info["max_model_len"]), num_gpu_blocks=blocks, block_size=block,
            dp_stats_address=None, dtype=str(getattr(cfg, "dtype", "float32")),
            vllm_version=VLLM_VERSION, world_size=1, data_parallel_size=1,
            tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1,
            data_parallel_rank=engine_index,
            max_num_seqs=int(getattr(cfg, "max_num_seqs", 1)),
            max_num_batched_tokens=int(getattr(cfg, "max_num_batched_tokens", 1)),
            instance_id=f"enginewire-{os.getpid()}", supports_lora=False, max_loras=0,
            kv_cache_size_tokens=blocks * block, enable_sleep_mode=True))]

    def decoder(self, limits: Limits, vocab_size: int | None, max_parts: int) -> Decode:
        decode_req = msgspec.msgpack.Decoder(VllmEngineCoreRequest).decode
        decode_any = msgspec.msgpack.Decoder().decode

        def decode(frames: list[Any], sock: zmq.Socket[Any] | None) -> tuple[Any, Any]:
            if sock is not None and sock.get(ZMQ_RCVMORE):
                recv_rest(sock, frames, max_parts)
            kind, body = frames[0], bytes(frames[1]) if len(frames) > 1 else b""
            if kind == _ADD:
                try:
                    v = decode_req(body)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise ProtocolError(f"malformed request: {e}") from e
                try:
                    return RequestType.ADD, request_from_vllm(v)
                except ValueError as e:
                    # Decoded, but not for this engine: that request's ERROR, in order.
                    return Control.REJECT_ADD, (v.request_id, str(e))
            if kind == _ABORT:
                ids = _decoded(decode_any, body)
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise ProtocolError(f"malformed ABORT: {ids!r:.200}")
                return RequestType.ABORT, ids
            if kind == _UTILITY:
                call = _decoded(decode_any, body)
                if not (isinstance(call, list) and len(call) == 4 and isinstance(call[1], int)
                        and isinstance(call[2], str) and isinstance(call[3], list)):
                    raise ProtocolError(f"malformed utility call: {call!r:.200}")
                return RequestType.UTILITY, UtilityRequest(
                    int(call[0] or 0), call[1], call[2], _vllm_utility_args(call[2], call[3]))
            raise ProtocolError(f"malformed input (type byte {bytes(kind[:1])!r})")

        return decode

    def short_call(self, limits: Limits) -> None:
        return None

    def rejection(self, frames: list[Any], error: ProtocolError) -> tuple[Control, Any] | None:
        if frames[0] != _ADD:
            logger.warning("rejected %s", error)
            return None
        try:
            head = msgspec.msgpack.decode(bytes(frames[1]) if len(frames) > 1 else b"")
            rid = head[0] if isinstance(head, list) and head and isinstance(head[0], str) \
                else None
        except Exception:
            rid = None
        if rid is None:
            logger.warning("rejected malformed ADD (no id): %s", error)
            return None
        logger.warning("rejected malformed ADD for %.80r: %.300s", rid, error)
        return Control.REJECT_ADD, (rid, str(error))


def _decoded(decode: Any, body: bytes) -> Any:
    try:
        return decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed payload: {e}") from e


class VllmWireEngineProc(EngineCoreProc):
    """``EngineCoreProc`` speaking vLLM 0.33's wire: the profile is all that differs."""

    wire = VllmWire


def run_vllm_engine(config: Any, *, input_address: str, output_address: str,
                    parent_pid: int | None = None, startup_delay_s: float = 0.0,
                    fault: Any = None, heartbeat_interval_s: float | None = None) -> int:
    """``engine_proc.run_engine_core`` with the vLLM wire's engine process. Returns the exit
    status."""
    from ._engine_trace import engine_trace_for

    # Trace mode as for any launched engine (ENGINEWIRE_ENGINE_TRACE): the harness drains the
    # engine's own lifecycle records through vLLM's call_utility and judges its side too.
    return run_engine_core(config, input_address=input_address, output_address=output_address,
                           parent_pid=parent_pid, startup_delay_s=startup_delay_s, fault=fault,
                           heartbeat_interval_s=heartbeat_interval_s,
                           proc_class=VllmWireEngineProc, trace=engine_trace_for(config))


def main(argv: list[str] | None = None) -> None:
    from .config import EngineConfig
    from .engine_proc import configure_logging
    from .faults import FaultPlan

    ap = argparse.ArgumentParser(prog="python -m enginewire.runtime.vllm_wire")
    ap.add_argument("--input-address", required=True)
    ap.add_argument("--output-address", required=True)
    ap.add_argument("--config", default="{}", help="EngineConfig as JSON")
    ap.add_argument("--fault", default=None, help="FaultPlan as JSON")
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--startup-delay-s", type=float, default=0.0)
    ap.add_argument("--heartbeat-interval-s", type=float, default=None)
    args = ap.parse_args(argv)
    configure_logging()
    config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
    fault = None if args.fault is None else msgspec.json.decode(args.fault.encode(),
                                                                 type=FaultPlan)
    code = 1
    try:
        code = run_vllm_engine(config, input_address=args.input_address,
                               output_address=args.output_address, parent_pid=args.parent_pid,
                               startup_delay_s=args.startup_delay_s, fault=fault,
                               heartbeat_interval_s=args.heartbeat_interval_s)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def encode_config(config: Any) -> str:
    """``--config`` for ``main``."""
    return msgspec.json.encode(config).decode()


def encode_plan(plan: Any) -> str | None:
    """``--fault`` for ``main`` (None: no plan)."""
    return None if plan is None else msgspec.json.encode(plan).decode()


if __name__ == "__main__":
    main()
