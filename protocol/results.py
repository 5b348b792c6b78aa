"""Typed utility results: the ``EXT_STRUCT`` msgpack ext type and its registry.

Theory of operation
-------------------
A utility result whose class (a msgspec Struct or a dataclass) was registered on both peers
with ``register_result_type`` travels as ``EXT_STRUCT`` ``[name, value]``. On the way out,
``wrap_typed`` marks each registered value (``TypedStruct``), and ``codec.Encoder`` tags it
with its name; on the way in, ``codec.Decoder`` hands back a ``StructResult`` and
``decode_utility_result`` rebuilds the registered class from it.

Rule 1: an unregistered dataclass is refused (``TypeError``): msgspec would carry it as a
dict, and the caller would get another type than the one returned.
Rule 2: an unknown name on the way in is a ``ProtocolError`` that says to register the type.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..spec.errors import ProtocolError

__all__ = [
    "EXT_STRUCT",
    "StructResult",
    "check_no_dataclass",
    "decode_utility_result",
    "plain_result",
    "register_result_type",
]

EXT_STRUCT = 3


class TypedStruct:
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


def wrap_typed(value: Any) -> Any:
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
            return TypedStruct(name, {f: wrap_typed(getattr(value, f))
                                      for f in cls.__dataclass_fields__}, value)
        return TypedStruct(name, value)
    if cls is list or cls is tuple:
        if _SCALAR_TYPES.issuperset(map(type, value)):  # one C-level pass for a flat list
            return value
        return [wrap_typed(v) for v in value]
    if cls is dict:
        if _SCALAR_TYPES.issuperset(map(type, value.values())):
            return value
        return {k: wrap_typed(v) for k, v in value.items()}
    if _is_dataclass_instance(value):
        raise _unregistered(value)
    return value


def plain_result(value: Any) -> Any:
    """A reply's result as a wire without ``EXT_STRUCT`` carries it (vLLM's, which has no
    tags): every registered value as the object it was, which msgpack writes as a map; the
    receiver rebuilds it with ``msgspec.convert`` where it knows the type."""
    if isinstance(value, TypedStruct):
        return value.original
    if type(value) is list:
        return [plain_result(v) for v in value]
    if type(value) is dict:
        return {k: plain_result(v) for k, v in value.items()}
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


# Results of these types always encode (an int may not: msgpack stops at 64 bits; a str
# may not: a lone surrogate has no UTF-8 form).
ALWAYS_ENCODABLE = frozenset({type(None), bool, float, bytes})
# Results msgpack carries as themselves: nothing to tag on the way out or rebuild on the way in
# (the round-trip paths on both sides skip those passes; an int or str may still not encode).
PLAIN_RESULTS = frozenset({*ALWAYS_ENCODABLE, int, str})


def _convert_hook(type_: type[Any], obj: Any) -> Any:
    # Struct fields typed as tensors/arrays: the ext hook already rebuilt them.
    if isinstance(obj, type_):
        return obj
    raise TypeError(f"expected {type_!r}, got {type(obj)!r}")


def decode_utility_result(value: object) -> object:
    """Client side: rebuild registered Structs in a decoded result; ``ProtocolError`` if unknown."""
    if isinstance(value, TypedStruct):  # an in-process reply that never crossed the wire
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
