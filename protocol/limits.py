"""Bounds on what a peer may send (``Limits``), checked before and after decoding.

Theory of operation
-------------------
``codec.Decoder`` applies a ``Limits`` in three steps, so that no message costs memory out of
proportion to its bytes:

1. frame count and frame size, before anything is decoded (``Decoder._check_frames``);
2. for a payload over the size that alone bounds it, the counts its msgpack array headers
   announce, read through *skeleton* Structs that skip every field they do not count
   (``screen_large_add``, ``screen_large_outputs``);
3. the counts of the decoded message (``POST_CHECKS``, by decoded type).

Rule 1: every refusal is a ``ProtocolError`` that names the bound and the count it saw.
Rule 2: a screen that cannot read its headers refuses nothing: the full decode reports what is
wrong with the message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from ..spec.errors import ProtocolError
from .messages import EngineCoreOutputs, EngineCoreRequest

__all__ = ["DEFAULT_LIMITS", "Frame", "Limits"]

# A frame as it arrives: bytes from tests, memoryviews, or zmq.Frame from recv(copy=False).
Frame = Any


class Limits(msgspec.Struct, frozen=True):
    """Bounds a decoder enforces; the payload size bounds every allocation decoding makes."""

    max_frame_bytes: int = 256 * 1024 * 1024
    max_frames: int = 64
    max_prompt_tokens: int = 1 << 20
    max_batch: int = 1 << 16
    # The msgpack payload of a utility call (its arrays travel as aux frames, bounded by
    # max_frame_bytes): its arguments are untyped, and small containers decode to some 70
    # times their wire size, so this bound is what keeps a call's memory in proportion.
    max_call_bytes: int = 1024 * 1024
    # SamplingParams.stop_token_ids (it had no bound: 64 MiB of stop ids took 0.92 GB).
    max_stop_tokens: int = 4096

    def __post_init__(self) -> None:
        # A zero or negative bound would refuse every message (or, as libzmq's MAXMSGSIZE,
        # lift the bound altogether): refused here, naming the field.
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 62:
                raise ValueError(f"Limits.{name}={value!r}: must be a positive integer")


DEFAULT_LIMITS = Limits()


def _check_request(obj: EngineCoreRequest, limits: Limits) -> None:
    n = len(obj.prompt_token_ids)
    if n > limits.max_prompt_tokens:
        raise ProtocolError(
            f"expected at most {limits.max_prompt_tokens} prompt tokens, got {n}"
            f" (request {obj.request_id!r})"
        )
    n = len(obj.sampling_params.stop_token_ids)
    if n > limits.max_stop_tokens:
        raise ProtocolError(
            f"expected at most {limits.max_stop_tokens} stop token ids, got {n}"
            f" (request {obj.request_id!r})"
        )


def _check_outputs(obj: EngineCoreOutputs, limits: Limits) -> None:
    n_stream = len(obj.stream_ids)
    if n_stream != len(obj.stream_tokens):
        raise ProtocolError(
            f"expected as many stream tokens as stream ids, got {len(obj.stream_tokens)}"
            f" tokens for {n_stream} ids"
        )
    if len(obj.outputs) + n_stream > limits.max_batch:
        raise ProtocolError(
            f"expected at most {limits.max_batch} outputs in a batch,"
            f" got {len(obj.outputs) + n_stream}"
        )
    if obj.finished_requests is not None and len(obj.finished_requests) > limits.max_batch:
        raise ProtocolError(
            f"expected at most {limits.max_batch} finished ids, got {len(obj.finished_requests)}"
        )


def _check_ids(obj: list[str], limits: Limits) -> None:
    if len(obj) > limits.max_batch:
        raise ProtocolError(f"expected at most {limits.max_batch} request ids, got {len(obj)}")


POST_CHECKS: dict[object, Callable[[Any, Limits], None]] = {
    EngineCoreRequest: _check_request,
    EngineCoreOutputs: _check_outputs,
    list[str]: _check_ids,
}


class _AddSkeleton(msgspec.Struct, array_like=True, gc=False):
    """An ADD with only its untyped field checked: ``tensors`` must map names to arrays (ext
    values); the other fields are skipped, not built."""

    request_id: msgspec.Raw
    prompt_token_ids: msgspec.Raw
    sampling_params: msgspec.Raw = msgspec.Raw(b"")
    arrival_time: msgspec.Raw = msgspec.Raw(b"")
    priority: msgspec.Raw = msgspec.Raw(b"")
    tensors: dict[str, msgspec.msgpack.Ext] | None = None


_add_skeleton = msgspec.msgpack.Decoder(_AddSkeleton)


class _SamplingSkeleton(msgspec.Struct, array_like=True, gc=False):
    """SamplingParams' fields, skipped; only the stop ids' array header is read."""

    max_tokens: msgspec.Raw = msgspec.Raw(b"")
    temperature: msgspec.Raw = msgspec.Raw(b"")
    top_p: msgspec.Raw = msgspec.Raw(b"")
    top_k: msgspec.Raw = msgspec.Raw(b"")
    seed: msgspec.Raw = msgspec.Raw(b"")
    stop_token_ids: msgspec.Raw = msgspec.Raw(b"")


_sampling_skeleton = msgspec.msgpack.Decoder(_SamplingSkeleton)


class _OutputsSkeleton(msgspec.Struct, array_like=True, gc=False):
    """EngineCoreOutputs' list fields as raw msgpack: their lengths, read from the headers."""

    engine_index: msgspec.Raw = msgspec.Raw(b"")
    outputs: msgspec.Raw = msgspec.Raw(b"")
    timestamp: msgspec.Raw = msgspec.Raw(b"")
    finished_requests: msgspec.Raw = msgspec.Raw(b"")
    scheduler_stats: msgspec.Raw = msgspec.Raw(b"")
    utility_output: msgspec.Raw = msgspec.Raw(b"")
    stream_ids: msgspec.Raw = msgspec.Raw(b"")
    stream_tokens: msgspec.Raw = msgspec.Raw(b"")


_outputs_skeleton = msgspec.msgpack.Decoder(_OutputsSkeleton)


def _array_len(raw: msgspec.Raw) -> int:
    """The element count a msgpack array header says (0 for anything else: the typed decode
    refuses a wrong type without allocating)."""
    head = bytes(memoryview(raw)[:5])
    if not head:
        return 0
    tag = head[0]
    if 0x90 <= tag <= 0x9F:
        return tag & 0x0F
    if tag == 0xDC:
        return int.from_bytes(head[1:3], "big")
    if tag == 0xDD:
        return int.from_bytes(head[1:5], "big")
    return 0


def _bound(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise ProtocolError(f"expected at most {limit} {what}, got {count} (refused from the"
                            " msgpack headers, before anything was decoded)")


def screen_large_outputs(payload: Frame, limits: Limits) -> None:
    """Before a large batch is decoded (client side): its lists' lengths, from their headers."""
    try:
        head = _outputs_skeleton.decode(payload)
    except msgspec.MsgspecError:
        return  # the full decode reports it
    except RecursionError as e:
        raise ProtocolError(f"expected EngineCoreOutputs, got msgpack nested too deeply ({e})"
                            ) from e
    _bound(_array_len(head.outputs) + _array_len(head.stream_ids), limits.max_batch,
           "outputs in a batch")
    _bound(_array_len(head.stream_tokens), limits.max_batch, "stream tokens in a batch")
    _bound(_array_len(head.finished_requests), limits.max_batch, "finished ids")


def screen_large_add(payload: Frame, limits: Limits) -> None:
    """Before a large ADD is decoded: its ``tensors`` values must be arrays. Typed ``Any``
    (they are ext values), anything else there would decode untyped, some 70 times its size
    (a 20 MB ADD of empty maps took an engine to 1.5 GB)."""
    try:
        head = _add_skeleton.decode(payload)
    except msgspec.ValidationError as e:
        raise ProtocolError(
            f"expected EngineCoreRequest.tensors to map names to arrays (a payload over"
            f" {limits.max_call_bytes} bytes is screened before it is decoded): {e}") from e
    except msgspec.DecodeError:
        return  # the full decode reports it
    except RecursionError as e:  # nested deeper than any request is: still the peer's
        raise ProtocolError(f"expected an EngineCoreRequest, got msgpack nested too deeply"
                            f" to decode ({e})") from e
    # Counts from the array headers, before any list exists (a 100 MB prompt decoded to
    # 0.86 GB, 64 MiB of stop ids to 0.92 GB, before the count was checked).
    _bound(_array_len(head.prompt_token_ids), limits.max_prompt_tokens, "prompt tokens")
    if len(head.sampling_params):
        try:
            sp = _sampling_skeleton.decode(head.sampling_params)
        except (msgspec.MsgspecError, RecursionError):
            return  # the full decode reports it
        _bound(_array_len(sp.stop_token_ids), limits.max_stop_tokens, "stop token ids")
