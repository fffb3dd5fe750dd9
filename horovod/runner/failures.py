"""Per-rank exit records and the failure report ``horovodrun`` prints when a job fails.

The report names the root cause first: its host, local rank, exit code or signal, the error it
raised and the last lines of its stderr. Then one line per other rank that did not finish
cleanly, saying whether it failed by itself, only because a peer left, or was stopped.

The root cause is decided by cause, not by timing alone: a rank whose Horovod program recorded
an error of its own (the exit record, see ``horovod/common/lifecycle.py``) comes before ranks
whose error only says that a peer left (``HorovodShutdownError``, ``HorovodInternalError``),
whichever ended first. A rank whose program ended normally (record kind ``"finished"``) before
the others' collectives failed is named as having exited early, with the collective each of the
others waited in.
"""

from __future__ import annotations

import signal as _signal
import time as _time
from dataclasses import dataclass, field

from horovod.common.protocol import FailureRecord

__all__ = ["RankExit", "root_cause", "early_exit", "describe_early_exit",
           "exception_record", "format_report", "describe_status", "EXITED_NON_ZERO",
           "RESET_LIMIT_EXCEEDED", "with_upstream_sentence"]

# Upstream Horovod's sentences, which log-scraping tools and upstream's tests look for: every failed
# job's report keeps them, after our own more precise text.
EXITED_NON_ZERO = ("Horovod detected that one or more processes exited with non-zero status, "
                   "thus causing the job to be terminated.")
RESET_LIMIT_EXCEEDED = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"


def with_upstream_sentence(text: str) -> str:
    """``text`` followed by upstream's "exited with non-zero status" sentence, unless it has it."""
    return text if EXITED_NON_ZERO[:60] in text else f"{text}\n{EXITED_NON_ZERO}"


def describe_status(code: int | None, signum: int | None) -> str:
    if code is None and not signum:
        return "ended without an exit report"
    if signum:
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {signum} ({name})"
    return f"exit code {code}"


@dataclass
class RankExit:
    """How one rank ended.

    Attributes:
        rank: the global rank (None for mpirun's own exit when no rank reported).
        host: the host from the launch plan (or the reporting host).
        code: the exit code, or None when killed by a signal.
        signal: the signal number that killed it, or None.
        time: when it ended (seconds since the epoch, the worker host's clock when reported).
        stopped_by: why the launcher (or mpirun) stopped it, None when it ended by itself.
        stderr_tail: the last lines it wrote to stderr.
        local_rank: its local rank, when known.
        note: extra context (for example that no exit report arrived).
        error: the error the rank's program recorded as it failed ("RuntimeError: ...").
        error_kind: "cause" (an error of its own), "consequence" (raised because a peer left),
            "finished" (its program ended normally, at ``error_time``), or None when the program
            recorded nothing (not a Horovod program, killed, ...).
        waiting: the collective a "consequence" came from ("broadcast 'name'"), where known.
        error_time: when the program recorded the error (the worker host's clock).
        error_code: the exit code the recorded error gave.
        hung: an elastic worker that did not rejoin its peers in time (the driver stopped it).
    """

    rank: int | None
    host: str
    code: int | None
    signal: int | None
    time: float
    stopped_by: str | None = None
    stderr_tail: list[str] = field(default_factory=list)
    local_rank: int | None = None
    note: str = ""
    error: str = ""
    error_kind: str | None = None
    error_time: float | None = None
    error_code: int | None = None
    hung: bool = False
    waiting: str = ""

    @classmethod
    def with_record(cls, record: FailureRecord | None, *args: object, **kwargs: object) -> RankExit:
        """A RankExit with the fields of a worker's exit record (None: it left none)."""
        e = cls(*args, **kwargs)  # type: ignore[arg-type]
        e.apply_record(record)
        return e

    def apply_record(self, record: FailureRecord | None) -> None:
        """Take the error kind, text, time and code from a worker's exit record (None: none)."""
        if record is not None:
            self.error_kind, self.error, self.error_time = record.kind, record.error, record.time
            self.error_code = record.code or None
            self.waiting = record.waiting
            if record.kind == "finished":
                self.error = ""
            if self.error_kind == "cause" and self.error_code is not None and (
                    self.stopped_by or (self.code is None and not self.signal)):
                self.note = ("it failed with the error below, then did not exit by itself; "
                             "stopped on its way out")
                if self.code is None and not self.signal:
                    self.code = self.error_code

    @property
    def failed(self) -> bool:
        return self.hung or bool(self.signal) or (self.code is not None and self.code != 0)

    @property
    def status(self) -> str:
        if self.hung and self.code is None and not self.signal:
            return "hung"
        return describe_status(self.code, self.signal)

    @property
    def exit_status(self) -> int:
        """The exit status a shell would show: the code, or 128 + signal.

        A rank that recorded an error of its own, then hung on the way out and was stopped,
        counts with the code its error gave (not the signal that stopped it); a rank whose
        program ended normally counts with 0, even if it was stopped on its way out.
        """
        if self.error_kind == "finished":  # its program ended with 0 (a job it ends fails with 1)
            return 0
        if self.error_kind == "cause" and self.error_code and (
                self.stopped_by or (self.code is None and not self.signal)):
            return self.error_code
        if self.signal:
            return 128 + self.signal
        return self.code or 0

    def where(self) -> str:
        lr = f", local rank {self.local_rank}" if self.local_rank is not None else ""
        who = f"rank {self.rank}" if self.rank is not None else "mpirun"
        return f"{who} (host {self.host}{lr})"


def exception_record(exc: BaseException, time: float, code: int = 1) -> FailureRecord:
    """The exit record of a rank whose function raised ``exc``, for launchers that get the
    exception itself (``horovod.run``, Spark, Ray): the record a program leaves
    (``horovod/common/lifecycle.py``), its kind decided by the same rule."""
    from horovod.common.lifecycle import classify

    return FailureRecord(code, classify(exc), f"{type(exc).__name__}: {exc}", time)


# Failures this close to the first one count as simultaneous (each worker host's shim notices
# its worker's end after a scheduling delay of its own).
SIMULTANEOUS_SECONDS = 0.5


def root_cause(exits: list[RankExit]) -> RankExit | None:
    """The rank whose failure started the job's end.

    1. A rank whose program recorded an error of its own (``error_kind == "cause"``) comes first,
       the earliest recorded; one the launcher stopped counts only if its error came before the
       first rank ended by itself (it failed, then hung on the way out).
       Next, a rank whose program ended normally (``"finished"``) before the first failure whose
       error only says that a peer left: it exited early, while the others still waited for it
       in a collective (whether it then exited 0 or was stopped on its way out).
    2. Otherwise the failure that came first among those the launcher did not cause itself,
       leaving out ranks whose error only says that a peer left while another rank failed
       otherwise. Among failures within ``SIMULTANEOUS_SECONDS`` of the first, one killed by a
       signal is preferred: a rank that loses a peer exits with an error code (a transport error,
       an MPI abort), while the peer that vanished was killed (out of memory, a crash, ``kill -9``).
    """
    failed = [e for e in exits if e.failed]
    own = [e for e in failed if not e.stopped_by]
    first_end = min((e.time for e in own), default=float("inf"))
    # (a rank that recorded an error failed, even when mpirun stopped it before it could report)
    causes = [e for e in exits if e.error_kind == "cause" and e.code != 0 and (
        not e.stopped_by or (e.error_time is not None and e.error_time <= first_end))]
    if causes:
        return min(causes, key=lambda e: (e.error_time if e.error_time is not None else e.time,
                                          e.rank if e.rank is not None else -1))
    left = early_exit(exits)
    if left is not None:
        return left
    primary = [e for e in own if e.error_kind != "consequence"] or own
    if primary:
        t0 = min(e.time for e in primary)
        near = [e for e in primary if e.time <= t0 + SIMULTANEOUS_SECONDS]
        return min(near, key=lambda e: (not e.signal, e.time,
                                        e.rank if e.rank is not None else -1))
    return min(failed, key=lambda e: e.time) if failed else None


def early_exit(exits: list[RankExit]) -> RankExit | None:
    """The rank that ended its program normally while the others still waited for it in a
    collective (the first such), or None."""
    waited = [e for e in exits if e.failed and e.error_kind == "consequence"]
    if not waited:
        return None
    t0 = min(e.error_time if e.error_time is not None else e.time for e in waited)
    early = [e for e in exits if e.error_kind == "finished" and e.error_time is not None
             and e.error_time <= t0]
    return min(early, key=lambda e: (e.error_time, e.rank if e.rank is not None else -1)) if early else None


def _clock(t: float | None) -> str:
    return "?" if t is None else _time.strftime("%H:%M:%S", _time.localtime(t))


def describe_early_exit(first: RankExit, exits: list[RankExit]) -> str:
    """"rank 1 exited with code 0 at 12:01:05 while rank 0 waited in broadcast 'x'"."""
    waits = [e for e in sorted(exits, key=lambda e: (e.rank is None, e.rank or 0))
             if e is not first and e.failed and e.error_kind == "consequence"]
    what = "; ".join(f"rank {e.rank} waited in {e.waiting}" if e.waiting else
                     f"rank {e.rank} still waited in a collective" for e in waits)
    who = f"rank {first.rank}" if first.rank is not None else "a rank"
    return (f"{who} exited with code 0 at {_clock(first.error_time)} while {what or 'others still ran'}"
            + (f" (it was then stopped on its way out: {first.stopped_by})" if first.stopped_by else ""))


def format_report(exits: list[RankExit], interrupted: str | None = None,
                  tail_lines: int = 10) -> str:
    """The text ``horovodrun`` prints (and ``WorkerFailedError`` carries) for a failed job."""
    first = root_cause(exits)
    lines: list[str] = []
    if interrupted and (first is None or first.stopped_by):
        lines.append(f"horovodrun: the job was interrupted ({interrupted}); all workers were stopped.")
    elif first is not None and first.error_kind == "finished":
        lines.append(f"{EXITED_NON_ZERO} It was caused by a rank that exited early:")
        lines.append(f"  {describe_early_exit(first, exits)}.")
        lines.append(f"  {first.where()} ended its program normally while the others still submitted "
                     "collectives it never joined: every rank must submit the same collectives "
                     "(call it on every rank, e.g. consolidate_state_dict()), or the others must "
                     "not wait for it.")
    elif first is not None:
        lines.append(f"{EXITED_NON_ZERO} The first process to do so was:")
        lines.append(f"  {first.where()}: {first.status}"
                     + (f" ({first.note})" if first.note else ""))
        if first.error:
            lines.append(f"  error: {first.error}")
        if first.stderr_tail:
            lines.append(f"  last {min(tail_lines, len(first.stderr_tail))} lines of its stderr:")
            lines += [f"    | {t}" for t in first.stderr_tail[-tail_lines:]]
        else:
            lines.append("  (it wrote nothing to stderr)")
    others = [e for e in sorted(exits, key=lambda e: (e.rank is None, e.rank or 0))
              if e is not first and (e.failed or e.stopped_by)]
    if others:
        lines.append("Other ranks:")
        for e in others:
            if e.stopped_by:
                how = f"{e.status}, stopped after the first failure ({e.stopped_by})"
            elif e.error_kind == "consequence":
                where = f" in {e.waiting}" if e.waiting else ""
                how = f"{e.status}, because a peer left{where} ({e.error.splitlines()[0][:120]})"
            else:
                how = f"{e.status} (after the first failure)" if first else e.status
            lines.append(f"  {e.where()}: {how}" + (f" ({e.note})" if e.note else ""))
    return "\n".join(lines)
