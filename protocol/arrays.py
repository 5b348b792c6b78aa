"""Arrays on the wire: the ``EXT_TORCH`` and ``EXT_NUMPY`` msgpack ext types.

Theory of operation
-------------------
An array travels as an ext value whose body is an ``ArrayHeader`` ``[dtype, shape, data]``:
``data`` is the raw bytes of a small array, or the index of an aux frame holding the array's
own memory (``codec.Encoder`` chooses by ``size_threshold``). This module turns an array into
``(dtype name, shape, flat byte view)`` on the way out and checks a peer's dtype string on the
way in; ``codec.Decoder`` builds the array over the frame it received.

Rule 1: only plain dtypes cross: torch's listed in ``_TORCH_DTYPE_NAMES`` (strided layout),
numpy's without objects, void or zero-size items (no pickle on the wire). Refusals on the way
out are ``TypeError``; a dtype string from a peer that fails the check is ``ProtocolError``.
Rule 2: torch and numpy are imported only when an array is met (an engine without arrays
starts sooner).
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from ..spec.errors import ProtocolError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["EXT_NUMPY", "EXT_TORCH"]

EXT_TORCH = 1
EXT_NUMPY = 2

MAX_NDIM = 64  # torch's own limit on tensor rank


class ArrayHeader(msgspec.Struct, array_like=True, frozen=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes | int  # inline bytes, or the index of an aux frame


header_encoder = msgspec.msgpack.Encoder()
header_decoder = msgspec.msgpack.Decoder(ArrayHeader)

# torch dtypes that may cross the wire, by name without the "torch." prefix.
_TORCH_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip
_torch_dtypes: dict[str, Any] | None = None


def torch_dtype_map() -> dict[str, Any]:
    global _torch_dtypes
    if _torch_dtypes is None:
        import torch

        found = {n: getattr(torch, n, None) for n in _TORCH_DTYPE_NAMES}
        _torch_dtypes = {n: d for n, d in found.items() if isinstance(d, torch.dtype)}
    return _torch_dtypes


def is_tensor(obj: object) -> bool:
    # torch is imported lazily: if nobody imported it, obj cannot be a tensor.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def torch_dtype_ok(t: torch.Tensor) -> str:
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in torch_dtype_map():
        raise TypeError(f"cannot encode a torch tensor of dtype {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"cannot encode a torch tensor with layout {t.layout}")
    return name


def tensor_bytes(t: torch.Tensor) -> tuple[str, list[int], memoryview]:
    """The tensor's own memory as a flat byte view (copies only if it must)."""
    import torch

    name = torch_dtype_ok(t)
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


def numpy_dtype_ok(dt: np.dtype[Any]) -> np.dtype[Any]:
    if dt.hasobject or dt.kind == "V" or dt.itemsize == 0:
        raise TypeError(f"cannot encode a numpy array of dtype {dt} (no pickle on the wire)")
    return dt


def numpy_bytes(arr: np.ndarray[Any, Any]) -> tuple[str, list[int], memoryview]:
    import numpy as np

    dt = numpy_dtype_ok(arr.dtype)
    shape = list(arr.shape)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return dt.str, shape, memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def bad_bool() -> ProtocolError:
    # Any other byte is a bool neither library defines (numpy and torch read it differently).
    return ProtocolError("expected bool array bytes of 0 or 1")


# What ``dtype.str`` produces for plain dtypes: byte order, kind, item size, datetime unit.
_NUMPY_DTYPE_RE = re.compile(r"[<>|][biufcSUmM][0-9]{1,4}(\[[0-9]*[a-zA-Z]{1,2}\])?")
_numpy_dtypes: dict[str, np.dtype[Any]] = {}


def numpy_dtype(text: str) -> np.dtype[Any]:
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
