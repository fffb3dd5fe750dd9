"""How a job ended, whichever launcher ran it, and the one text that reports its failure.

Every job ends in a :class:`JobOutcome`, static or elastic, whichever launcher ran it:
``horovodrun``'s processes and ``horovod.run``'s functions (static: ``Supervisor`` in the
``StaticSession``; elastic: the ``ElasticSession``), ``horovod.spark.run``'s Spark tasks and
``run_elastic``'s agents, a ``RayExecutor``'s actors (static or elastic). It holds how every
rank's process ended (``failures.RankExit``), what every rank's function returned or raised, or
that it was lost (``protocol.WorkerOutcome``), the exit status, the ranks still running when the
job was given up, and for an elastic job its rounds and worker failures (``ElasticResult``) with
what each worker's function gave back, by slot. The monitor shows it
(``horovod.runner.monitor.record_result``, ``monitor.cluster.job_failed``), ``horovodrun`` prints
:meth:`JobOutcome.report`, and a function job's caller gets :meth:`JobOutcome.values` or the
:class:`JobFailedError` of :meth:`JobOutcome.failure`, which carries the outcome.

The failed ranks are ordered by the one root-cause rule (``failures.root_cause``) over their exits,
a raised exception counting as the exit record it makes (``failures.exception_record``) and a lost
rank as one killed by SIGKILL; an elastic job's failed workers by the same rule over the driver's
failures (``ElasticResult.root_cause``). :func:`format_failure` writes the one report: the root
cause with its place, exception (or how it was lost), exit status, error and the last lines of its
stderr; every other failed rank; the ranks that did not finish; the launcher's notes; the root
cause's traceback. An elastic job's report starts with why the driver gave up, then names its
workers in the same words.
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
    from horovod.runner.elastic.driver import ElasticResult, WorkerFailure

__all__ = ["JobOutcome", "JobFailedError", "format_failure", "LOST", "first_line", "worker_place"]

# How a rank whose process was lost before it reported is described (``{error}``: the first line
# of how the launcher saw it); launchers that know more say it their way (Ray: its actor).
LOST = "died: {error} (its process ended: killed, out of memory, or its host was lost)"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (a Ray or Spark error's is many lines), or its type."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def worker_place(key: tuple[str, int], rank: int | None) -> str:
    """An elastic worker in messages: ``worker host[slot] (rank R)`` (its rank when it failed)."""
    return f"worker {key[0]}[{key[1]}]" + ("" if rank is None else f" (rank {rank})")


class JobFailedError(WorkerFailedError):
    """The ``WorkerFailedError`` a launcher raises from a job's outcome (:meth:`JobOutcome.failure`).

    Attributes (besides ``WorkerFailedError``'s ``rank``, ``host``, ``exception``, ``ranks``,
    ``stuck_ranks`` and ``exits``; an elastic job's also ``events`` and ``resets``):
        outcome: the :class:`JobOutcome` it reports (what the monitor shows).
    """

    outcome: JobOutcome


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
            Its ``outcomes`` are those of the final round's workers, by their final rank.
        workers: an elastic job's worker outcomes by slot, ``(host, local rank)`` (each slot's
            last: what its function returned or raised, or that it was lost).
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
    workers: dict[tuple[str, int], protocol.WorkerOutcome] = field(default_factory=dict)

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
        first, then by rank (an elastic job: its failed workers' ranks as they failed, in the
        order of :meth:`failed_workers`)."""
        if self.elastic is not None:
            return list(dict.fromkeys(r for _, r, _, _ in self.failed_workers() if r is not None))
        bad = {r for r, o in self.outcomes.items() if isinstance(o, protocol.Raised | protocol.Died)}
        bad |= {e.rank for e in self.exits if e.rank is not None and e.failed and not e.stopped_by}
        if not bad:
            return []
        first = root_cause([e for e in self.cause_exits() if e.rank in bad])
        root = first.rank if first is not None and first.rank in bad else min(bad)
        return [root, *sorted(r for r in bad if r != root)]

    def failed_workers(self) -> list[tuple[tuple[str, int], int | None, WorkerFailure | None,
                                         protocol.WorkerOutcome | None]]:
        """An elastic job's failed workers as ``(slot, rank, failure, outcome)``: the root cause
        first (``ElasticResult.root_cause``), then the other failures in the order the driver saw
        them, then workers whose function raised or was lost without a failure the driver
        counted (stopped meanwhile: their last rank); one row per slot (its last failure, its
        last outcome). Empty for static jobs."""
        if self.elastic is None:
            return []
        last: dict[tuple[str, int], WorkerFailure] = {}
        for f in self.elastic.failures:
            last.pop(f.key, None)
            last[f.key] = f
        root = self.elastic.root_cause()
        keys = list(last)
        if root is not None:
            keys.remove(root.key)
            keys.insert(0, root.key)
            last[root.key] = root
        keys += [k for k, o in self.workers.items()
                 if k not in last and isinstance(o, protocol.Raised | protocol.Died)]
        ranks = self.elastic.ranks
        return [(k, last[k].rank if k in last else ranks.get(k), last.get(k), self.workers.get(k))
                for k in keys]

    @property
    def ok(self) -> bool:
        """Every rank ended cleanly (and a function job's every function returned; an elastic
        job: the driver did not give up)."""
        return self.returncode == 0 and self.error is None and not self.stuck and not any(
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
                ) -> JobFailedError:
        """The error a function job's caller gets (``format_failure``'s text), naming the root
        cause's rank (``rank``, ``host``, ``exception``: what it raised or how it was lost),
        every failed rank (``ranks``, root cause first) and those that did not finish
        (``stuck_ranks``), and carrying this outcome (``outcome``)."""
        text = format_failure(self, caller, where, **wording)
        ranks = self.failed_ranks()
        fields: dict[str, Any] = {}
        if self.elastic is not None:
            workers = self.failed_workers()
            root, host, o = ((workers[0][1], workers[0][0][0], workers[0][3]) if workers
                             else (None, None, None))
            exits = [f.as_exit() for f in self.elastic.failures]
            fields = {"events": list(self.elastic.events), "resets": self.elastic.resets}
        else:
            root = ranks[0] if ranks else None
            o = self.outcomes.get(root) if root is not None else None
            host = next((e.host for e in self.exits if root is not None and e.rank == root), None)
            exits = self.exits
        exc = o.error if isinstance(o, protocol.Raised | protocol.Died) else None
        err = JobFailedError(text, rank=root, host=host, exception=exc, ranks=ranks,
                             stuck_ranks=list(self.stuck), exits=exits, outcome=self, **fields)
        if isinstance(o, protocol.Raised):
            err.__cause__ = o.error
        return err

    def results(self, caller: str, num_proc: int, where: Callable[[int], str] | None = None,
                **wording: Any) -> list[Any]:
        """The values of the first ``num_proc`` ranks, in rank order.

        Raises:
            JobFailedError: a rank raised, was lost or failed, or a rank ended without a
                result (:meth:`failure`).
        """
        if self.ok and self.complete(num_proc):
            return self.values(num_proc)
        raise self.failure(caller, where, **wording)


# ---------------------------------------------------------------------- one rank's words
# The same words for a rank of a static job and a worker of an elastic one ("place": how the
# launcher names it).
def _raised(place: str, exc: BaseException) -> str:
    return f"{place} raised {type(exc).__name__}: {exc}"


def _lost(place: str, lost: str, exc: BaseException) -> str:
    return f"{place} {lost.format(error=first_line(exc))}"


def _also(place: str, o: protocol.WorkerOutcome | None, status: str, error: str,
          lost_other: str) -> str:
    """Another failed rank: what it raised, that it was lost, or how its process ended."""
    if isinstance(o, protocol.Raised):
        return f"  also {place}: {type(o.error).__name__}: {o.error}"
    if isinstance(o, protocol.Died):
        return f"  also {place} {lost_other}"
    return f"  also {place}: {status}" + (f" ({error.splitlines()[0][:120]})" if error else "")


def _worker_cause(failure: WorkerFailure | None, o: protocol.WorkerOutcome | None, place: str,
                  lost: str) -> str:
    """An elastic job's root-cause worker: what its function raised, that it was lost, or how
    its process ended and the error it recorded."""
    if isinstance(o, protocol.Raised):
        return _raised(place, o.error)
    if isinstance(o, protocol.Died):
        return _lost(place, lost, o.error)
    assert failure is not None
    error = failure.as_exit().error
    return f"{place} {failure.status}" + (f": {error}" if error else "")


def format_failure(outcome: JobOutcome, caller: str, where: Callable[[int], str] | None = None, *,
                   lost: str = LOST, lost_other: str = "died", notes: Sequence[str] = (),
                   stuck_wait: float | None = None, upstream: bool = True, tail_lines: int = 10,
                   ) -> str:
    """The one report of a failed job, for every launcher (see the module docstring).

    Args:
        outcome: how the job ended.
        caller: what the text starts with (``"horovod.run"``, ``"RayExecutor.run(f)"``).
        where: a rank's place (default: ``"rank R on host H"``, the host from its exit); an
            elastic job's workers are named by slot and rank (``worker_place``).
        lost: how the root cause is described when it was lost before it reported
            (``{error}``: the first line of how the launcher saw it).
        lost_other: how another lost rank is described.
        notes: the launcher's own lines (what it knows, what to do), after the ranks.
        stuck_wait: how long the stuck ranks were waited for (seconds; None: not said).
        upstream: end with upstream Horovod's "exited with non-zero status" sentence (an elastic
            job's report ends with it when the driver's reason does: a worker exited non-zero).
        tail_lines: at most this many lines of the root cause's stderr.
    """
    if outcome.elastic is not None:
        return _elastic_failure(outcome, caller, lost, lost_other, notes)
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
        lines = [f"{caller}: {_raised(place(root), root_outcome.error)}"]
    else:
        lines = [f"{caller}: {_lost(place(root), lost, root_outcome.error)}"]
    first = exits.get(root)
    if first is not None and first.failed:  # what its process did, when the launcher saw it
        lines.append(f"  its process: {first.status}" + (f" ({first.note})" if first.note else ""))
        if first.stderr_tail and not isinstance(root_outcome, protocol.Raised):
            lines.append(f"  last {min(tail_lines, len(first.stderr_tail))} lines of its stderr:")
            lines += [f"    | {t}" for t in first.stderr_tail[-tail_lines:]]
    for rank in ranks[1:]:
        e = exits.get(rank)
        lines.append(_also(place(rank), outcome.outcomes.get(rank), e.status if e else "",
                           e.error if e else "", lost_other))
    lines += _stuck_lines(outcome, place, stuck_wait)
    lines += list(notes)
    if isinstance(root_outcome, protocol.Raised) and root_outcome.traceback:
        lines.append(f"Traceback of rank {root}:\n{root_outcome.traceback.rstrip()}")
    if upstream:
        lines.append(EXITED_NON_ZERO)
    return "\n".join(lines)


def _elastic_failure(outcome: JobOutcome, caller: str, lost: str, lost_other: str,
                     notes: Sequence[str]) -> str:
    """An elastic job's report: why the driver gave up, its rounds, then its workers in the words
    of a static job's ranks (the root cause first)."""
    result = outcome.elastic
    assert result is not None
    reason = outcome.error or result.error or "a worker of the final round did not return a result"
    # The driver ends its reason with upstream's sentence when a worker exited non-zero: it goes
    # last, as in a static job's report (and only then: upstream's flag has no say here).
    exited = EXITED_NON_ZERO in reason
    first, *more = reason.replace(EXITED_NON_ZERO, "").strip().splitlines() or [""]
    lines = [f"{caller}: the elastic job failed: {first}", *(f"  {t}" for t in more if t.strip()),
             f"  ({result.rounds} round(s), {result.resets} reset(s))"]
    workers = outcome.failed_workers()
    for i, (key, rank, failure, o) in enumerate(workers):
        place = worker_place(key, rank)
        if i == 0:
            lines.append(f"  root cause: {_worker_cause(failure, o, place, lost)}")
        else:
            e = failure.as_exit() if failure is not None else None
            lines.append(_also(place, o, e.status if e else "", e.error if e else "", lost_other))
    lines += list(notes)
    if workers and isinstance(workers[0][3], protocol.Raised) and workers[0][3].traceback:
        key, rank = workers[0][0], workers[0][1]
        lines.append(f"Traceback of {worker_place(key, rank)}:\n{workers[0][3].traceback.rstrip()}")
    if exited:
        lines.append(EXITED_NON_ZERO)
    return "\n".join(lines)


def _stuck_lines(outcome: JobOutcome, place: Callable[[int], str], wait: float | None) -> list[str]:
    if not outcome.stuck:
        return []
    when = f"within {wait:g} s of" if wait is not None else "after"
    return [f"  {', '.join(place(r) for r in outcome.stuck)} did not finish {when} the failure "
            "(waiting for the failed rank in a collective)"]


def _elastic_report(outcome: JobOutcome) -> str:
    """What ``horovodrun`` prints for a failed elastic job: the driver's reason, the rounds, and
    the root-cause worker in the words of ``format_failure``."""
    assert outcome.elastic is not None
    result = outcome.elastic
    workers = outcome.failed_workers()
    first = ""
    if workers:
        key, rank, failure, o = workers[0]
        first = f"; root cause: {_worker_cause(failure, o, worker_place(key, rank), LOST)}"
    return (f"horovodrun: elastic job failed: {outcome.error}\n"
            f"({result.rounds} round(s), {result.resets} reset(s){first})")
