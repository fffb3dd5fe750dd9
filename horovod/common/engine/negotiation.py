"""Coordinator logic: which named operations every rank has submitted, and do they agree. PURE.

The coordinator (rank 0) feeds every rank's new requests into ``Coordinator.submit`` and asks
``Coordinator.ready`` for the responses of this round. A name is ready when every member of its
process set (less ranks that joined, for allreduce) has submitted it. The requests are then
validated; a disagreement becomes an error response that every rank raises for that tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.engine.negotiation_codec import FLAG_ARGUMENT_ERROR, FLAG_FLAT, KINDS, Message, encode_requests
from horovod.common.engine.stall import Stalled
from horovod.common.types import (
    RAGGED_KINDS,
    REDUCE_OP_NAMES,
    ArgumentError,
    Request,
    RequestType,
    Response,
    shape_text,
)

__all__ = ["ArgumentError", "Coordinator", "NameRows", "PendingName", "validate"]

_JOIN_UNSUPPORTED = {
    RequestType.ALLGATHER: "Allgather is not supported with Join at this time. Specify "
                           "sparse_as_dense=True if using DistributedOptimizer.",
    RequestType.BROADCAST: "Broadcast is not supported with Join at this time.",
    RequestType.ALLTOALL: "Alltoall is not supported with Join at this time.",
    RequestType.REDUCESCATTER: "Reducescatter is not supported with Join at this time.",
}


def _argument_errors(requests: dict[int, Request]) -> tuple[str, dict[str, Any]] | None:
    bad = {rank: r.payload for rank, r in requests.items() if type(r.payload) is ArgumentError}
    if not bad:
        return None
    first = requests[min(bad)]
    groups = _group_by_value(requests, lambda r: r.payload,
                             lambda r: str(r.payload) if type(r.payload) is ArgumentError
                             else "valid arguments")
    return _mismatch(first, "Invalid arguments", "argument", groups,
                     f"The call failed on every rank because of rank(s) {sorted(bad)}; fix the "
                     "arguments there (every rank must pass valid, matching arguments).")


def _group_by_value(requests: dict[int, Request], key: Callable[[Request], Any],
                    show: Callable[[Request], str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank in sorted(requests):
        groups.setdefault(show(requests[rank]), []).append(rank)
    return groups


def _describe(groups: dict[str, list[int]]) -> str:
    parts = []
    for text, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(f"{who}: {text}")
    return "; ".join(parts)


def _mismatch(req: Request, prefix: str, what: str, groups: dict[str, list[int]],
              hint: str) -> tuple[str, dict[str, Any]]:
    msg = (f"{prefix} for {req.kind.value} {req.name!r} (process set {req.process_set_id}): "
           f"{_describe(groups)}. {hint}")
    return msg, {"tensor_name": req.name, "op": req.kind.value, "field": what, "values": groups,
                 "ranks": sorted(r for rs in groups.values() for r in rs),
                 "process_set_id": req.process_set_id}


def validate(requests: dict[int, Request]) -> tuple[str, dict[str, Any]] | None:
    """Check that the requests of one name agree across ranks; return (message, fields) or None."""
    first = requests[min(requests)]
    reqs = requests
    for r in reqs.values():
        if type(r.payload) is ArgumentError:
            return _argument_errors(reqs)
    sig = first.signature()
    if all(r.signature() == sig for r in reqs.values()) and (
            first.kind in RAGGED_KINDS or all(r.shapes == first.shapes for r in reqs.values())):
        return None  # the common case: everything that must agree does

    def differs(key: Callable[[Request], Any]) -> bool:
        k0 = key(first)
        return any(key(r) != k0 for r in reqs.values())

    if differs(lambda r: r.kind):
        return _mismatch(first, "Mismatched operations", "op",
                         _group_by_value(reqs, lambda r: r.kind, lambda r: r.kind.value),
                         "Every rank must run the same collective under a given name.")
    kind = first.kind
    up = kind.upper
    if differs(lambda r: r.process_set_id):
        return _mismatch(first, "Mismatched process sets", "process_set",
                         _group_by_value(reqs, lambda r: r.process_set_id,
                                         lambda r: f"process set {r.process_set_id}"),
                         "Every rank must run this operation on the same process set.")
    if differs(lambda r: r.dtype):
        return _mismatch(first, "Mismatched data types", "dtype",
                         _group_by_value(reqs, lambda r: r.dtype, lambda r: r.dtype),
                         "Every rank must submit the same dtype for a given name.")
    if differs(lambda r: len(r.shapes)):
        return _mismatch(first, "Mismatched number of tensors in grouped operation", "group_size",
                         _group_by_value(reqs, lambda r: len(r.shapes), lambda r: f"{len(r.shapes)} tensors"),
                         "Every rank must pass the same number of tensors to a grouped operation.")
    if differs(lambda r: r.device):
        return _mismatch(first, f"Mismatched {up} CPU/GPU device selection", "device",
                         _group_by_value(reqs, lambda r: r.device, lambda r: r.device),
                         "Every rank must place this tensor on the same kind of device.")
    if kind in RAGGED_KINDS:
        if differs(lambda r: tuple(len(s) for s in r.shapes)) or differs(
                lambda r: tuple(s[1:] for s in r.shapes)):
            return _mismatch(first, f"Mismatched {up} tensor shapes", "shape",
                             _group_by_value(reqs, lambda r: r.shapes,
                                             lambda r: " ".join(shape_text(s) for s in r.shapes)),
                             "Ranks may differ only in the first dimension; every other dimension "
                             "must match.")
    elif kind in (RequestType.ALLREDUCE, RequestType.BROADCAST, RequestType.REDUCESCATTER):
        if differs(lambda r: r.shapes):
            return _mismatch(first, f"Mismatched {up} tensor shapes", "shape",
                             _group_by_value(reqs, lambda r: r.shapes,
                                             lambda r: " ".join(f"{shape_text(s)} {r.dtype}"
                                                                for s in r.shapes)),
                             "Every rank must submit the same shape for a given name.")
    if kind in (RequestType.ALLREDUCE, RequestType.REDUCESCATTER):
        if differs(lambda r: r.reduce_op):
            return _mismatch(first, "Mismatched reduction operation", "reduce_op",
                             _group_by_value(reqs, lambda r: r.reduce_op,
                                             lambda r: REDUCE_OP_NAMES[r.reduce_op]),
                             "Every rank must pass the same op= for a given name.")
        if differs(lambda r: (r.prescale, r.postscale)):
            return _mismatch(first, "Mismatched prescale and/or postscale factors", "scale",
                             _group_by_value(reqs, lambda r: (r.prescale, r.postscale),
                                             lambda r: f"prescale {r.prescale:g} postscale {r.postscale:g}"),
                             "Every rank must pass the same prescale_factor and postscale_factor.")
    if kind == RequestType.BROADCAST and differs(lambda r: r.root_rank):
        return _mismatch(first, "Mismatched BROADCAST root ranks", "root_rank",
                         _group_by_value(reqs, lambda r: r.root_rank, lambda r: f"root {r.root_rank}"),
                         "Every rank must pass the same root_rank.")
    if kind in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET) and differs(
            lambda r: r.payload):
        return _mismatch(first, "Mismatched process set changes", "process_set",
                         _group_by_value(reqs, lambda r: r.payload, lambda r: str(r.payload)),
                         "add_process_set()/remove_process_set() must be called identically, in the "
                         "same order, on every rank.")
    return None


_NO_RANK = np.iinfo(np.int64).max
_JOIN_CODE = KINDS.index(RequestType.JOIN)


class PendingName:
    """One name the coordinator has seen and not yet answered (``row`` indexes its arrays)."""

    __slots__ = ("name", "row", "first_seen", "seq", "kind", "process_set_id", "_coord")

    def __init__(self, coord: NameRows, name: str, row: int, first_seen: float, seq: int,
                 kind: RequestType, process_set_id: int) -> None:
        self._coord = coord
        self.name = name
        self.row = row
        self.first_seen = first_seen
        self.seq = seq
        self.kind = kind
        self.process_set_id = process_set_id

    @property
    def requests(self) -> dict[int, Request]:
        """Every submitted request by rank, decoded (for error texts and reports; not per round)."""
        return self._coord._requests_of(self.row)


class _Sent:
    """One distinct message of a round: the ranks that sent it, and the rows of its names."""

    __slots__ = ("msg", "ranks", "tails", "rows", "gens")

    def __init__(self, msg: Message, ranks: np.ndarray, tails: list[bytes] | None, rows: np.ndarray,
                 gens: np.ndarray) -> None:
        self.msg, self.ranks, self.tails, self.rows, self.gens = msg, ranks, tails, rows, gens

    def request(self, i: int, rank: int) -> Request | None:
        at = int(np.searchsorted(self.ranks, rank))
        if at == len(self.ranks) or self.ranks[at] != rank:
            return None
        return self.msg.request(i, rank, self.tails[at] if self.tails is not None else b"")


class NameRows:
    """The coordinator's storage: one row per pending name, arrays over (row, rank), and the
    messages the rows' requests are decoded from (``Coordinator`` decides; this keeps).

    Rows are reused: a released row (``_release``) goes back to the free list with its arrays
    reset and its generation bumped; the table doubles when no row is free (``_grow``). Messages
    none of whose names is still pending are forgotten every so often (``_sweep``).
    """

    _seen: np.ndarray
    _count: np.ndarray
    _digest: np.ndarray
    _bad: np.ndarray
    _flat: np.ndarray
    _src_rank: np.ndarray
    _src_sent: np.ndarray
    _src_index: np.ndarray
    _gen: np.ndarray
    _candidate: np.ndarray

    def __init__(self, size: int, clock: Callable[[], float]) -> None:
        self.size = size
        self._clock = clock
        self.table: dict[str, PendingName] = {}
        self._row_of: dict[str, int] = {}
        self._by_row: list[PendingName | None] = []
        self._seq = itertools.count()
        self._sent: list[_Sent] = []  # messages that may still hold a pending name
        self._sweep_at = 64
        self._rows = 0
        self._free: list[int] = []
        self._grow(64)

    def _grow(self, rows: int) -> None:
        old = self._rows

        def grown(arr: np.ndarray | None, fill: Any, dtype: Any, width: int = 0) -> np.ndarray:
            new = np.full((rows, width) if width else rows, fill, dtype)
            if arr is not None:
                new[:old] = arr
            return new

        first = old == 0
        self._seen = grown(None if first else self._seen, False, np.bool_, self.size)  # rank sent it
        self._count = grown(None if first else self._count, 0, np.int64)  # how many ranks did
        self._digest = grown(None if first else self._digest, 0, np.uint64)  # first digest (0: none)
        # Digests differ, or some rank's arguments failed: decode and validate before answering.
        self._bad = grown(None if first else self._bad, False, np.bool_)
        self._flat = grown(None if first else self._flat, True, np.bool_)  # every rank had the hint
        # The lowest rank seen so far, in which _Sent (index into self._sent), at which record.
        self._src_rank = grown(None if first else self._src_rank, _NO_RANK, np.int64)
        self._src_sent = grown(None if first else self._src_sent, 0, np.int64)
        self._src_index = grown(None if first else self._src_index, 0, np.int64)
        self._gen = grown(None if first else self._gen, 0, np.int64)  # bumped when released
        # May be complete: ready() looks at these rows only.
        self._candidate = grown(None if first else self._candidate, False, np.bool_)
        self._by_row.extend([None] * (rows - old))
        self._free.extend(range(rows - 1, old - 1, -1))
        self._rows = rows

    def _new_row(self, name: str, kind: int, process_set_id: int) -> int:
        if not self._free:
            self._grow(2 * self._rows)
        row = self._free.pop()
        entry = PendingName(self, name, row, self._clock(), next(self._seq), KINDS[kind],
                            process_set_id)
        self.table[name] = entry
        self._row_of[name] = row
        self._by_row[row] = entry
        return row

    def _waited(self, row: int, tenths: int) -> None:
        """A rank's request of this row had waited ``tenths`` / 10 s before it was sent (a
        cached request sent again after a local stall): the name has waited at least that long."""
        entry = self._by_row[row]
        if entry is not None:
            entry.first_seen = min(entry.first_seen, self._clock() - tenths / 10)

    def _request_of(self, row: int, rank: int) -> Request:
        """The request ``rank`` sent for the name of ``row``."""
        if rank == self._src_rank[row]:
            sent = self._sent[int(self._src_sent[row])]
            req = sent.request(int(self._src_index[row]), rank)
            if req is not None:
                return req
        got = self._requests_of(row).get(rank)
        assert got is not None, (row, rank)
        return got

    def _requests_of(self, row: int) -> dict[int, Request]:
        out: dict[int, Request] = {}
        gen = self._gen[row]
        for sent in self._sent:
            hit = np.flatnonzero((sent.rows == row) & (sent.gens == gen))
            for i in hit.tolist():
                for rank in sent.ranks.tolist():
                    req = sent.request(i, rank)
                    assert req is not None
                    out[rank] = req
        return dict(sorted(out.items()))

    def _release(self, entry: PendingName) -> None:
        del self.table[entry.name]
        del self._row_of[entry.name]
        row = entry.row
        self._by_row[row] = None
        self._seen[row] = False
        self._count[row] = 0
        self._digest[row] = 0
        self._bad[row] = False
        self._flat[row] = True
        self._src_rank[row] = _NO_RANK
        self._gen[row] += 1
        self._free.append(row)

    def _sweep(self) -> None:
        """Forget messages none of whose names is still pending (renumbering the sources)."""
        keep = [s for s in self._sent if (self._gen[s.rows] == s.gens).any()]
        if len(keep) < len(self._sent):
            where = {id(s): i for i, s in enumerate(keep)}
            live = np.flatnonzero(self._src_rank != _NO_RANK)
            for row in live.tolist():
                self._src_sent[row] = where[id(self._sent[int(self._src_sent[row])])]
            self._sent = keep
        self._sweep_at = max(64, 2 * len(self._sent))


class Coordinator(NameRows):
    """Message table of the coordinator rank, kept as arrays over (pending name, rank).

    ``submit_encoded`` takes every rank's message of a round (``wire.encode_requests``), parses
    each distinct message once, maps its names to rows in one pass, and records the ranks that
    sent it with a few array operations; validation compares signature digests per name. Requests
    are decoded only to build a response (the lowest rank's) or an error text (every rank's, when
    digests differ). Per (name, rank) the coordinator keeps one byte (``seen``).

    Args:
        size: number of ranks in the world.
        members: returns the sorted global ranks of a process set id (None if unknown).
        clock: monotonic clock, injectable for tests.
    """

    def __init__(self, size: int, members: Callable[[int], Sequence[int] | None],
                 clock: Callable[[], float]) -> None:
        super().__init__(size, clock)
        self._members = members
        self.joined: list[int] = []
        self._next_process_set_id = 1
        self._member_index: dict[int, tuple[Sequence[int], np.ndarray]] = {}

    def reserve_process_set_ids(self, next_id: int) -> None:
        self._next_process_set_id = max(self._next_process_set_id, next_id)

    def submit(self, requests: Sequence[Request]) -> list[str]:
        """Record requests (each carries its ``rank``); return names seen for the first time."""
        by_rank: dict[int, list[Request]] = {}
        for req in requests:
            by_rank.setdefault(req.rank, []).append(req)
        messages = [b""] * self.size
        for rank, reqs in by_rank.items():
            messages[rank] = encode_requests(reqs)
        return self.submit_encoded(messages)

    def submit_encoded(self, messages: Sequence[bytes | None]) -> list[str]:
        """Record one round's messages (``messages[rank]``); return names seen for the first time."""
        # Ranks that sent the same operations sent the same key: parse one copy per key.
        distinct: dict[bytes, tuple[bytes, list[int], list[bytes]]] = {}
        for rank, data in enumerate(messages):
            if not data:
                continue
            cut = Message.key_length(data)
            key = data[:cut] if cut < len(data) else data
            group = distinct.get(key)
            if group is None:
                group = distinct[key] = (data, [], [])
            group[1].append(rank)
            group[2].append(data[cut:])
        new_names: list[str] = []
        joiners: list[int] = []
        for data, rank_list, tail_list in distinct.values():
            msg = Message(data)
            tails = tail_list if any(tail_list) else None
            # Array operations cost a few microseconds each whatever their size: a small message
            # (a few requests from a few ranks, as hooks trickle in) is cheaper element by element.
            record = self._record_few if msg.n * (10 + len(rank_list)) <= 300 else self._record_many
            if record(msg, rank_list, tails, new_names):
                joiners.extend(rank_list)
        for rank in sorted(joiners):
            if rank not in self.joined:
                self.joined.append(rank)
                # A new joiner may complete any waiting allreduce.
                self._candidate[list(self._row_of.values())] = True
        return new_names

    def _record_many(self, msg: Message, rank_list: list[int], tails: list[bytes] | None,
                     new_names: list[str]) -> bool:
        """Record one distinct message sent by ``rank_list`` with array operations over its
        names x ranks; True if it holds a join."""
        ranks = np.asarray(rank_list, np.int64)
        rows = np.fromiter(map(self._row_of.get, msg.names, itertools.repeat(-1)), np.int64, msg.n)
        records = msg.records
        if (rows < 0).any():
            for i in np.flatnonzero(rows < 0).tolist():
                rows[i] = self._new_row(msg.names[i], int(records[i]["kind"]), int(records[i]["ps"]))
                new_names.append(msg.names[i])
        waited = records["waited"]
        if waited.any():
            for i in np.flatnonzero(waited).tolist():
                self._waited(int(rows[i]), int(waited[i]))
        sent = len(self._sent)
        self._sent.append(_Sent(msg, ranks, tails, rows, self._gen[rows]))
        self._seen[np.ix_(rows, ranks)] = True
        self._count[rows] += len(ranks)
        self._candidate[rows] = True
        digests = records["digest"]
        known = self._digest[rows]
        unset = known == 0
        known[unset] = digests[unset]
        self._digest[rows] = known
        flags = records["flags"]
        self._bad[rows] |= (known != digests) | ((flags & FLAG_ARGUMENT_ERROR) != 0)
        self._flat[rows] &= (flags & FLAG_FLAT) != 0
        lower = self._src_rank[rows] > ranks[0]
        if lower.any():
            at = rows[lower]
            self._src_rank[at] = ranks[0]
            self._src_sent[at] = sent
            self._src_index[at] = np.flatnonzero(lower)
        return bool((records["kind"] == _JOIN_CODE).any())

    def _record_few(self, msg: Message, rank_list: list[int], tails: list[bytes] | None,
                    new_names: list[str]) -> bool:
        """``_record_many`` element by element, for small messages (the same effects)."""
        sent = len(self._sent)
        rows = []
        low = rank_list[0]
        join = False
        for i, (name, (dig, ps, kind, flags, waited)) in enumerate(zip(msg.names, msg.records.tolist())):
            row = self._row_of.get(name)
            if row is None:
                row = self._new_row(name, kind, ps)
                new_names.append(name)
            if waited:
                self._waited(row, waited)
            rows.append(row)
            seen = self._seen  # (after _new_row, which may have grown the arrays)
            for rank in rank_list:
                seen[row, rank] = True
            self._count[row] += len(rank_list)
            self._candidate[row] = True
            known = int(self._digest[row])
            if known == 0:
                self._digest[row] = dig
            elif known != dig:
                self._bad[row] = True
            if flags & FLAG_ARGUMENT_ERROR:
                self._bad[row] = True
            if not flags & FLAG_FLAT:
                self._flat[row] = False
            if low < self._src_rank[row]:
                self._src_rank[row] = low
                self._src_sent[row] = sent
                self._src_index[row] = i
            join = join or kind == _JOIN_CODE
        at = np.asarray(rows, np.int64)
        self._sent.append(_Sent(msg, np.asarray(rank_list, np.int64), tails, at, self._gen[at]))
        return join

    def _expected(self, kind: RequestType, process_set_id: int) -> np.ndarray | None:
        """Global ranks that must submit a name of this kind and set, as an index array."""
        members = range(self.size) if kind == RequestType.JOIN else self._members(process_set_id)
        if members is None:
            return None
        key = -1 if kind == RequestType.JOIN else process_set_id
        cached = self._member_index.get(key)
        if cached is None or cached[0] is not members and list(cached[0]) != list(members):
            cached = self._member_index[key] = (members, np.asarray(members, np.int64))
        return cached[1]

    def ready(self) -> list[Response]:
        """Return responses for every name now submitted by all ranks that must submit it."""
        out: list[tuple[int, Response]] = []
        joined = np.asarray(self.joined, np.int64)
        rows = np.flatnonzero(self._candidate)
        self._candidate[rows] = False
        counts = self._count[rows].tolist()
        for row, count in zip(rows.tolist(), counts):
            entry = self._by_row[row]
            if entry is None:
                continue
            members = self._expected(entry.kind, entry.process_set_id)
            if members is None:
                any_req = self._request_of(row, int(self._src_rank[row]))
                response = Response(any_req, error=(
                    f"{entry.kind.value} {entry.name!r}: process set {entry.process_set_id} does "
                    "not exist, or has not been registered."),
                    error_fields={"tensor_name": entry.name, "process_set_id": entry.process_set_id})
                out.append((entry.seq, response))
                self._release(entry)
                continue
            if entry.kind != RequestType.JOIN and len(joined):
                if count + len(joined) < len(members):
                    continue
                if not (self._seen[row][members] | np.isin(members, joined)).all():
                    continue
            elif count < len(members) or not self._seen[row][members].all():
                continue
            out.append((entry.seq, self._respond(entry, members)))
            self._release(entry)
        out.sort(key=lambda x: x[0])
        if len(self._sent) >= self._sweep_at:
            self._sweep()
        return [r for _, r in out]

    def _respond(self, entry: PendingName, members: np.ndarray) -> Response:
        row = entry.row
        first = self._request_of(row, int(self._src_rank[row]))
        if self._bad[row]:  # the rare case: decode every rank's request and say what differs
            problem = validate(self._requests_of(row))
            if problem is not None:
                return Response(first, error=problem[0], error_fields=problem[1])
        kind = entry.kind
        joined = set(self.joined)
        member_joined = tuple(r for r in members.tolist() if r in joined) if joined else ()
        if kind == RequestType.JOIN:
            last = self.joined[-1]
            self.joined = []
            return Response(first, result=last)
        if member_joined and kind in _JOIN_UNSUPPORTED:
            return Response(first, error=_JOIN_UNSUPPORTED[kind],
                            error_fields={"tensor_name": first.name, "op": kind.value,
                                          "ranks": list(member_joined)})
        if kind == RequestType.ADD_PROCESS_SET:
            new_id = self._next_process_set_id
            self._next_process_set_id += 1
            return Response(first, result=new_id)
        # One schedule for all: the flat hint holds only if every rank's request had it.
        first.flat = bool(self._flat[row])
        return Response(first, joined=member_joined)

    def stalled(self, older_than: float) -> list[Stalled]:
        """Names waiting longer than ``older_than`` s: who submitted each, who did not, and how
        long it has waited (counted from the first submission a rank told the coordinator of,
        including the time a cached request waited on its rank before it was sent again)."""
        now = self._clock()
        joined = set(self.joined)
        out = []
        for name, entry in self.table.items():
            age = now - entry.first_seen
            if age < older_than:
                continue
            members = self._expected(entry.kind, entry.process_set_id)
            seen = self._seen[entry.row]
            submitted = np.flatnonzero(seen).tolist()
            missing = [] if members is None else [
                r for r in members[~seen[members]].tolist() if r not in joined]
            out.append(Stalled(name, entry.kind.value, entry.process_set_id, submitted, missing, age))
        return out
