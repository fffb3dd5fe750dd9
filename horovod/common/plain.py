"""A byte format for plain values that cannot run code: what ranks send each other through the
controller for Horovod's own purposes (host names at init, process-set lists, the autotuner's
decisions, and the negotiation messages, which ``engine/negotiation_codec.py`` encodes to bytes itself).

Unlike pickle, decoding only ever builds ``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, ``tuple``, ``list``, ``dict`` and ``ArgumentError``; malformed or hostile input raises
``ValueError`` (lengths are checked against the data, nesting is bounded). Encoding is
deterministic: equal values give equal bytes on every rank (dicts in insertion order), which the
negotiation's fast path relies on. NumPy scalars are written as the Python value they hold.

Only ``broadcast_object``/``allgather_object`` of user objects (``horovod.common.objects``) use
pickle, by design: the user asks to send an arbitrary object there.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from horovod.common.types import ArgumentError

__all__ = ["dumps", "loads", "MAX_DEPTH"]

MAX_DEPTH = 64
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")
_LO, _HI = -(1 << 63), (1 << 63) - 1


def dumps(obj: Any) -> bytes:
    """Encode a plain value (see the module docstring).

    Raises:
        TypeError: ``obj`` holds something else (a class instance, a set, a NumPy array).
    """
    out: list[bytes] = []
    _enc(obj, out, 0)
    return b"".join(out)


def _enc(v: Any, out: list[bytes], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"nesting deeper than {MAX_DEPTH}")
    t = type(v)
    if v is None:
        out.append(b"N")
    elif t is bool or t is np.bool_:
        out.append(b"T" if v else b"F")
    elif t is int or isinstance(v, (int, np.integer)):
        v = int(v)
        if _LO <= v <= _HI:
            out.append(b"i" + _I64.pack(v))
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            out.append(b"I" + _U32.pack(len(raw)) + raw)
    elif t is float or isinstance(v, (float, np.floating)):
        out.append(b"f" + _F64.pack(float(v)))
    elif t is str:
        raw = v.encode("utf-8", "surrogatepass")
        out.append(b"s" + _U32.pack(len(raw)) + raw)
    elif t is bytes or t is bytearray or t is memoryview:
        raw = bytes(v)
        out.append(b"b" + _U32.pack(len(raw)) + raw)
    elif t is tuple or t is list:
        out.append((b"t" if t is tuple else b"l") + _U32.pack(len(v)))
        for x in v:
            _enc(x, out, depth + 1)
    elif t is dict:
        out.append(b"d" + _U32.pack(len(v)))
        for k, x in v.items():
            _enc(k, out, depth + 1)
            _enc(x, out, depth + 1)
    elif t is ArgumentError:
        out.append(b"A")
        _enc(v.error_type, out, depth + 1)
        _enc(v.message, out, depth + 1)
    elif isinstance(v, str):  # str subclasses (enum values of str enums) as their text
        _enc(str(v), out, depth)
    else:
        raise TypeError(f"{t.__name__} is not a plain value (None, bool, int, float, str, bytes, "
                        "tuple, list, dict)")


def loads(data: bytes | bytearray | memoryview | np.ndarray) -> Any:
    """Decode what ``dumps`` wrote.

    Raises:
        ValueError: ``data`` is not exactly one well-formed value.
    """
    mv = memoryview(data)  # type: ignore[arg-type]  # ndarray is a buffer too
    try:
        value, at = _dec(mv, 0, 0)
    except (struct.error, IndexError, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"malformed message: {exc}") from exc
    if at != len(mv):
        raise ValueError(f"malformed message: {len(mv) - at} bytes after the value")
    return value


def _length(mv: memoryview, at: int) -> tuple[int, int]:
    (n,) = _U32.unpack_from(mv, at)
    at += 4
    if n > len(mv) - at:
        raise ValueError(f"malformed message: a length of {n} past the end of the data")
    return n, at


def _dec(mv: memoryview, at: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise ValueError(f"malformed message: nesting deeper than {MAX_DEPTH}")
    tag = mv[at]
    at += 1
    if tag == 0x69:  # i
        return _I64.unpack_from(mv, at)[0], at + 8
    if tag == 0x73:  # s
        n, at = _length(mv, at)
        return str(mv[at:at + n], "utf-8", "surrogatepass"), at + n
    if tag == 0x74 or tag == 0x6C:  # t, l
        n, at = _length(mv, at)  # each item takes at least one byte: n is bounded by the data
        items = []
        for _ in range(n):
            x, at = _dec(mv, at, depth + 1)
            items.append(x)
        return (tuple(items) if tag == 0x74 else items), at
    if tag == 0x4E:  # N
        return None, at
    if tag == 0x54:  # T
        return True, at
    if tag == 0x46:  # F
        return False, at
    if tag == 0x66:  # f
        return _F64.unpack_from(mv, at)[0], at + 8
    if tag == 0x62:  # b
        n, at = _length(mv, at)
        return bytes(mv[at:at + n]), at + n
    if tag == 0x64:  # d
        n, at = _length(mv, at)
        d: dict[Any, Any] = {}
        for _ in range(n):
            k, at = _dec(mv, at, depth + 1)
            x, at = _dec(mv, at, depth + 1)
            d[k] = x  # TypeError for an unhashable key: malformed
        return d, at
    if tag == 0x49:  # I
        n, at = _length(mv, at)
        return int.from_bytes(mv[at:at + n], "little", signed=True), at + n
    if tag == 0x41:  # A
        error_type, at = _dec(mv, at, depth + 1)
        message, at = _dec(mv, at, depth + 1)
        if type(error_type) is not str or type(message) is not str:
            raise ValueError("malformed message: an ArgumentError of non-text fields")
        return ArgumentError(error_type, message), at
    raise ValueError(f"malformed message: unknown tag {tag:#x} at byte {at - 1}")
