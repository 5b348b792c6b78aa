"""The wire codec: msgpack payload frame plus zero-copy aux frames, decoded strictly.

Theory of operation
-------------------
A message becomes ``[payload, aux_0, aux_1, ...]``. The payload is msgspec msgpack of a
Struct from ``messages``. Three msgpack *ext* types carry what plain msgpack cannot:

- ``EXT_TORCH`` (1) and ``EXT_NUMPY`` (2): ``[dtype, shape, data]`` where ``data`` is either
  the raw bytes (arrays smaller than ``size_threshold``) or an int index into the aux frames
  (the array's memory itself, never copied on either side when it is contiguous on the CPU).
- ``EXT_STRUCT`` (3): ``[name, value]`` for a utility result whose Struct class or dataclass
  was registered with ``register_result_type``; the client rebuilds it with
  ``decode_utility_result``. An unregistered dataclass is refused (msgspec would carry it as
  a dict: the caller would get another type).

Ext types are self-describing, so tensors also work inside ``Any`` fields (utility args and
results, ``EngineCoreRequest.tensors``). There is no pickle: anything else is refused when
encoding (``TypeError``), and ``utility_output`` turns that into a failure reply instead.

Rule 1: the decoders raise ``ProtocolError`` and nothing else, whatever the bytes.
Rule 2: bounds (``Limits``) are checked before decoding allocates: frame count and frame
size first (the payload size bounds every list inside it), then counts after decoding.
Rule 3: a payload buffer from ``encode_into`` is reused only after ZMQ released it: send the
payload as its own tracked frame (``send_frames``) and hand the tracker to ``BufferPool``.
pyzmq's ``send_multipart`` tracks only its *last* frame; vLLM reused buffers on that basis
and corrupted outputs under load.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar, cast

import msgspec

from ..spec.errors import ProtocolError, UtilityError
from .messages import (
    ENGINE_DEAD_SENTINEL,
    PROTOCOL_VERSION,
    AttachRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    ReadyResponse,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)

if TYPE_CHECKING:
    import numpy as np
    import torch
    import zmq

__all__ = [
    "DEFAULT_LIMITS",
    "EXT_NUMPY",
    "EXT_STRUCT",
    "EXT_TORCH",
    "BufferPool",
    "Decoder",
    "Encoder",
    "Limits",
    "StructResult",
    "backend_send",
    "check_no_dataclass",
    "check_ready",
    "decode_input",
    "decode_outputs",
    "decode_ready",
    "decode_utility_result",
    "encode_input",
    "is_dead_sentinel",
    "peek_call_id",
    "peek_request_id",
    "recv_rest",
    "register_result_type",
    "send_frames",
    "split_input",
    "utility_output",
]

T = TypeVar("T")

EXT_TORCH = 1
EXT_NUMPY = 2
EXT_STRUCT = 3

# A frame as it arrives: bytes from tests, memoryviews, or zmq.Frame from recv(copy=False).
Frame = Any

_MAX_NDIM = 64  # torch's own limit on tensor rank


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


class _ArrayHeader(msgspec.Struct, array_like=True, frozen=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes | int  # inline bytes, or the index of an aux frame


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_ArrayHeader)

# torch dtypes that may cross the wire, by name without the "torch." prefix.
_TORCH_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip
_torch_dtypes: dict[str, Any] | None = None


def _torch_dtype_map() -> dict[str, Any]:
    global _torch_dtypes
    if _torch_dtypes is None:
        import torch

        found = {n: getattr(torch, n, None) for n in _TORCH_DTYPE_NAMES}
        _torch_dtypes = {n: d for n, d in found.items() if isinstance(d, torch.dtype)}
    return _torch_dtypes


def _is_tensor(obj: object) -> bool:
    # torch is imported lazily: if nobody imported it, obj cannot be a tensor.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _torch_dtype_ok(t: torch.Tensor) -> str:
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in _torch_dtype_map():
        raise TypeError(f"cannot encode a torch tensor of dtype {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"cannot encode a torch tensor with layout {t.layout}")
    return name


def _tensor_bytes(t: torch.Tensor) -> tuple[str, list[int], memoryview]:
    """The tensor's own memory as a flat byte view (copies only if it must)."""
    import torch

    name = _torch_dtype_ok(t)
    shape = list(t.shape)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # device tensors need a D2H copy; there is no way around it here
    t = t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        # No bytes; and an empty tensor may report stride 0, which a byte view refuses.
        return name, shape, memoryview(b"")
    if not t.is_contiguous():
        t = t.contiguous()
    # numpy() on a uint8 view shares memory, and the array keeps the tensor alive.
    flat = t.reshape(-1).view(torch.uint8).numpy()
    return name, shape, memoryview(flat)  # type: ignore[arg-type]


def _numpy_dtype_ok(dt: np.dtype[Any]) -> np.dtype[Any]:
    if dt.hasobject or dt.kind == "V" or dt.itemsize == 0:
        raise TypeError(f"cannot encode a numpy array of dtype {dt} (no pickle on the wire)")
    return dt


def _numpy_bytes(arr: np.ndarray[Any, Any]) -> tuple[str, list[int], memoryview]:
    import numpy as np

    dt = _numpy_dtype_ok(arr.dtype)
    shape = list(arr.shape)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return dt.str, shape, memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class _TypedStruct:
    """Marks a registered Struct so the encoder tags it with its registered name."""

    __slots__ = ("name", "original", "value")

    def __init__(self, name: str, value: Any, original: Any = None) -> None:
        self.name = name
        self.value = value  # what goes on the wire (a dataclass's fields, each tagged)
        self.original = value if original is None else original


class StructResult(msgspec.Struct, frozen=True):
    """A tagged Struct as decoded, before ``decode_utility_result`` rebuilds it."""

    name: str
    raw: Any


_result_types: dict[str, type[Any]] = {}
_result_names: dict[type[Any], str] = {}


def _is_dataclass_instance(value: object) -> bool:
    return hasattr(type(value), "__dataclass_fields__") and not isinstance(value, type)


def register_result_type(cls: type[Any], name: str | None = None) -> None:
    """Let utility results of type ``cls`` (a msgspec Struct or a dataclass) travel typed;
    both peers must register it."""
    is_struct = isinstance(cls, type) and issubclass(cls, msgspec.Struct)
    if not (is_struct or (isinstance(cls, type) and hasattr(cls, "__dataclass_fields__"))):
        raise TypeError("register_result_type expects a msgspec.Struct subclass or a"
                        f" dataclass, got {cls!r}")
    key = name or f"{cls.__module__}.{cls.__qualname__}"
    known = _result_types.get(key)
    if known is not None and known is not cls:
        raise ValueError(f"result type name {key!r} is already registered to {known!r}")
    _result_types[key] = cls
    _result_names[cls] = key


def _unregistered(value: object) -> TypeError:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return TypeError(f"a dataclass of type {kind} is not registered: call"
                     " register_result_type on both peers (msgspec would carry it as a"
                     " plain dict)")


def _out_of_range(e: OverflowError) -> ValueError:
    return ValueError(f"cannot encode: an integer is outside the wire's 64-bit range ({e})")


class Encoder:
    """msgpack encoder with zero-copy aux frames. One per thread: it is not thread-safe.

    ``encode`` raises ``TypeError`` for a value it cannot put on the wire (it never pickles)
    and ``ValueError`` for an integer outside msgpack's 64-bit range.
    """

    def __init__(self, size_threshold: int = 256) -> None:
        self.size_threshold = size_threshold
        self._aux: list[memoryview] | None = None
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, obj: object) -> list[bytes | memoryview]:
        """``[payload, aux...]``; aux frames are views of the arrays' memory, not copies."""
        self._aux = None
        try:
            payload = self._enc.encode(obj)
        except OverflowError as e:
            raise _out_of_range(e) from e
        aux = self._aux
        if aux is None:
            return [payload]
        self._aux = None
        return [payload, *aux]

    def encode_into(self, obj: object, buf: bytearray) -> list[bytes | memoryview | bytearray]:
        """Like ``encode`` but the payload is written into ``buf`` (resized to fit).

        Reuse ``buf`` only after ZMQ released it (see ``BufferPool`` and ``send_frames``).
        """
        self._aux = None
        try:
            self._enc.encode_into(obj, buf)
        except OverflowError as e:
            raise _out_of_range(e) from e
        aux = self._aux
        if aux is None:
            return [buf]
        self._aux = None
        return [buf, *aux]

    def _array_ext(self, code: int, dtype: str, shape: list[int], data: memoryview) -> Any:
        if data.nbytes >= self.size_threshold:
            if self._aux is None:
                self._aux = []
            index = len(self._aux)
            self._aux.append(data)
            header = _ArrayHeader(dtype, shape, index)
        else:
            header = _ArrayHeader(dtype, shape, data.tobytes())
        return msgspec.msgpack.Ext(code, _header_encoder.encode(header))

    def _numpy_ext(self, arr: np.ndarray[Any, Any]) -> Any:
        return self._array_ext(EXT_NUMPY, *_numpy_bytes(arr))

    def _torch_ext(self, t: torch.Tensor) -> Any:
        return self._array_ext(EXT_TORCH, *_tensor_bytes(t))

    def _enc_hook(self, obj: object) -> Any:
        # numpy is imported lazily (an engine without arrays starts ~0.1 s sooner): an object
        # can only be an array if numpy is already loaded.
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray):
                return self._numpy_ext(obj)
            if isinstance(obj, np.generic):
                return self._numpy_ext(np.asarray(obj))
        if _is_tensor(obj):
            return self._torch_ext(cast("torch.Tensor", obj))
        if isinstance(obj, _TypedStruct):
            # Same hook: tensors inside the Struct still become aux frames of this message.
            return msgspec.msgpack.Ext(EXT_STRUCT, self._enc.encode([obj.name, obj.value]))
        raise TypeError(
            f"cannot encode an object of type {type(obj).__module__}.{type(obj).__qualname__}"
            " (supported: msgspec-encodable values, registered Structs, torch tensors,"
            " numpy arrays; never pickle)"
        )


def _nbytes(frame: Frame) -> int:
    if type(frame) is memoryview:
        return frame.nbytes
    return len(frame)


def _as_bytes_view(frame: Frame) -> memoryview:
    view = memoryview(frame)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _type_name(type_: object) -> str:
    # list[str] has a __name__ of "list"; its repr says what was expected.
    return type_.__name__ if isinstance(type_, type) else repr(type_)


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


_POST_CHECKS: dict[object, Callable[[Any, Limits], None]] = {
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


def _screen_large_outputs(payload: Frame, limits: Limits) -> None:
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


def _screen_large_add(payload: Frame, limits: Limits) -> None:
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


class Decoder(Generic[T]):
    """Typed, strict decoder of ``[payload, aux...]``. One per thread: not thread-safe.

    ``decode`` returns a ``type_`` or raises ``ProtocolError``, never anything else.
    Aux-frame arrays share the frame's memory (zero-copy; they keep the frame alive);
    inline ones are copies that own their memory.
    """

    def __init__(self, type_: type[T], limits: Limits = DEFAULT_LIMITS) -> None:
        self.type = type_
        self.limits = limits
        self._name = _type_name(type_)
        # The largest first frame taken without a closer look: a utility call's untyped
        # payload has a bound of its own (``Limits.max_call_bytes``).
        self._max_payload = self._max_frame_bytes = limits.max_frame_bytes
        if type_ is UtilityRequest or type_ is EngineCoreRequest:
            # A call's payload is refused past this; an ADD's is screened (_screen_large_add).
            self._max_payload = min(limits.max_call_bytes, limits.max_frame_bytes)
        self._aux: Sequence[Frame] = ()
        self._too_long: str | None = None  # what a too-long top-level array is refused as
        decoded: Any = type_
        if type_ == list[str]:
            # An ABORT's ids: msgspec refuses a longer array from its header, before one id
            # exists (64 MiB of 2-character ids decoded to 1.6 GB, then failed the count).
            decoded = Annotated[list[str], msgspec.Meta(max_length=limits.max_batch)]
            self._too_long = f"expected at most {limits.max_batch} request ids"
        self._dec: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(
            decoded, ext_hook=self._ext_hook
        )
        if type_ is EngineCoreOutputs:
            # Batches under this size cannot hold more than max_batch of anything.
            self._max_payload = min(self._max_payload, limits.max_batch)
        self._check = _POST_CHECKS.get(type_)
        self._any_dec: msgspec.msgpack.Decoder[Any] | None = None
        # msgspec's own decode of one payload frame: the type is checked, not the size bound
        # or the post-check (``decode_payload`` applies both). For a round trip's hot path
        # whose caller bounds the size and checks what it uses.
        self.decode_unchecked = self._dec.decode

    def decode(self, frames: Sequence[Frame] | bytes | bytearray | memoryview) -> T:
        seq: Sequence[Frame] = (
            frames
            if type(frames) is list or not isinstance(frames, (bytes, bytearray, memoryview))
            else (frames,)
        )
        try:
            if len(seq) == 1:  # the common case, kept cheap: one payload frame, no aux
                payload = seq[0]
                size = payload.nbytes if type(payload) is memoryview else len(payload)
                if size > self._max_payload:
                    self._check_frames(seq)
            else:
                self._check_frames(seq)
        except TypeError as e:
            raise ProtocolError(f"expected a sequence of bytes-like frames: {e}") from e
        self._aux = seq
        try:
            obj = self._dec.decode(seq[0])
        except ProtocolError:
            raise
        except msgspec.ValidationError as e:
            if self._too_long is not None and "of length <=" in str(e):
                raise ProtocolError(f"{self._too_long} (refused from the array header: {e})"
                                    ) from e
            raise ProtocolError(f"expected a valid {self._name}: {e}") from e
        except msgspec.DecodeError as e:
            raise ProtocolError(f"expected msgpack of a {self._name}: {e}") from e
        except Exception as e:  # RecursionError, MemoryError, a hook's bug: still the peer's
            raise ProtocolError(f"expected a valid {self._name}: {type(e).__name__}: {e}") from e
        finally:
            self._aux = ()
        if self._check is not None:
            self._check(obj, self.limits)
        return obj

    def decode_payload(self, payload: bytes | memoryview) -> T:
        """``decode`` of a message that is one payload frame: the same checks and errors, in
        fewer steps (round-trip paths call it once per message)."""
        size = payload.nbytes if type(payload) is memoryview else len(payload)
        if size > self._max_payload:
            return self.decode([payload])
        try:
            obj = self._dec.decode(payload)
        except Exception:
            return self.decode([payload])  # the full path raises the right ProtocolError
        if self._check is not None:
            self._check(obj, self.limits)
        return obj

    def _check_frames(self, seq: Sequence[Frame]) -> None:
        limits = self.limits
        n = len(seq)
        if n == 0:
            raise ProtocolError(f"expected a {self._name} payload frame, got no frames")
        if n > limits.max_frames:
            raise ProtocolError(f"expected at most {limits.max_frames} frames, got {n}")
        for i, frame in enumerate(seq):
            size = _nbytes(frame)
            if size > limits.max_frame_bytes:
                raise ProtocolError(
                    f"expected frames of at most {limits.max_frame_bytes} bytes,"
                    f" frame {i} has {size}"
                )
        if _nbytes(seq[0]) > self._max_payload:
            if self.type is EngineCoreRequest:
                _screen_large_add(seq[0], limits)
                return
            if self.type is EngineCoreOutputs:
                _screen_large_outputs(seq[0], limits)
                return
            raise ProtocolError(
                f"expected a utility call payload of at most {limits.max_call_bytes} bytes"
                f" (max_call_bytes; arrays travel as aux frames), got {_nbytes(seq[0])}")

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_TORCH or code == EXT_NUMPY:
            try:
                header = _header_decoder.decode(data)
            except msgspec.MsgspecError as e:
                raise ProtocolError(f"expected an array header [dtype, shape, data]: {e}") from e
            if code == EXT_TORCH:
                return self._torch(header)
            return self._numpy(header)
        if code == EXT_STRUCT:
            value = self._untyped().decode(data)
            if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str):
                raise ProtocolError("expected a tagged Struct [name, value]")
            return StructResult(value[0], value[1])
        raise ProtocolError(
            f"unknown msgpack ext type {code}; expected {EXT_TORCH} (torch),"
            f" {EXT_NUMPY} (numpy) or {EXT_STRUCT} (registered Struct)"
        )

    def _untyped(self) -> msgspec.msgpack.Decoder[Any]:
        dec = self._any_dec
        if dec is None:
            dec = self._any_dec = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        return dec

    def _buffer(self, header: _ArrayHeader, itemsize: int) -> memoryview | bytes:
        shape = header.shape
        if len(shape) > _MAX_NDIM or any(d < 0 for d in shape):
            raise ProtocolError(
                f"expected an array shape of <= {_MAX_NDIM} sizes >= 0, got {shape}"
            )
        count = 1
        for d in shape:
            count *= d
        if isinstance(header.data, int):
            index = header.data
            if not 0 <= index < len(self._aux) - 1:
                raise ProtocolError(
                    f"expected an aux frame index below {len(self._aux) - 1} (the message's"
                    f" aux frame count), got aux frame {index}"
                )
            buf: memoryview | bytes = _as_bytes_view(self._aux[index + 1])
        else:
            buf = header.data
        if len(buf) != count * itemsize:
            raise ProtocolError(
                f"expected {count * itemsize} bytes for an array of shape {shape}, got {len(buf)}"
            )
        return buf

    def _torch(self, header: _ArrayHeader) -> Any:
        dtype = _torch_dtype_map().get(header.dtype)
        if dtype is None:
            raise ProtocolError(f"expected a torch dtype name, got {header.dtype!r}")
        import torch

        buf = self._buffer(header, dtype.itemsize)
        if len(buf) == 0:
            return torch.empty(header.shape, dtype=dtype)
        if isinstance(buf, bytes):  # inline: copy into memory the tensor owns
            raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        else:  # aux frame: share it; the tensor keeps the frame alive
            raw = torch.frombuffer(buf, dtype=torch.uint8)
        if dtype is torch.bool and int(raw.max()) > 1:
            raise _bad_bool()
        return raw.view(dtype).reshape(header.shape)

    def _numpy(self, header: _ArrayHeader) -> Any:
        import numpy as np

        dtype = _numpy_dtype(header.dtype)
        buf = self._buffer(header, dtype.itemsize)
        arr = np.frombuffer(buf, dtype=dtype).reshape(header.shape)
        if dtype.kind == "b" and arr.size and int(arr.view(np.uint8).max()) > 1:
            raise _bad_bool()
        return arr.copy() if isinstance(buf, bytes) else arr


def _bad_bool() -> ProtocolError:
    # Any other byte is a bool neither library defines (numpy and torch read it differently).
    return ProtocolError("expected bool array bytes of 0 or 1")


# What ``dtype.str`` produces for plain dtypes: byte order, kind, item size, datetime unit.
_NUMPY_DTYPE_RE = re.compile(r"[<>|][biufcSUmM][0-9]{1,4}(\[[0-9]*[a-zA-Z]{1,2}\])?")
_numpy_dtypes: dict[str, np.dtype[Any]] = {}


def _numpy_dtype(text: str) -> np.dtype[Any]:
    dtype = _numpy_dtypes.get(text)
    if dtype is not None:
        return dtype
    if not _NUMPY_DTYPE_RE.fullmatch(text):
        raise ProtocolError(f"expected a plain numpy dtype string like '<f4', got {text!r}")
    import numpy as np

    try:
        dtype = np.dtype(text)
    except Exception as e:
        raise ProtocolError(f"expected a numpy dtype string like '<f4', got {text!r}") from e
    if dtype.str != text or dtype.itemsize == 0:
        raise ProtocolError(f"expected a canonical numpy dtype string, got {text!r}")
    if len(_numpy_dtypes) < 256:  # bounded: the peer picks the strings
        _numpy_dtypes[text] = dtype
    return dtype


# Per-thread decoders for the module-level helpers (a Decoder is not thread-safe).
_local = threading.local()


def _decoder(type_: Any, limits: Limits) -> Decoder[Any]:
    try:
        cache: dict[tuple[Any, int], tuple[Limits, Decoder[Any]]] = _local.decoders
    except AttributeError:
        cache = _local.decoders = {}
    # Keyed by the limits' identity: hashing the Struct on every message costs more than the
    # decode of a small one. The entry keeps its limits alive, so the id cannot be reused.
    key = (type_, id(limits))
    entry = cache.get(key)
    if entry is None or entry[0] is not limits:
        entry = cache[key] = (limits, Decoder(type_, limits))
    return entry[1]


_INPUT_TYPES: dict[bytes, tuple[RequestType, Any]] = {
    RequestType.ADD.value: (RequestType.ADD, EngineCoreRequest),
    RequestType.ABORT.value: (RequestType.ABORT, list[str]),
    RequestType.UTILITY.value: (RequestType.UTILITY, UtilityRequest),
    RequestType.ATTACH.value: (RequestType.ATTACH, AttachRequest),
}


def _frame_bytes(frame: Frame) -> bytes:
    if isinstance(frame, bytes):
        return frame
    return bytes(memoryview(frame))


def split_input(first: Frame) -> tuple[bytes, memoryview]:
    """A client message's first frame as ``(type byte, payload)``; the payload is a view of
    the frame, not a copy. ``ProtocolError`` if it is not a bytes-like frame or is empty."""
    try:
        view = first if type(first) is memoryview else memoryview(first)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"expected a bytes-like first frame, got {type(first)!r}") from e
    if not view.nbytes:
        raise ProtocolError("expected a request-type byte and a payload, got an empty frame")
    return bytes(view[:1]), view[1:]


def decode_input(
    frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS
) -> tuple[RequestType, EngineCoreRequest | list[str] | UtilityRequest | AttachRequest]:
    """Engine side: ``[type byte + payload, aux...]`` (the engine DEALER's view of a
    message), or ``ProtocolError``."""
    if not frames:
        raise ProtocolError("expected a request message, got no frames")
    type_byte, payload = split_input(frames[0])
    entry = _INPUT_TYPES.get(type_byte)
    if entry is None:
        raise ProtocolError(
            "expected a request-type byte 0x00 (ADD), 0x01 (ABORT), 0x03 (UTILITY) or"
            f" 0x04 (ATTACH), got {type_byte!r}"
        )
    kind, type_ = entry
    return kind, _decoder(type_, limits).decode([payload, *frames[1:]])


def decode_outputs(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> EngineCoreOutputs:
    """Client side: one ``EngineCoreOutputs`` or ``ProtocolError`` (check the sentinel first)."""
    try:
        out: EngineCoreOutputs = _decoder(EngineCoreOutputs, limits).decode(frames)
    except ProtocolError:
        if is_dead_sentinel(frames):
            raise ProtocolError(
                "expected EngineCoreOutputs, got the engine-dead sentinel"
            ) from None
        raise
    return out


def check_sendable(kind: RequestType, frames: Sequence[Frame],
                   limits: Limits = DEFAULT_LIMITS) -> None:
    """Sender side: ``ValueError`` naming the bound if the engine would refuse ``frames`` (a
    client message from ``encode_input``) for its size: better refused here than as a
    dropped connection or a rejected message on the other side."""
    for frame in frames:
        size = _nbytes(frame)
        if size > limits.max_frame_bytes:
            raise ValueError(f"a message frame of {size} bytes exceeds the engine's"
                             f" max_frame_bytes={limits.max_frame_bytes} (engine_limits)")
    if kind is RequestType.UTILITY and frames and _nbytes(frames[0]) - 1 > limits.max_call_bytes:
        raise ValueError(
            f"a utility call's payload of {_nbytes(frames[0]) - 1} bytes exceeds the engine's"
            f" max_call_bytes={limits.max_call_bytes} (engine_limits); send large data as"
            " numpy arrays or torch tensors, which travel as frames of their own")


def encode_input(encoder: Encoder, kind: RequestType, obj: object) -> list[bytes | memoryview]:
    """``[type byte + payload, aux...]`` for the client's send (identity is the socket's)."""
    frames = encoder.encode(obj)
    frames[0] = kind.value + frames[0]
    return frames


def is_dead_sentinel(frames: Sequence[Frame] | bytes) -> bool:
    if isinstance(frames, bytes):
        return frames == ENGINE_DEAD_SENTINEL
    try:
        if len(frames) != 1:
            return False
        frame = frames[0]
    except (TypeError, LookupError):  # not a sequence of frames: not the sentinel either
        return False
    if type(frame) is bytes:  # what a plain receive hands over
        return frame == ENGINE_DEAD_SENTINEL
    try:
        return _nbytes(frame) == len(ENGINE_DEAD_SENTINEL) and (
            _frame_bytes(frame) == ENGINE_DEAD_SENTINEL
        )
    except Exception:
        return False


class _AddHead(msgspec.Struct, array_like=True, gc=False):
    request_id: str


class _CallHead(msgspec.Struct, array_like=True, gc=False):
    client_index: msgspec.Raw  # whatever it is, not decoded
    call_id: int


# Typed to their first fields: msgspec skips the rest of the array without building it, so a
# refused message (malformed, or over a bound) is never decoded whole. An untyped decode of a
# 20 MB frame of empty maps took an engine to 1.5 GB.
class _ReadyHead(msgspec.Struct, array_like=True, gc=False):
    protocol_version: int


_add_head = msgspec.msgpack.Decoder(_AddHead)
_ready_head = msgspec.msgpack.Decoder(_ReadyHead)
_call_head = msgspec.msgpack.Decoder(_CallHead)


def peek_request_id(frames: Sequence[Frame]) -> str | None:
    """Best-effort request id of an ADD that failed to decode, to fail just that request.

    Any id the typed peek reads is returned, however long: the frame holding it is already
    bounded (libzmq's max message size, ``Limits``), and a request whose id went unanswered
    would stay live at its client forever. Callers shorten it for log lines themselves."""
    try:
        return _add_head.decode(frames[0]).request_id
    except RecursionError:  # a well-formed head, and the rest nested past what decodes
        try:
            return _first_str_of_array(frames[0])
        except Exception:
            return None
    except Exception:
        return None


def _first_str_of_array(frame: Frame) -> str | None:
    """The first element of a msgpack array when it is a str, read from the headers alone
    (a decode would walk the whole payload first: a deeply nested prompt then raised
    RecursionError and cost the request its ERROR output); None for any other shape."""
    buf = memoryview(frame).cast("B") if not isinstance(frame, bytes) else frame
    if not buf:
        return None
    tag, at = buf[0], 1
    if 0x90 <= tag <= 0x9F:
        pass
    elif tag == 0xDC:
        at = 3
    elif tag == 0xDD:
        at = 5
    else:
        return None
    if len(buf) <= at:
        return None
    tag = buf[at]
    if 0xA0 <= tag <= 0xBF:
        start, size = at + 1, tag & 0x1F
    elif tag in (0xD9, 0xDA, 0xDB):
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4}[tag]
        start = at + 1 + width
        size = int.from_bytes(bytes(buf[at + 1:start]), "big")
    else:
        return None
    if len(buf) < start + size:
        return None
    return bytes(buf[start:start + size]).decode("utf-8")


def peek_call_id(frames: Sequence[Frame]) -> int | None:
    """Best-effort call id of a utility call that failed to decode, to answer its caller."""
    try:
        head = _call_head.decode(frames[0])
    except Exception:
        return None
    return head.call_id if not isinstance(head.call_id, bool) else None


def decode_ready(frames: Sequence[Frame] | bytes) -> ReadyResponse:
    """Decode a ready response, refusing another protocol version by name (``check_ready``).

    The version is read before the typed decode, so a peer whose ReadyResponse changed
    shape still gets the version error, not a field error.
    """
    try:
        payload: Frame = frames if isinstance(frames, bytes) else frames[0]
    except (TypeError, LookupError) as e:
        raise ProtocolError(f"expected a ready response frame, got {frames!r:.80}") from e
    try:  # the version alone: the rest is skipped, not built (an engine peer is bounded too)
        version: int | None = _ready_head.decode(payload).protocol_version
    except Exception:
        version = None
    if isinstance(version, int) and version != PROTOCOL_VERSION:
        raise ProtocolError(_version_message(version))
    resp: ReadyResponse = _decoder(ReadyResponse, DEFAULT_LIMITS).decode(
        (payload,) if isinstance(frames, bytes) else frames
    )
    check_ready(resp)
    return resp


def _version_message(theirs: object) -> str:
    return (
        f"engine speaks enginewire protocol version {theirs}, this client speaks"
        f" version {PROTOCOL_VERSION}; run the same enginewire version on both sides"
    )


def check_ready(resp: ReadyResponse) -> None:
    """Raise ``ProtocolError`` naming both versions if the peer speaks another protocol."""
    if resp.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(_version_message(resp.protocol_version))


# --- utility results ---------------------------------------------------------------------


def _wrap_typed(value: Any) -> Any:
    """Tag registered Structs and dataclasses (at top level and inside lists, tuples, dicts
    and a dataclass's fields); an unregistered dataclass is a ``TypeError``: msgspec would
    carry it as a dict, and the caller would get another type than the one returned."""
    cls = type(value)
    if cls in _SCALAR_TYPES:
        return value
    name = _result_names.get(cls)
    if name is not None:
        if hasattr(cls, "__dataclass_fields__"):
            # Its fields as a map, each wrapped: a registered dataclass inside survives.
            return _TypedStruct(name, {f: _wrap_typed(getattr(value, f))
                                       for f in cls.__dataclass_fields__}, value)
        return _TypedStruct(name, value)
    if cls is list or cls is tuple:
        if _SCALAR_TYPES.issuperset(map(type, value)):  # one C-level pass for a flat list
            return value
        return [_wrap_typed(v) for v in value]
    if cls is dict:
        if _SCALAR_TYPES.issuperset(map(type, value.values())):
            return value
        return {k: _wrap_typed(v) for k, v in value.items()}
    if _is_dataclass_instance(value):
        raise _unregistered(value)
    return value


def check_no_dataclass(value: Any) -> None:
    """``TypeError`` if a dataclass hides in ``value`` (a utility argument): the engine
    decodes arguments untyped, so it would get a dict in its place."""
    cls = type(value)
    if cls in _SCALAR_TYPES:
        return
    if cls is list or cls is tuple:
        if not _SCALAR_TYPES.issuperset(map(type, value)):
            for v in value:
                check_no_dataclass(v)
    elif cls is dict:
        if not _SCALAR_TYPES.issuperset(map(type, value.values())):
            for v in value.values():
                check_no_dataclass(v)
    elif _is_dataclass_instance(value):
        kind = f"{cls.__module__}.{cls.__qualname__}"
        raise TypeError(f"cannot send a dataclass of type {kind} as a utility argument (the"
                        " engine would get a plain dict); pass its fields")


class _ProbeEncoder(Encoder):
    """Checks encodability without touching array data (a 64 MiB result is not copied)."""

    def _numpy_ext(self, arr: np.ndarray[Any, Any]) -> Any:
        _numpy_dtype_ok(arr.dtype)
        return None

    def _torch_ext(self, t: torch.Tensor) -> Any:
        _torch_dtype_ok(t)
        return None


# Results of these types always encode (an int may not: msgpack stops at 64 bits; a str
# may not: a lone surrogate has no UTF-8 form).
_ALWAYS_ENCODABLE = frozenset({type(None), bool, float, bytes})
# Results msgpack carries as themselves: nothing to tag on the way out or rebuild on the way in
# (the round-trip paths on both sides skip those passes; an int or str may still not encode).
_PLAIN_RESULTS = frozenset({*_ALWAYS_ENCODABLE, int, str})


def _probe() -> _ProbeEncoder:
    probe: _ProbeEncoder | None = getattr(_local, "probe", None)
    if probe is None:
        probe = _local.probe = _ProbeEncoder()
    return probe


def utility_output(
    call_id: int,
    method: str,
    *,
    result: object = None,
    error: BaseException | str | None = None,
) -> UtilityOutput:
    """The reply to a utility call. Never raises: an unsendable result becomes a failure."""
    try:
        if error is not None:
            if isinstance(error, str):
                message = error
            elif isinstance(error, UtilityError):  # already says the call failed: not twice
                message = error.remote_message
            else:
                message = f"{type(error).__name__}: {error}"
            return UtilityOutput(call_id, failure_message=message)
        if type(result) in _ALWAYS_ENCODABLE:  # echo, flags, paths: no trial encode
            return UtilityOutput(call_id, result=result)
        wrapped = _wrap_typed(result)
        _probe().encode(wrapped)
        return UtilityOutput(call_id, result=wrapped)
    except Exception as e:
        kind = f"{type(result).__module__}.{type(result).__qualname__}"
        return UtilityOutput(
            call_id,
            failure_message=f"result of {method!r} (type {kind}) cannot be sent: {e}",
        )


def _convert_hook(type_: type[Any], obj: Any) -> Any:
    # Struct fields typed as tensors/arrays: the ext hook already rebuilt them.
    if isinstance(obj, type_):
        return obj
    raise TypeError(f"expected {type_!r}, got {type(obj)!r}")


def decode_utility_result(value: object) -> object:
    """Client side: rebuild registered Structs in a decoded result; ``ProtocolError`` if unknown."""
    if isinstance(value, _TypedStruct):  # an in-process reply that never crossed the wire
        return value.original
    if isinstance(value, StructResult):
        cls = _result_types.get(value.name)
        if cls is None:
            raise ProtocolError(
                f"expected a registered result type, got {value.name!r};"
                " call register_result_type on the client too"
            )
        try:
            return msgspec.convert(decode_utility_result(value.raw), cls, dec_hook=_convert_hook)
        except msgspec.ValidationError as e:
            raise ProtocolError(f"expected a valid {value.name}: {e}") from e
    if isinstance(value, list):
        # A list of scalars (a big result's common shape) is checked in one C-level pass:
        # walked element by element, 100k of them held an event loop for ~0.2 s.
        if _SCALAR_TYPES.issuperset(map(type, value)):
            return value
        return [decode_utility_result(v) for v in value]
    if isinstance(value, dict):
        if _SCALAR_TYPES.issuperset(map(type, value.values())):
            return value
        return {k: decode_utility_result(v) for k, v in value.items()}
    return value


# What decodes to itself: no registered Struct can hide inside.
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str, bytes})


# --- sending with buffer reuse -----------------------------------------------------------


class BufferPool:
    """Payload buffers for ``Encoder.encode_into``, handed out again only once ZMQ is done.

    ``release(buf, tracker)`` parks a buffer until ``tracker.done``; pyzmq copies frames below
    its copy threshold (64 KiB) and returns an already-done tracker, so small payloads come
    back at once and large zero-copy ones only when libzmq freed the message.
    """

    def __init__(self, max_free: int = 8) -> None:
        self.max_free = max_free
        self._free: list[bytearray] = []
        self._pending: deque[tuple[bytearray, zmq.MessageTracker]] = deque()

    def acquire(self) -> bytearray:
        self._reclaim()
        if self._free:
            return self._free.pop()
        return bytearray()

    def release(self, buf: bytearray, tracker: zmq.MessageTracker | None) -> None:
        if tracker is None or tracker.done:
            self._keep(buf)
        else:
            self._pending.append((buf, tracker))

    @property
    def pending(self) -> int:
        """Buffers ZMQ may still be reading."""
        return len(self._pending)

    @property
    def free(self) -> int:
        return len(self._free)

    def _keep(self, buf: bytearray) -> None:
        if len(self._free) < self.max_free:
            self._free.append(buf)

    def _reclaim(self) -> None:
        pending = self._pending
        for _ in range(len(pending)):
            buf, tracker = pending.popleft()
            if tracker.done:
                self._keep(buf)
            else:
                pending.append((buf, tracker))


# libzmq's flag and option numbers (part of its ABI; a test holds them equal to pyzmq's), for
# every per-message path (here, the clients, the engine). Plain ints: this module does not
# import zmq at load (an import statement per send cost about a microsecond), and pyzmq's
# constants are enums whose every use in a flag test builds a new member (about 1 µs).
ZMQ_NOBLOCK = 1
ZMQ_SNDMORE = 2
ZMQ_POLLIN = 1
ZMQ_RCVMORE = 13

_BACKEND_SEND: dict[type, Callable[..., Any]] = {}


def backend_send(cls: type) -> Callable[..., Any]:
    """``cls.send`` minus pyzmq's Python-level wrapper, called as ``send(sock, data, flags)``.

    ``zmq.Socket.send`` is a Python method that handles the draft ``routing_id``/``group``
    arguments (unused here) and then calls the compiled backend's ``send``: taking the
    backend's directly saves a Python frame per message part (0.7 µs warm, several cold on a
    round trip). The most basic class defining ``send`` is that backend."""
    fn = _BACKEND_SEND.get(cls)
    if fn is None:
        fn = next(vars(k)["send"] for k in reversed(cls.__mro__) if "send" in vars(k))
        _BACKEND_SEND[cls] = fn
    return fn


def send_frames(
    sock: zmq.Socket[Any],
    frames: Sequence[Any],
    *,
    prefix: Sequence[bytes] = (),
    track: bool = False,
    flags: int = 0,
) -> zmq.MessageTracker | None:
    """Send ``[*prefix, payload, aux...]``; with ``track``, return the *payload's* tracker.
    ``flags`` (e.g. ``ZMQ_NOBLOCK``) apply to the first frame sent, which decides for the
    whole message.

    Frames below the socket's ``copy_threshold`` are copied (a plain ``send`` costs a fraction
    of a tracked zero-copy one, and the buffer is free again at once: the tracker is then
    None). Larger frames go zero-copy (pyzmq keeps an aux array alive until libzmq is done).
    """
    more = ZMQ_SNDMORE
    send = backend_send(type(sock))
    first = flags
    for p in prefix:
        send(sock, p, more | first)
        first = 0
    threshold = sock.copy_threshold
    last = len(frames) - 1
    tracker: zmq.MessageTracker | None = None
    for i, frame in enumerate(frames):
        f = (more if i < last else 0) | first
        first = 0
        if _nbytes(frame) < threshold:
            send(sock, frame, f)
        elif i == 0 and track:
            tracker = send(sock, frame, f, copy=False, track=True)
        else:
            send(sock, frame, f, copy=False)
    return tracker


def recv_rest(sock: zmq.Socket[Any], frames: list[Any],
              max_frames: int | None = None) -> list[Any]:
    """Append the rest of a message whose first part was received and said more follows
    (zero-copy; the parts of a message arrive together, so this never waits).

    With ``max_frames``, parts past that count are read one by one and released as they are
    read, never held together, and the message is refused (``ProtocolError``) once it is
    all read, so the socket stays in step. (libzmq delivers a multi-part message only once
    every part has arrived: what it holds until then is bounded by ``ZMQ_MAXMSGSIZE`` per
    part only; docs/security.md.)"""
    recv = sock.recv
    while True:
        frame = recv(0, copy=False)
        if max_frames is None or len(frames) < max_frames:
            frames.append(frame)
        else:
            extra = 1
            while frame.more:
                frame = recv(0, copy=False)  # the previous part is released here
                extra += 1
            raise ProtocolError(f"expected at most {max_frames} frames in a message, got"
                                f" {len(frames) + extra} (the rest were read and dropped)")
        if not frame.more:
            return frames
