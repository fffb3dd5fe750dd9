"""Today's coordinator before issue 25 (pickled dataclass requests, per-rank dict work): the
baseline of ``control_plane.py``, kept verbatim so the benchmark measures both in one run."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from horovod.common.engine.negotiation import _JOIN_UNSUPPORTED, validate
from horovod.common.types import Request, RequestType, Response

__all__ = ["LegacyCoordinator"]


@dataclass
class PendingName:
    """Requests seen so far for one name, with when the coordinator first saw it."""

    first_seen: float
    seq: int
    requests: dict[int, Request] = field(default_factory=dict)


class LegacyCoordinator:
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
