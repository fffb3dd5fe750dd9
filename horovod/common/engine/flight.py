"""Flight recorder: the last collectives of this rank, for stall reports and stacks on demand.

Always on (``HOROVOD_FLIGHT_RECORDER``: how many collectives to keep, 0: off), so it costs what
the engine does anyway: every batch that completes is appended to a bounded ring as one record
(the batch's responses, which a cached step plans once and reuses, its first sequence number and
two timestamps), and its process set's count of completed collectives grows by the batch's
length. Nothing runs per tensor. Collectives still in flight are read, when asked, from the
engine's own table of in-flight entries.

Sequence numbers count per process set, from 1. A completed collective's number is its place in
the order collectives complete, which is the same on every member (they run the same batches in
the same order). A collective in flight gets the next numbers in the order this rank submitted
them (the in-flight table keeps submission order): ranks that submit the same collectives give
them the same numbers, so a rank in allreduce 'grad.b' (seq 1235) while the others wait in
'grad.a' (seq 1235) is a desync, not a late rank.

A snapshot is plain data (``horovod.common.plain``), the same on the device plane as on the host
path (both complete through ``BatchRunner.run_batch``)::

    {"done": [[seq, process set, op, name, dtype, shapes, age_s, ran_s], ...],   # oldest first
     "in_flight": [[seq, process set, op, name, dtype, shapes, state, age_s], ...]}  # by seq

``state`` is ``submitted`` (queued or being negotiated), ``negotiated`` (its response is known,
from the cache or the coordinator, and it waits for the other ranks to be ready) or ``running``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence
from typing import Any

from horovod.common import protocol
from horovod.common.engine.observers import Observer
from horovod.common.types import Response

__all__ = ["FlightRecorder", "flight_record", "describe", "format_record", "DEFAULT_SIZE"]

DEFAULT_SIZE = 1024

# Entry.state values of the engine (rounds.py): DONE, CACHED, NEW, SENT.
_STATES = {0: "running", 1: "negotiated", 2: "submitted", 3: "submitted"}


class FlightRecorder(Observer):
    """A bounded ring of this rank's completed batches, and its count of completed collectives
    per process set: an observer of the engine's batches (``observers.py``)."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self.size = max(1, int(size))
        self.completed: dict[int, int] = {}  # process set id -> collectives completed
        # One record per completed batch, at most ``size`` batches (a batch holds one or more
        # collectives, so the ring always holds the last ``size`` collectives, and may hold more).
        self._ring: collections.deque[tuple[Sequence[Response], int, float, float]] = \
            collections.deque(maxlen=self.size)

    def batch_run(self, kind: Any, batch: Sequence[Response], entries: Sequence[Any], t0: float,
                  t1: float) -> None:
        self.batch_done(batch, t0, t1)

    def batch_done(self, batch: Sequence[Response], t_start: float, t_end: float) -> None:
        """A batch (one process set's) completed on this rank (once per batch: keep it cheap)."""
        completed = self.completed
        ps = batch[0].request.process_set_id
        first = completed.get(ps, 0) + 1
        completed[ps] = first - 1 + len(batch)
        self._ring.append((batch, first, t_start, t_end))

    def clear(self) -> None:
        self._ring.clear()

    def done(self, now: float, last: int | None = None) -> list[list[Any]]:
        """The completed collectives, oldest first (the last ``last`` of them, or all kept)."""
        limit = self.size if last is None else min(last, self.size)
        out: list[list[Any]] = []
        if limit <= 0:
            return out
        for batch, first, t_start, t_end in reversed(list(self._ring)):  # list(): one C call
            for i in range(len(batch) - 1, -1, -1):
                req = batch[i].request
                out.append([first + i, req.process_set_id, req.kind.value, req.name, req.dtype,
                            [list(s) for s in req.shapes], round(now - t_end, 3), round(t_end - t_start, 6)])
                if len(out) >= limit:
                    return out[::-1]
        return out[::-1]

    def in_flight(self, entries: Iterable[Any], queued: set[int], now: float,
                  last: int | None = None) -> list[list[Any]]:
        """Entries submitted and not yet completed, in submission order (``TensorQueue.in_flight``),
        numbered after the completed ones of their process set; ``queued``: ids of entries no
        round has taken yet."""
        return in_flight_rows(entries, queued, now, self.completed, last)


def flight_record(flight: FlightRecorder | None, snapshot: tuple[list[Any], set[int]], now: float,
                  done: int | None, in_flight: int | None) -> dict[str, Any]:
    """A rank's flight record: the last ``done`` completed collectives (all kept: None) and the
    first ``in_flight`` in-flight ones (all: None), from the queue's ``snapshot`` (in-flight
    entries, ids of the queued ones) at ``now`` (the engine's clock)."""
    entries, queued = snapshot
    if flight is None:
        return {"done": [], "in_flight": in_flight_rows(entries, queued, now, {}, in_flight)}
    return {"done": flight.done(time.perf_counter(), done),
            "in_flight": flight.in_flight(entries, queued, now, in_flight)}


def in_flight_rows(entries: Iterable[Any], queued: set[int], now: float, completed: dict[int, int],
                   last: int | None = None) -> list[list[Any]]:
    """``FlightRecorder.in_flight`` (with ``completed`` counts; {} when the recorder is off)."""
    out = []
    nth: dict[int, int] = {}
    for e in entries:
        req = e.request
        ps = req.process_set_id
        k = nth[ps] = nth.get(ps, 0) + 1
        if last is not None and k > last:  # past the first ``last`` of its process set: not shown
            continue
        state = "submitted" if id(e) in queued else _STATES.get(e.state, "submitted")
        out.append([completed.get(ps, 0) + k, ps, req.kind.value, req.name, req.dtype,
                    [list(s) for s in req.shapes], state, round(now - e.t_submit, 3)])
    out.sort(key=lambda r: (r[1], r[0]))
    return out if last is None else out[:last]


# how a collective and a flight record read: the protocol's, shared with the monitor
describe = protocol.describe_collective
format_record = protocol.flight_record_lines
