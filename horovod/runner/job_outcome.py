"""How a job ended, whichever launcher ran it, and the one text that reports its failure.

``horovodrun``'s processes (static: ``Supervisor``; elastic: the elastic session),
``horovod.run``'s functions, ``horovod.spark.run``'s Spark tasks and a static ``RayExecutor``'s
actors all end in a :class:`JobOutcome`: how every rank's process ended (``failures.RankExit``),
what every rank's function returned or raised, or that it was lost (``protocol.WorkerOutcome``),
the exit status, and the ranks still running when the job was given up. The monitor shows it
(``horovod.runner.monitor.record_result``), ``horovodrun`` prints :meth:`JobOutcome.report`, and a
function job's caller gets :meth:`JobOutcome.values` or the ``WorkerFailedError`` of
:meth:`JobOutcome.error`.

The failed ranks are ordered by the one root-cause rule (``failures.root_cause``) over their exits,
a raised exception counting as the exit record it makes (``failures.exception_record``) and a lost
rank as one killed by SIGKILL. :func:`format_failure` writes the one report: the root cause with
its place, exception (or how it was lost), exit status, error and the last lines of its stderr;
every other failed rank; the ranks that did not finish; the root cause's traceback.
"""

from __future__ import annotations

import dataclasses
import signal as _signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from horovod.common import protocol
from horovod.common.exceptions import WorkerFailedError
from horovod.runner.failures import (
    EXITED_NON_ZERO,
    RankExit,
    exception_record,
    format_report,
    root_cause,
    with_upstream_sentence,
)

if TYPE_CHECKING:
    from horovod.runner.elastic.driver import ElasticResult

__all__ = ["JobOutcome", "format_failure", "LOST", "first_line"]

# How a rank whose process was lost before it reported is described (``{error}``: the first line
# of how the launcher saw it); launchers that know more say it their way (Ray: its actor).
LOST = "died: {error} (its process ended: killed, out of memory, or its host was lost)"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (a Ray or Spark error's is many lines), or its type."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@dataclass
class JobOutcome:
    """How one job ended (see the module docstring).

    Attributes:
        exits: how each rank's process ended, as the launcher saw it (may be empty: a Ray call,
            or a cluster launcher that lost them).
        returncode: the exit status (0: every rank ended cleanly).
        outcomes: what each rank's function gave back, by rank (function jobs only).
        interrupted: the signal that interrupted ``horovodrun`` (``"SIGINT"``), if any.
        launcher_tail: the last stderr lines of the launcher's own process (mpirun).
        stuck: ranks still running when the job was given up after the first failure.
        seen: when the launcher saw each failed rank's outcome (seconds since the epoch), for
            ranks it has no exit of (Ray's actors); without either, failures count as
            simultaneous.
        error: why an elastic job failed (None: it did not, or the job is static).
        elastic: an elastic job's rounds and failures (``ElasticResult``); None for static jobs.
    """

    exits: list[RankExit] = field(default_factory=list)
    returncode: int = 0
    outcomes: dict[int, protocol.WorkerOutcome] = field(default_factory=dict)
    interrupted: str | None = None
    launcher_tail: list[str] = field(default_factory=list)
    stuck: list[int] = field(default_factory=list)
    seen: dict[int, float] = field(default_factory=dict)
    error: str | None = None
    elastic: ElasticResult | None = None

    # ------------------------------------------------------------------ the failure
    def cause_exits(self) -> list[RankExit]:
        """Every rank's exit (copies), with what its function raised counted as its exit record
        where it left none or only the "finished" one its process writes on a normal exit (the
        worker caught the exception), and a rank lost without an exit as killed by SIGKILL."""
        by_rank = {e.rank: dataclasses.replace(e) for e in self.exits if e.rank is not None}
        for rank, o in sorted(self.outcomes.items()):
            t = self.seen.get(rank, 0.0)
            if isinstance(o, protocol.Raised):
                e = by_rank.setdefault(rank, RankExit(rank, "", 1, None, t))
                if e.error_kind in (None, "finished"):  # a function that raised did not finish
                    e.apply_record(exception_record(o.error, e.time, e.code or 1))
            elif isinstance(o, protocol.Died):
                by_rank.setdefault(rank, RankExit(rank, "", None, int(_signal.SIGKILL), t))
        return [*by_rank.values(), *(e for e in self.exits if e.rank is None)]

    def root_cause(self) -> RankExit | None:
        """The exit of the rank whose failure started the job's end (``failures.root_cause``)."""
        if self.elastic is not None:
            first = self.elastic.root_cause()
            return None if first is None else first.as_exit()
        return root_cause(self.cause_exits())

    def failed_ranks(self) -> list[int]:
        """The ranks whose function raised or was lost, or whose process failed: the root cause
        first, then by rank."""
        bad = {r for r, o in self.outcomes.items() if isinstance(o, protocol.Raised | protocol.Died)}
        bad |= {e.rank for e in self.exits if e.rank is not None and e.failed and not e.stopped_by}
        if not bad:
            return []
        first = root_cause([e for e in self.cause_exits() if e.rank in bad])
        root = first.rank if first is not None and first.rank in bad else min(bad)
        return [root, *sorted(r for r in bad if r != root)]

    @property
    def ok(self) -> bool:
        """Every rank ended cleanly (and a function job's every function returned)."""
        return self.returncode == 0 and not self.stuck and not any(
            isinstance(o, protocol.Raised | protocol.Died) for o in self.outcomes.values())

    def values(self, num_proc: int | None = None) -> list[Any]:
        """What the ranks' functions returned, in rank order (the first ``num_proc`` ranks)."""
        ranks = sorted(self.outcomes) if num_proc is None else range(num_proc)
        return [o.value for o in (self.outcomes.get(r) for r in ranks)
                if isinstance(o, protocol.Returned)]

    def complete(self, num_proc: int) -> bool:
        """Whether each of the first ``num_proc`` ranks' functions returned."""
        return all(isinstance(self.outcomes.get(r), protocol.Returned) for r in range(num_proc))

    # ------------------------------------------------------------------ the texts
    def report(self) -> str:
        """What ``horovodrun`` prints for a failed job (empty for a job that did not fail)."""
        if self.elastic is not None:
            return _elastic_report(self) if self.error is not None else ""
        return format_report(self.exits, self.interrupted)

    def failure(self, caller: str, where: Callable[[int], str] | None = None, **wording: Any,
                ) -> WorkerFailedError:
        """The error a function job's caller gets (``format_failure``'s text), naming the root
        cause's rank (``rank``, ``host``, ``exception``: what it raised), every failed rank
        (``ranks``, root cause first) and those that did not finish (``stuck_ranks``)."""
        ranks = self.failed_ranks()
        root = ranks[0] if ranks else None
        o = self.outcomes.get(root) if root is not None else None
        exc = o.error if isinstance(o, protocol.Raised | protocol.Died) else None
        hosts = {e.rank: e.host for e in self.exits if e.rank is not None}
        err = WorkerFailedError(format_failure(self, caller, where, **wording), rank=root,
                                host=hosts.get(root) if root is not None else None,
                                exception=exc, ranks=ranks, stuck_ranks=list(self.stuck),
                                exits=self.exits)
        if isinstance(o, protocol.Raised):
            err.__cause__ = o.error
        return err

    def results(self, caller: str, num_proc: int, where: Callable[[int], str] | None = None,
                **wording: Any) -> list[Any]:
        """The values of the first ``num_proc`` ranks, in rank order.

        Raises:
            WorkerFailedError: a rank raised, was lost or failed, or a rank ended without a
                result (:meth:`failure`).
        """
        if self.ok and self.complete(num_proc):
            return self.values(num_proc)
        raise self.failure(caller, where, **wording)


def format_failure(outcome: JobOutcome, caller: str, where: Callable[[int], str] | None = None, *,
                   lost: str = LOST, lost_other: str = "died", notes: Sequence[str] = (),
                   stuck_wait: float | None = None, upstream: bool = True, tail_lines: int = 10,
                   ) -> str:
    """The one report of a failed job, for every launcher (see the module docstring).

    Args:
        outcome: how the job ended.
        caller: what the text starts with (``"horovod.run"``, ``"RayExecutor.run(f)"``).
        where: a rank's place (default: ``"rank R on host H"``, the host from its exit).
        lost: how the root cause is described when it was lost before it reported
            (``{error}``: the first line of how the launcher saw it).
        lost_other: how another lost rank is described.
        notes: the launcher's own lines (what it knows, what to do), after the ranks.
        stuck_wait: how long the stuck ranks were waited for (seconds; None: not said).
        upstream: end with upstream Horovod's "exited with non-zero status" sentence.
        tail_lines: at most this many lines of the root cause's stderr.
    """
    hosts = {e.rank: e.host for e in outcome.exits if e.rank is not None}

    def default_where(rank: int) -> str:
        return f"rank {rank} on host {hosts.get(rank) or '?'}"

    place = where or default_where
    ranks = outcome.failed_ranks()
    root = ranks[0] if ranks else None
    root_outcome = outcome.outcomes.get(root) if root is not None else None
    if not isinstance(root_outcome, protocol.Raised | protocol.Died):
        # No function raised or was lost: the processes' own report (horovodrun's).
        lines = [f"{caller}: the job failed before every rank returned a result."]
        if outcome.exits or not notes:
            lines.append(outcome.report())
        lines += [*notes, *_stuck_lines(outcome, place, stuck_wait)]
        text = "\n".join(t for t in lines if t)
        return with_upstream_sentence(text) if upstream else text
    assert root is not None
    exits = {e.rank: e for e in outcome.exits if e.rank is not None}
    if isinstance(root_outcome, protocol.Raised):
        exc = root_outcome.error
        lines = [f"{caller}: {place(root)} raised {type(exc).__name__}: {exc}"]
    else:
        lines = [f"{caller}: {place(root)} {lost.format(error=first_line(root_outcome.error))}"]
    first = exits.get(root)
    if first is not None and first.failed:  # what its process did, when the launcher saw it
        lines.append(f"  its process: {first.status}" + (f" ({first.note})" if first.note else ""))
        if first.stderr_tail and not isinstance(root_outcome, protocol.Raised):
            lines.append(f"  last {min(tail_lines, len(first.stderr_tail))} lines of its stderr:")
            lines += [f"    | {t}" for t in first.stderr_tail[-tail_lines:]]
    for rank in ranks[1:]:
        o = outcome.outcomes.get(rank)
        if isinstance(o, protocol.Raised):
            lines.append(f"  also {place(rank)}: {type(o.error).__name__}: {o.error}")
        elif isinstance(o, protocol.Died):
            lines.append(f"  also {place(rank)} {lost_other}")
        else:
            e = exits[rank]
            lines.append(f"  also {place(rank)}: {e.status}" + (f" ({e.error.splitlines()[0][:120]})"
                                                                 if e.error else ""))
    lines += _stuck_lines(outcome, place, stuck_wait)
    lines += list(notes)
    if isinstance(root_outcome, protocol.Raised) and root_outcome.traceback:
        lines.append(f"Traceback of rank {root}:\n{root_outcome.traceback.rstrip()}")
    if upstream:
        lines.append(EXITED_NON_ZERO)
    return "\n".join(lines)


def _stuck_lines(outcome: JobOutcome, place: Callable[[int], str], wait: float | None) -> list[str]:
    if not outcome.stuck:
        return []
    when = f"within {wait:g} s of" if wait is not None else "after"
    return [f"  {', '.join(place(r) for r in outcome.stuck)} did not finish {when} the failure "
            "(waiting for the failed rank in a collective)"]


def _elastic_report(outcome: JobOutcome) -> str:
    assert outcome.elastic is not None
    from horovod.runner.elastic.driver import key_name

    result = outcome.elastic
    root = result.root_cause()
    error = "" if root is None else root.as_exit().error
    first = ("" if root is None else
             f"; root cause: worker {key_name(root.key)}"
             f"{'' if root.rank is None else f' (rank {root.rank})'} {root.status}"
             f"{f': {error}' if error else ''}")
    return (f"horovodrun: elastic job failed: {outcome.error}\n"
            f"({result.rounds} round(s), {result.resets} reset(s){first})")
