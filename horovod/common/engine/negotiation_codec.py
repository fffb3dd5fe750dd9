"""The wire format of negotiation: one rank's new requests, and the coordinator's responses. PURE.

A rank's message for one round is ``bytes`` (pickling ``bytes`` costs the transport nothing)::

    header   magic, record count n, length of the names blob, length of the detail blob
    records  n fixed 16-byte records (``RECORD``): signature digest, process set, kind, flags,
             and how long the request had waited on its rank before this message (tenths of a
             second, 0 for a fresh one: a cached request sent again after a local stall)
    names    the n names, UTF-8, NUL-separated
    detail   the fields a response needs, one array per request, in JSON (``_dumps``: data only,
             decoded by the standard library's C parser; equal requests encode to equal bytes on
             every rank)
    tail     ragged kinds only: each request's first dimensions (the only part that may differ
             across ranks for a name whose requests agree)

Everything but the tail is the message's *key*: ranks that submit the same operations send the
same key, so the coordinator parses one copy per distinct key, and compares 64-bit signature
digests instead of fields. The detail blob is read only for the lowest rank of a name (its
request becomes the response) and, when digests differ, for every rank, to name the ranks and
values that disagree exactly as ``negotiation.validate`` always has.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from horovod.common.types import RAGGED_KINDS, ArgumentError, ReduceOp, Request, RequestType, Response

__all__ = ["RECORD", "KINDS", "FLAG_FLAT", "FLAG_ARGUMENT_ERROR", "Message", "digest",
           "encode_requests", "decode_requests", "encode_responses", "decode_responses"]

RECORD = np.dtype([("digest", "<u8"), ("ps", "<i4"), ("kind", "u1"), ("flags", "u1"),
                   ("waited", "<u2")])
KINDS: tuple[RequestType, ...] = tuple(RequestType)
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}
FLAG_FLAT, FLAG_ARGUMENT_ERROR = 1, 2
_MAGIC = b"HVW1"
_HEAD = struct.Struct("<4sIII")


def digest(req: Request) -> int:
    """A 64-bit digest of ``req.signature()``, the same on every rank (never 0).

    Two requests of one name agree exactly when their signatures do; the coordinator compares
    digests and looks at the fields only when they differ.
    """
    d = req._digest
    if d:
        return d
    raw = hashlib.blake2b(repr(req.signature()).encode(), digest_size=8).digest()
    d = req._digest = int.from_bytes(raw, "little") | 1
    return d


_ARG_ERROR = "__hvd_argument_error__"


def _plain_default(obj: Any) -> Any:
    if type(obj) is ArgumentError:
        return {_ARG_ERROR: [obj.error_type, obj.message]}
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"{type(obj).__name__} cannot be part of a negotiation message")


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_plain_default)


def _dumps(obj: Any) -> bytes:
    """Plain data as JSON: a format that cannot run code when read (never pickle: whoever
    reaches the controller's transport would run code in every rank)."""
    return _ENCODER.encode(obj).encode()


def _hook(d: dict[str, Any]) -> Any:
    if len(d) == 1 and _ARG_ERROR in d:
        error_type, message = d[_ARG_ERROR]
        return ArgumentError(str(error_type), str(message))
    return d


def _loads(data: bytes | memoryview) -> Any:
    """Read what ``_dumps`` wrote (``ValueError`` for anything malformed, however deep)."""
    try:
        return json.loads(bytes(data), object_hook=_hook)
    except (ValueError, RecursionError, TypeError) as exc:
        raise ValueError(f"malformed negotiation message: {exc}"[:300]) from None


def _shapes(shapes: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in shapes)


def _payload(value: Any) -> Any:
    """A request's payload as sent: its sequences are tuples (JSON has only arrays)."""
    return tuple(_payload(v) for v in value) if type(value) is list else value


def encode_requests(requests: Sequence[Request], waited: Sequence[float] | None = None) -> bytes:
    """One rank's new requests of a round, as bytes (``b""`` for none); ``waited[i]``: seconds
    request i had already waited on this rank (a stalled cached request sent again)."""
    n = len(requests)
    if n == 0:
        return b""
    records = np.zeros(n, RECORD)
    details = []
    tails: list[Any] = []
    ragged = False
    for i, r in enumerate(requests):
        flags = FLAG_FLAT if r.flat else 0
        if type(r.payload) is ArgumentError:
            flags |= FLAG_ARGUMENT_ERROR
        tenths = min(int(waited[i] * 10), 0xFFFF) if waited is not None else 0
        records[i] = (digest(r), r.process_set_id, _KIND_CODE[r.kind], flags, tenths)
        shapes = r.shapes
        if r.kind in RAGGED_KINDS:
            ragged = True
            tails.append(tuple(s[0] if s else None for s in shapes))
            shapes = tuple(s[1:] for s in shapes)
        else:
            tails.append(None)
        details.append((r.dtype, shapes, int(r.reduce_op), r.prescale, r.postscale, r.root_rank,
                        r.device, r.payload))
    if any("\0" in r.name for r in requests):
        raise ValueError("tensor names may not contain NUL characters")
    names = "\0".join(r.name for r in requests).encode()
    detail = _dumps(details)
    tail = _dumps(tails) if ragged else b""
    return b"".join((_HEAD.pack(_MAGIC, n, len(names), len(detail)), records.tobytes(), names,
                     detail, tail))


class Message:
    """A parsed request message (records and names at once; details when first asked)."""

    __slots__ = ("data", "n", "records", "names", "_detail_at", "_detail_end", "_details")

    def __init__(self, data: bytes) -> None:
        magic, n, names_len, detail_len = _HEAD.unpack_from(data)
        if magic != _MAGIC:
            raise ValueError(f"not a horovod negotiation message (magic {magic!r})")
        at = _HEAD.size
        self.data = data
        self.n = n
        self.records = np.frombuffer(data, RECORD, n, at)
        at += RECORD.itemsize * n
        self.names = data[at:at + names_len].decode().split("\0")
        self._detail_at = at + names_len
        self._detail_end = self._detail_at + detail_len
        self._details: list[Any] | None = None

    @staticmethod
    def key_length(data: bytes) -> int:
        """Bytes of ``data`` that every rank submitting the same operations sends alike."""
        _, n, names_len, detail_len = _HEAD.unpack_from(data)
        return _HEAD.size + RECORD.itemsize * n + names_len + detail_len

    def request(self, i: int, rank: int, tail: bytes = b"") -> Request:
        """The ``i``-th request as ``rank`` sent it (``tail``: that rank's ragged first dims)."""
        if self._details is None:
            self._details = _loads(memoryview(self.data)[self._detail_at:self._detail_end])
        dtype, shapes, op, pre, post, root, device, payload = self._details[i]
        shapes, payload = _shapes(shapes), _payload(payload)
        rec = self.records[i]
        kind = KINDS[int(rec["kind"])]
        if kind in RAGGED_KINDS and tail:
            firsts = _loads(tail)[i]
            shapes = tuple(s if f is None else (f,) + s for f, s in zip(firsts, shapes))
        return Request(self.names[i], kind, dtype, shapes, ReduceOp(op), pre, post, root,
                       int(rec["ps"]), device, payload, rank, bool(int(rec["flags"]) & FLAG_FLAT))


def decode_requests(data: bytes, rank: int) -> list[Request]:
    """Every request of one rank's message (tests, the timeline, and error reports use this)."""
    if not data:
        return []
    msg = Message(data)
    tail = data[Message.key_length(data):]
    return [msg.request(i, rank, tail) for i in range(msg.n)]


def _request_tuple(r: Request) -> tuple[Any, ...]:
    return (r.name, _KIND_CODE[r.kind], r.dtype, r.shapes, int(r.reduce_op), r.prescale,
            r.postscale, r.root_rank, r.process_set_id, r.device, r.payload, r.rank, r.flat)


def encode_responses(responses: Sequence[Response]) -> bytes:
    """The coordinator's responses of a round, as bytes: plain tuples, no class per response."""
    return _dumps([(_request_tuple(r.request), r.error, r.error_fields or None, r.joined, r.result)
                   for r in responses])


def decode_responses(data: bytes) -> list[Response]:
    out = []
    for (name, kind, dtype, shapes, op, pre, post, root, ps, device, payload, rank, flat), error, \
            fields, joined, result in _loads(data):
        req = Request(name, KINDS[kind], dtype, _shapes(shapes), ReduceOp(op), pre, post, root, ps,
                      device, _payload(payload), rank, flat)
        out.append(Response(req, error, fields or {}, tuple(joined), result))
    return out
