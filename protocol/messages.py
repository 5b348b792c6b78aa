"""Wire messages: frozen msgspec Structs, one closed set per direction.

Evolution rule (msgspec's schema-evolution guide): Structs are ``array_like`` (positional),
so fields are only ever *appended*, each new field has a default, and no field is removed,
renamed or re-typed. An older peer's shorter array still decodes; ``tests/protocol`` pins
the positional layout of every message so a reorder fails a test.

Frames. Client -> engine on the ROUTER/DEALER pair: ``[identity, type byte + payload,
aux...]``: a message's first frame is its request-type byte followed by its payload, so the
engine's DEALER sees ``[type byte + payload, aux...]`` and a transport can route on the
first byte without decoding. Engine -> client on PUSH/PULL: ``[payload, aux...]``, or the
single sentinel frame ``ENGINE_DEAD_SENTINEL``. Aux frames follow only a payload that refers
to them (or, with frame integrity, the trailer follows), and each side reads a message's
further parts only then. So every message's first frame says what it is, and a part that
nothing refers to is taken as a message of its own: the engine rejects it alone (nothing
after it is lost), a client fails to decode it and declares the engine dead.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

__all__ = [
    "ENGINE_DEAD_SENTINEL",
    "PROTOCOL_VERSION",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "FinishReason",
    "ReadyResponse",
    "RequestType",
    "SamplingParams",
    "SchedulerStats",
    "UtilityOutput",
    "UtilityRequest",
]

# Bumped on any incompatible change; checked in the ready handshake.
PROTOCOL_VERSION = 2

# One frame, exactly these bytes. A msgpack-encoded message starts with an array header
# (0x90-0x9f, 0xdc, 0xdd), never with 'E' (0x45), so the two cannot be confused.
ENGINE_DEAD_SENTINEL = b"ENGINEWIRE_ENGINE_DEAD"


class RequestType(bytes, enum.Enum):
    """First byte of a client message's first frame; the payload follows it in that frame."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class EngineCoreRequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = SamplingParams()
    arrival_time: float = 0.0
    priority: int = 0
    # Optional tensors (e.g. prompt embeddings) travel as out-of-band frames via the codec.
    tensors: dict[str, Any] | None = None
    client_index: int = 0


class UtilityRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    client_index: int
    call_id: int
    method: str
    args: list[Any] = []


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class SchedulerStats(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preempted: int = 0
    step_counter: int = 0


class EngineCoreOutputs(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    finished_requests: list[str] | None = None
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    # Columnar form of the commonest output (one new token, not finished, no cached-token
    # count): request ``stream_ids[i]`` got token ``stream_tokens[i]``. Two flat lists cost a
    # fraction of one struct per request to build, encode and decode; a client hands callers
    # ``expanded()`` batches, so ``outputs`` is all they ever read.
    stream_ids: list[str] = []
    stream_tokens: list[int] = []

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def expanded(self) -> EngineCoreOutputs:
        """This batch with the stream columns turned into ``outputs`` (itself if none)."""
        ids = self.stream_ids
        if not ids:
            return self
        out = EngineCoreOutput
        outputs = [out(rid, [tok]) for rid, tok in zip(ids, self.stream_tokens, strict=True)]
        if self.outputs:
            outputs += self.outputs
        return msgspec.structs.replace(self, outputs=outputs, stream_ids=[], stream_tokens=[])


class ReadyResponse(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The engine's first message on the input socket: who it is and what it can hold."""

    protocol_version: int
    engine_index: int
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    model: str
    device: str
