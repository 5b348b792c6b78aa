"""The wire an engine process speaks, as a profile: what its bytes mean, never how they move.

Theory of operation
-------------------
Rule 1: only the bytes differ between wires. The input thread (``EngineInput``), the output
thread (``EngineOutput``), the busy loop and the gate are the same for every wire; each is
handed a ``WireProfile`` and asks it what a message means (``decoder``, and the idle call's
``short_call``), what to answer one that does not decode (``rejection``), what the ready
handshake says (``ready``), how an output is encoded (``encoder``) and what death looks like
(``dead_sentinel``). A profile holds no socket, thread or queue.
Rule 2: a decoder returns one input item ``(kind, payload)``: a ``RequestType`` with its
payload, or a ``Control`` item for the loop (a request refused as it is translated); anything
it cannot decode raises ``ProtocolError``, and the message is then answered by ``rejection``
if it can be (a failed ADD or call, in order), else only logged. The input thread outlives
every message.

``WireProfile`` is enginewire's own wire (protocol/codec.py); runtime/vllm_wire.py has vLLM
0.33's. Enginewire's wire alone has sessions (``sessions``): the ATTACH and its refusal, frame
integrity, and a ready at every completed handshake (a new front end learns of the engine
only from one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from ..protocol.codec import (
    Decoder,
    Encoder,
    Limits,
    decode_input,
    peek_call_id,
    peek_request_id,
    split_input,
)
from ..protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    ReadyResponse,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from ..spec.errors import ProtocolError
from ._engine_shared import Control
from .zmq_io import ZMQ_RCVMORE, recv_rest

__all__ = ["Decode", "OutputEncoder", "ShortCall", "WireProfile"]

# One logger for the engine process, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.engine_proc")

_UTILITY_BYTE = RequestType.UTILITY.value

# (frames received so far, the socket to read the message's further parts from, or None when
# they were all read) -> one input item; raises ProtocolError.
Decode = Callable[[list[Any], "zmq.Socket[Any] | None"], tuple[Any, Any]]
# A message's first frame -> the utility call it is when it takes the short path, else None.
ShortCall = Callable[[bytes], UtilityRequest | None]


class OutputEncoder(Protocol):
    """What the output path encodes with (``protocol.codec.Encoder``'s two methods)."""

    def encode(self, obj: Any) -> list[Any]: ...

    def encode_into(self, obj: Any, buf: bytearray) -> list[Any]: ...


class WireProfile:
    """Enginewire's own wire (docs/protocol.md); a subclass speaks another (module docstring)."""

    name = "enginewire"
    # What the output path sends as the engine's last message when it dies.
    dead_sentinel: bytes = ENGINE_DEAD_SENTINEL
    # ATTACH and its refusal, frame integrity, a ready at every completed handshake (IMMEDIATE
    # socket); without sessions the ready is sent once, queued as the socket connects, and the
    # client's first message completes the handshake.
    sessions = True

    def encoder(self) -> OutputEncoder:
        encoder: OutputEncoder = Encoder()
        return encoder

    def ready(self, engine: Any, engine_index: int, *,
              front_end_timeout_s: float | None = None) -> list[Any]:
        """The ready handshake's frames, the first message the engine sends;
        ``front_end_timeout_s`` tells a front end to send heartbeats within it."""
        info = engine.ready_info()
        frames: list[Any] = Encoder().encode(ReadyResponse(
            protocol_version=PROTOCOL_VERSION,
            engine_index=engine_index,
            num_gpu_blocks=int(info["num_gpu_blocks"]),
            block_size=int(info["block_size"]),
            max_model_len=int(info["max_model_len"]),
            model=str(info["model"]),
            device=str(info["device"]),
            front_end_timeout_s=front_end_timeout_s,
        ))
        return frames

    def decoder(self, limits: Limits, vocab_size: int | None, max_parts: int) -> Decode:
        """ADDs decode with their token ids checked against ``vocab_size`` (the codec's
        ``checked_request_type``), which spares the busy loop that scan."""

        def decode(frames: list[Any], sock: zmq.Socket[Any] | None) -> tuple[Any, Any]:
            item: tuple[Any, Any]
            try:
                item = decode_input(frames, limits, vocab_size)
                return item
            except ProtocolError:
                # Only now is the more flag read: a payload that refers to aux frames fails
                # alone; with them it may decode. A message without more fails as is.
                if sock is None or not sock.get(ZMQ_RCVMORE):
                    raise
                recv_rest(sock, frames, max_parts)
                item = decode_input(frames, limits, vocab_size)
                return item

        return decode

    def short_call(self, limits: Limits) -> ShortCall | None:
        """The idle-call short path's predicate (``EngineInput.accept`` is the general path):
        a utility call in one frame that decodes without its aux frames, else None. None: this
        wire has no short path."""
        decode = Decoder(UtilityRequest, limits).decode_unchecked
        max_frame = 1 + limits.max_call_bytes  # the type byte, then the payload

        def short(first: bytes) -> UtilityRequest | None:
            if first[:1] != _UTILITY_BYTE or len(first) > max_frame:
                return None  # over the bound: the general path refuses it, naming the bound
            try:
                # libzmq refused any frame over max_frame_bytes, the line above one over
                # max_call_bytes, and a utility call has no post-check.
                return decode(memoryview(first)[1:])
            except Exception:
                return None  # e.g. it refers to aux frames that follow

        return short

    def rejection(self, frames: list[Any], error: ProtocolError) -> tuple[Control, Any] | None:
        """What answers a message that did not decode (logged here): a failed ADD or call for
        the loop to send in order, or None when no id can be recovered."""
        try:
            type_byte, body = split_input(frames[0])
        except ProtocolError:
            logger.warning("rejected malformed input (an empty first frame): %s", error)
            return None
        rest = [body]
        request_id = peek_request_id(rest) if type_byte == RequestType.ADD.value else None
        if type_byte == RequestType.ADD.value and request_id is not None:
            # Answered whatever its length; only the log line is shortened.
            logger.warning("rejected malformed ADD for %.80r: %.500s", request_id, error)
            # The loop answers it, in order behind the input before it: only there is it
            # known whether the id names a live request (then nothing is sent for it).
            return Control.REJECT_ADD, (request_id, f"malformed request: {error}")
        call_id = peek_call_id(rest) if type_byte == RequestType.UTILITY.value else None
        if type_byte == RequestType.UTILITY.value and call_id is not None:
            logger.warning("rejected malformed utility call %r: %s", call_id, error)
            reply = UtilityOutput(call_id=call_id, failure_message=f"malformed call: {error}")
            return Control.OUTPUTS, EngineCoreOutputs(utility_output=reply)
        logger.warning("rejected malformed input (type byte %r): %s", type_byte, error)
        return None
