"""Stall inspector: explain collectives that some ranks submitted and others did not. PURE.

The coordinator (rank 0) calls ``StallInspector.check`` with the stalled names of its message
table, at most about once a second; the inspector decides, from an injected clock, when a report
is due (once per ``HOROVOD_STALL_CHECK_TIME_SECONDS`` while the stall lasts) and when the stall has
lasted long enough to shut the job down. The engine then asks every rank where it is
(``diagnosis.answer``, through its rounds) and ``explain`` turns the answers into the report: for
each stalled name, the ranks that submitted it and for how long, and for each rank that did not,
whether it is in another collective (a desync) or in none, its main thread's stack and its last
completed and in-flight collectives (``flight.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from horovod.common.engine.diagnosis import format_stack
from horovod.common.engine.flight import describe, format_record

__all__ = ["Stalled", "StallDecision", "StallInspector", "explain", "ranks_text"]

_MAX_NAMES = 6
_MAX_DETAILED = 4  # missing ranks shown with their stacks, per stalled name


@dataclass(frozen=True)
class Stalled:
    """One name the coordinator has waited on: who submitted it, who did not, for how long."""

    name: str
    op: str
    process_set: int
    submitted: list[int]
    missing: list[int]
    age: float


@dataclass(frozen=True)
class StallDecision:
    """A report is due for ``stalled`` (and Horovod shuts down after it when ``shutdown``)."""

    stalled: list[Stalled]
    shutdown: bool

    @property
    def missing(self) -> list[int]:
        return sorted({r for s in self.stalled for r in s.missing})


class StallInspector:
    """Decide when to look for stalls, when to report them, and when to shut down.

    Args:
        warn_after: ``HOROVOD_STALL_CHECK_TIME_SECONDS``: age at which a waiting name is reported,
            also the period between reports while it keeps waiting.
        shutdown_after: ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (0: never shut down).
        clock: monotonic clock.
    """

    def __init__(self, warn_after: float, shutdown_after: float, clock: Callable[[], float]) -> None:
        self.warn_after = warn_after
        self.shutdown_after = shutdown_after if shutdown_after > warn_after else 0.0
        self._clock = clock
        self._next_check = clock() + min(warn_after, 1.0)
        self._next_report = 0.0

    def due(self) -> bool:
        """True when it is time to look at the message table again (cheap; call every round)."""
        return self._clock() >= self._next_check

    def check(self, stalled: Sequence[Stalled]) -> StallDecision | None:
        """A decision when a report is due: the first time names are older than the warning time,
        then once per warning period while any is, and when one passes the shutdown time."""
        now = self._clock()
        self._next_check = now + min(self.warn_after, 1.0)  # often enough for the shutdown limit
        relevant = [s for s in stalled if s.age >= self.warn_after and s.missing]
        if not relevant:
            self._next_report = 0.0  # a later stall is reported as soon as it is old enough
            return None
        shutdown = self.shutdown_after > 0 and any(s.age >= self.shutdown_after for s in relevant)
        if not shutdown and now < self._next_report:
            return None
        self._next_report = now + self.warn_after
        return StallDecision(relevant, shutdown)


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 2``, ``ranks 0-1``, ``ranks 0, 2-5``."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts = []
    start = prev = rs[0]
    for r in rs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)


def _row(answer: dict[str, Any] | None, name: str, ps: int) -> list[Any] | None:
    """The in-flight row of ``name`` in a rank's answer."""
    for row in (answer or {}).get("in_flight", []):
        if row[3] == name and row[1] == ps:
            return row
    return None


def _who(rank: int, answer: dict[str, Any] | None) -> str:
    if answer is None:
        return f"rank {rank}"
    return f"rank {rank} (host {answer['host']}, pid {answer['pid']})"


def explain(decision: StallDecision, answers: dict[int, dict[str, Any]], warn_after: float,
            shutdown_after: float) -> str:
    """The stall report: ``answers[rank]`` is each rank's ``diagnosis.answer`` (ranks absent
    from it did not answer)."""
    # The majority's view first: in a desync, the name most ranks wait in.
    stalled = sorted(decision.stalled, key=lambda s: (-len(s.submitted), -s.age))
    n = len(stalled)
    head = (f"Stall: {n} collective{'s' if n > 1 else ''} waited more than {warn_after:g} s for "
            "some ranks (HOROVOD_STALL_CHECK_TIME_SECONDS).")
    if decision.shutdown:
        head += (f" Horovod shuts down: a collective waited more than {shutdown_after:g} s "
                 "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).")
    elif shutdown_after > 0:
        head += f" Horovod shuts down when one has waited {shutdown_after:g} s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)."
    lines = [head]
    detailed: set[int] = set()
    covered: set[tuple[str, str]] = set()  # desyncs said: (name waited in, name the others are in)
    gist: list[str] = []
    for s in stalled[:_MAX_NAMES]:
        rows = {r: _row(answers.get(r), s.name, s.process_set) for r in s.submitted}
        seqs = sorted({row[0] for row in rows.values() if row is not None})
        seq = seqs[0] if seqs else 0
        waits = [row[7] for row in rows.values() if row is not None]
        waited = (f"for {max(waits):.1f} s" if len(set(round(w) for w in waits)) <= 1 else
                  f"for {min(waits):.1f}-{max(waits):.1f} s") if waits else f"for {s.age:.1f} s"
        this = describe(s.op, s.name, seq, s.process_set)
        lines.append(f"{this}: {ranks_text(s.submitted)} submitted it and "
                     f"{'wait' if len(s.submitted) > 1 else 'waits'} {waited}; "
                     f"{ranks_text(s.missing)} did not submit it.")
        for r in s.missing[:_MAX_DETAILED]:
            a = answers.get(r)
            if a is None:
                lines.append(f"  rank {r} did not answer: it is stopped, holds the GIL, or its "
                             "process is blocked outside Python.")
                gist.append(f"rank {r} did not answer")
                continue
            mine = [row for row in a.get("in_flight", []) if row[1] == s.process_set]
            if mine:
                other = mine[0]
                if (other[3], s.name) in covered:
                    lines.append(f"  rank {r} is in {describe(other[2], other[3], other[0], other[1])}: "
                                 "the other side of the desync above.")
                    continue
                covered.add((s.name, other[3]))
                said = (f"rank {r} is in {describe(other[2], other[3], other[0], other[1])} while "
                        f"{ranks_text(s.submitted)} {'wait' if len(s.submitted) > 1 else 'waits'} in {this}")
                lines.append(f"  Desync: {said}: the ranks submit different collectives (every rank "
                             "must run the same collectives in the same order).")
                gist.append(f"desync: {said}")
            else:
                where = f"its main thread is in {a['where']}"
                lines.append(f"  {_who(r, a)} is in no collective: {where}.")
                gist.append(f"rank {r} is in no collective ({where}) while {ranks_text(s.submitted)} "
                            f"{'wait' if len(s.submitted) > 1 else 'waits'} in {this}")
            if r in detailed:
                lines.append(f"  (rank {r}'s stack and flight record: above)")
                continue
            detailed.add(r)
            lines.append(f"  {_who(r, a)} main thread (most recent call last):")
            lines.extend(format_stack(a.get("stack"), "    "))
            lines.append(f"  rank {r}'s flight record (last completed, then in flight):")
            lines.extend(format_record(a, "    "))
        if len(s.missing) > _MAX_DETAILED:
            lines.append(f"  ... and {len(s.missing) - _MAX_DETAILED} more missing ranks")
    if n > _MAX_NAMES:
        lines.append(f"... and {n - _MAX_NAMES} more stalled collectives")
    # Upstream's summary, which scripts may look for.
    missing: dict[int, list[str]] = {}
    over: set[int] = set()
    for s in stalled:
        for r in s.missing:
            missing.setdefault(r, []).append(s.name)
            if shutdown_after > 0 and s.age >= shutdown_after:
                over.add(r)
    lines.append("Missing ranks:")
    for r in sorted(missing):
        names = missing[r]
        shown = ", ".join(names[:_MAX_NAMES]) + (" ..." if len(names) > _MAX_NAMES else "")
        lines.append(f"{r}{'!' if r in over else ''}: [{shown}]")
    if over:
        lines.append("Ranks marked with '!' exceeded the shutdown limit.")
    if gist:
        lines.append("In short: " + "; ".join(gist[:3]) + ("; ..." if len(gist) > 3 else "") + ".")
    return "\n".join(lines)
