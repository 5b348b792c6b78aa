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
Rule 3: this package does no I/O. It turns values into frames and frames into values;
sending and receiving them, and reusing a payload buffer only once the transport is done with
it, is ``runtime/zmq_io.py``'s.

This module holds ``Encoder``, ``Decoder`` and the message-level helpers built on them. What
they apply lives beside it: ``arrays.py`` (the array ext types), ``results.py`` (typed utility
results), ``limits.py`` (``Limits`` and its checks). Their public names are importable from
here as well.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from threading import local
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar, cast

import msgspec

from ..spec.errors import ProtocolError, UtilityError
from .arrays import (
    EXT_NUMPY,
    EXT_TORCH,
    MAX_NDIM,
    ArrayHeader,
    bad_bool,
    header_decoder,
    header_encoder,
    is_tensor,
    numpy_bytes,
    numpy_dtype,
    numpy_dtype_ok,
    tensor_bytes,
    torch_dtype_map,
    torch_dtype_ok,
)
from .limits import (
    DEFAULT_LIMITS,
    POST_CHECKS,
    Frame,
    Limits,
    screen_large_add,
    screen_large_outputs,
)
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
from .results import (
    ALWAYS_ENCODABLE,
    EXT_STRUCT,
    StructResult,
    TypedStruct,
    check_no_dataclass,
    decode_utility_result,
    register_result_type,
    wrap_typed,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "DEFAULT_LIMITS",
    "EXT_NUMPY",
    "EXT_STRUCT",
    "EXT_TORCH",
    "Decoder",
    "Encoder",
    "Limits",
    "StructResult",
    "check_no_dataclass",
    "check_ready",
    "checked_request_type",
    "decode_input",
    "decode_outputs",
    "decode_ready",
    "decode_utility_result",
    "encode_input",
    "is_dead_sentinel",
    "peek_call_id",
    "peek_request_id",
    "register_result_type",
    "split_input",
    "utility_output",
]

T = TypeVar("T")


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

        Reuse ``buf`` only after ZMQ released it (see ``runtime.zmq_io``: ``BufferPool`` and
        ``send_frames``).
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
            header = ArrayHeader(dtype, shape, index)
        else:
            header = ArrayHeader(dtype, shape, data.tobytes())
        return msgspec.msgpack.Ext(code, header_encoder.encode(header))

    def _numpy_ext(self, arr: np.ndarray[Any, Any]) -> Any:
        return self._array_ext(EXT_NUMPY, *numpy_bytes(arr))

    def _torch_ext(self, t: torch.Tensor) -> Any:
        return self._array_ext(EXT_TORCH, *tensor_bytes(t))

    def _enc_hook(self, obj: object) -> Any:
        # numpy is imported lazily (an engine without arrays starts ~0.1 s sooner): an object
        # can only be an array if numpy is already loaded.
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray):
                return self._numpy_ext(obj)
            if isinstance(obj, np.generic):
                return self._numpy_ext(np.asarray(obj))
        if is_tensor(obj):
            return self._torch_ext(cast("torch.Tensor", obj))
        if isinstance(obj, TypedStruct):
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


_CHECKED_REQUEST_TYPES: dict[int, type[EngineCoreRequest]] = {}


def checked_request_type(vocab_size: int) -> type[EngineCoreRequest]:
    """The ``EngineCoreRequest`` an engine whose vocabulary has ``vocab_size`` ids decodes
    ADDs into (``Decoder(EngineCoreRequest, limits, vocab_size=...)``): a subclass, the same
    fields in the same order, whose prompt token ids msgspec checks against
    ``[0, vocab_size)`` as it builds them. About 1 ns an id, where a ``min`` and a ``max``
    over the built list took 10 µs for 512 (half an engine's admission work per request);
    the engine skips that scan for a request of this type (``EngineCore._validate``). Its
    lists were built by the decoder and nobody else holds them, so the engine may keep them
    as its own instead of copying. One class per vocabulary size, made once.

    Only a decode checks the ids: one built by calling the class is not checked, which is
    why nothing but the engine's input decoder makes them."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    cls = _CHECKED_REQUEST_TYPES.get(vocab_size)
    if cls is None:
        token: Any = Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]
        cls = cast("type[EngineCoreRequest]", msgspec.defstruct(
            "EngineCoreRequest", [("prompt_token_ids", list[token])],
            bases=(EngineCoreRequest,), module=__name__, frozen=True, array_like=True,
            omit_defaults=True, gc=False))
        _CHECKED_REQUEST_TYPES[vocab_size] = cls
    return cls


class Decoder(Generic[T]):
    """Typed, strict decoder of ``[payload, aux...]``. One per thread: not thread-safe.

    ``decode`` returns a ``type_`` or raises ``ProtocolError``, never anything else.
    Aux-frame arrays share the frame's memory (zero-copy; they keep the frame alive);
    inline ones are copies that own their memory.
    """

    def __init__(self, type_: type[T], limits: Limits = DEFAULT_LIMITS, *,
                 vocab_size: int | None = None) -> None:
        self.type = type_
        self.limits = limits
        self._name = _type_name(type_)
        # The largest first frame taken without a closer look: a utility call's untyped
        # payload has a bound of its own (``Limits.max_call_bytes``).
        self._max_payload = self._max_frame_bytes = limits.max_frame_bytes
        if type_ is UtilityRequest or type_ is EngineCoreRequest:
            # A call's payload is refused past this; an ADD's is screened (screen_large_add).
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
        # With ``vocab_size`` (an engine's ADDs): decoded as ``checked_request_type``, and as
        # the plain type again when that fails, so every outcome but the type is the same.
        self._plain: msgspec.msgpack.Decoder[T] | None = None
        if vocab_size is not None:
            if type_ is not EngineCoreRequest:
                raise TypeError(f"vocab_size applies to EngineCoreRequest only, not {self._name}")
            self._plain = self._dec
            self._dec = msgspec.msgpack.Decoder(checked_request_type(vocab_size),
                                                ext_hook=self._ext_hook)
        if type_ is EngineCoreOutputs:
            # Batches under this size cannot hold more than max_batch of anything.
            self._max_payload = min(self._max_payload, limits.max_batch)
        self._check = POST_CHECKS.get(type_)
        self._any_dec: msgspec.msgpack.Decoder[Any] | None = None
        # msgspec's own decode of one payload frame: the type is checked, not the size bound
        # or the post-check (``decode_payload`` applies both). For a round trip's hot path
        # whose caller bounds the size and checks what it uses.
        self.decode_unchecked = (self._dec if self._plain is None else self._plain).decode

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
            try:
                obj = self._dec.decode(seq[0])
            except Exception:
                if self._plain is None:
                    raise
                # A token id outside the vocabulary, or anything wrong: decoded plainly, so
                # the engine reports an id as it does for an in-process request and any
                # other fault is the plain decoder's error.
                obj = self._plain.decode(seq[0])
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

    def checked(self, payload: bytes, obj: T) -> T:
        """``decode_payload(payload)`` for a payload that ``decode_unchecked`` already turned
        into ``obj``: the size bound and the post-check applied to it, without decoding it
        again (a hot path that tried the unchecked decode first keeps its result)."""
        if len(payload) > self._max_payload:
            return self.decode([payload])
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
                screen_large_add(seq[0], limits)
                return
            if self.type is EngineCoreOutputs:
                screen_large_outputs(seq[0], limits)
                return
            raise ProtocolError(
                f"expected a utility call payload of at most {limits.max_call_bytes} bytes"
                f" (max_call_bytes; arrays travel as aux frames), got {_nbytes(seq[0])}")

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_TORCH or code == EXT_NUMPY:
            try:
                header = header_decoder.decode(data)
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

    def _buffer(self, header: ArrayHeader, itemsize: int) -> memoryview | bytes:
        shape = header.shape
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise ProtocolError(
                f"expected an array shape of <= {MAX_NDIM} sizes >= 0, got {shape}"
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

    def _torch(self, header: ArrayHeader) -> Any:
        dtype = torch_dtype_map().get(header.dtype)
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
            raise bad_bool()
        return raw.view(dtype).reshape(header.shape)

    def _numpy(self, header: ArrayHeader) -> Any:
        import numpy as np

        dtype = numpy_dtype(header.dtype)
        buf = self._buffer(header, dtype.itemsize)
        arr = np.frombuffer(buf, dtype=dtype).reshape(header.shape)
        if dtype.kind == "b" and arr.size and int(arr.view(np.uint8).max()) > 1:
            raise bad_bool()
        return arr.copy() if isinstance(buf, bytes) else arr


# Per-thread decoders for the module-level helpers, and the utility reply's probe encoder
# (neither a Decoder nor an Encoder is thread-safe).
_local = local()


def _decoder(type_: Any, limits: Limits, vocab_size: int | None = None) -> Decoder[Any]:
    try:
        cache: dict[tuple[Any, int, int | None], tuple[Limits, Decoder[Any]]] = _local.decoders
    except AttributeError:
        cache = _local.decoders = {}
    # Keyed by the limits' identity: hashing the Struct on every message costs more than the
    # decode of a small one. The entry keeps its limits alive, so the id cannot be reused.
    key = (type_, id(limits), vocab_size)
    entry = cache.get(key)
    if entry is None or entry[0] is not limits:
        entry = cache[key] = (limits, Decoder(type_, limits, vocab_size=vocab_size))
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
    frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS, vocab_size: int | None = None
) -> tuple[RequestType, EngineCoreRequest | list[str] | UtilityRequest | AttachRequest]:
    """Engine side: ``[type byte + payload, aux...]`` (the engine DEALER's view of a
    message), or ``ProtocolError``. With ``vocab_size`` an ADD that decodes is a
    ``checked_request_type(vocab_size)`` when its token ids are in range."""
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
    if kind is not RequestType.ADD:
        vocab_size = None
    return kind, _decoder(type_, limits, vocab_size).decode([payload, *frames[1:]])


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


# --- utility replies ---------------------------------------------------------------------


class _ProbeEncoder(Encoder):
    """Checks encodability without touching array data (a 64 MiB result is not copied)."""

    def _numpy_ext(self, arr: np.ndarray[Any, Any]) -> Any:
        numpy_dtype_ok(arr.dtype)
        return None

    def _torch_ext(self, t: torch.Tensor) -> Any:
        torch_dtype_ok(t)
        return None


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
        if type(result) in ALWAYS_ENCODABLE:  # echo, flags, paths: no trial encode
            return UtilityOutput(call_id, result=result)
        wrapped = wrap_typed(result)
        _probe().encode(wrapped)
        return UtilityOutput(call_id, result=wrapped)
    except Exception as e:
        kind = f"{type(result).__module__}.{type(result).__qualname__}"
        return UtilityOutput(
            call_id,
            failure_message=f"result of {method!r} (type {kind}) cannot be sent: {e}",
        )
