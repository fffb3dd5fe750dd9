"""Coordinator logic: which named operations every rank has submitted, and do they agree. PURE.

The coordinator (rank 0) feeds every rank's new requests into ``Coordinator.submit`` and asks
``Coordinator.ready`` for the responses of this round. A name is ready when every member of its
process set (less ranks that joined, for allreduce) has submitted it. The requests are then
validated; a disagreement becomes an error response that every rank raises for that tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from horovod.common.types import (
    RAGGED_KINDS,
    REDUCE_OP_NAMES,
    Request,
    RequestType,
    Response,
    shape_text,
)

__all__ = ["ArgumentError", "Coordinator", "PendingName", "validate"]

_JOIN_UNSUPPORTED = {
    RequestType.ALLGATHER: "Allgather is not supported with Join at this time. Specify "
                           "sparse_as_dense=True if using DistributedOptimizer.",
    RequestType.BROADCAST: "Broadcast is not supported with Join at this time.",
    RequestType.ALLTOALL: "Alltoall is not supported with Join at this time.",
    RequestType.REDUCESCATTER: "Reducescatter is not supported with Join at this time.",
}


@dataclass(frozen=True)
class ArgumentError:
    """The payload of a request whose call failed its argument checks on the submitting rank.

    The rank still submits the operation's name, so that the coordinator can fail the name on
    every rank of the set instead of leaving the others waiting for a rank that raised locally.
    """

    error_type: str
    message: str

    def __str__(self) -> str:
        return f"{self.error_type}: {self.message}"


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


@dataclass
class PendingName:
    """Requests seen so far for one name, with when the coordinator first saw it."""

    first_seen: float
    seq: int
    requests: dict[int, Request] = field(default_factory=dict)


class Coordinator:
    """Message table of the coordinator rank.

    Args:
        size: number of ranks in the world.
        members: returns the sorted global ranks of a process set id (None if unknown).
        clock: monotonic clock, injectable for tests.
    """

    def __init__(self, size: int, members: Callable[[int], Sequence[int] | None],
                 clock: Callable[[], float]) -> None:
        self.size = size
        self._members = members
        self._clock = clock
        self.table: dict[str, PendingName] = {}
        # Names that may be complete; ready() only looks at these (not the whole table).
        self._candidates: set[str] = set()
        self.joined: list[int] = []
        self._seq = itertools.count()
        self._next_process_set_id = 1

    def reserve_process_set_ids(self, next_id: int) -> None:
        self._next_process_set_id = max(self._next_process_set_id, next_id)

    def submit(self, requests: Sequence[Request]) -> list[str]:
        """Record requests (each carries its ``rank``); return names seen for the first time."""
        new_names = []
        now = self._clock()
        for req in requests:
            entry = self.table.get(req.name)
            if entry is None:
                entry = self.table[req.name] = PendingName(now, next(self._seq))
                new_names.append(req.name)
            entry.requests[req.rank] = req
            if req.kind == RequestType.JOIN and req.rank not in self.joined:
                self.joined.append(req.rank)
                # A new joiner may complete any waiting allreduce.
                self._candidates.update(self.table)
            members = self._expected(req)
            if members is None or len(entry.requests) + len(self.joined) >= len(members):
                self._candidates.add(req.name)
        return new_names

    def _expected(self, req: Request) -> Sequence[int] | None:
        if req.kind == RequestType.JOIN:
            return range(self.size)
        return self._members(req.process_set_id)

    def ready(self) -> list[Response]:
        """Return responses for every name now submitted by all ranks that must submit it."""
        out: list[tuple[int, Response]] = []
        joined = set(self.joined)
        candidates, self._candidates = self._candidates, set()
        for name in candidates:
            entry = self.table.get(name)
            if entry is None:
                continue
            any_req = next(iter(entry.requests.values()))
            members = self._expected(any_req)
            if members is None:
                response = Response(any_req, error=(
                    f"{any_req.kind.value} {name!r}: process set {any_req.process_set_id} does not "
                    "exist, or has not been registered."),
                    error_fields={"tensor_name": name, "process_set_id": any_req.process_set_id})
                out.append((entry.seq, response))
                del self.table[name]
                continue
            missing = [r for r in members if r not in entry.requests]
            if any_req.kind != RequestType.JOIN and joined:
                missing = [r for r in missing if r not in joined]
            if missing:
                continue
            del self.table[name]
            out.append((entry.seq, self._respond(entry, members, joined)))
        out.sort(key=lambda x: x[0])
        return [r for _, r in out]

    def _respond(self, entry: PendingName, members: Sequence[int], joined: set[int]) -> Response:
        reqs = entry.requests
        first = reqs[min(reqs)]
        problem = validate(reqs)
        if problem is not None:
            return Response(first, error=problem[0], error_fields=problem[1])
        kind = first.kind
        member_joined = tuple(r for r in members if r in joined)
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
        if first.flat and not all(r.flat for r in reqs.values()):
            first = replace(first, flat=False)  # one schedule for all: flat only if all are
        return Response(first, joined=member_joined)

    def stalled(self, older_than: float) -> list[tuple[str, list[int], list[int], float]]:
        """Names waiting longer than ``older_than`` s: (name, submitted ranks, missing ranks, age)."""
        now = self._clock()
        joined = set(self.joined)
        out = []
        for name, entry in self.table.items():
            age = now - entry.first_seen
            if age < older_than:
                continue
            any_req = next(iter(entry.requests.values()))
            members = self._expected(any_req) or []
            missing = [r for r in members if r not in entry.requests and r not in joined]
            out.append((name, sorted(entry.requests), missing, age))
        return out
