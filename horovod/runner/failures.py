"""Per-rank exit records and the failure report ``horovodrun`` prints when a job fails.

The report names the root cause first (the rank that failed first, by the time its shim saw it
end): its host, local rank, exit code or signal, and the last lines of its stderr. Then one line
per other rank that did not finish cleanly, saying whether it failed by itself or was stopped.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass, field

__all__ = ["RankExit", "root_cause", "format_report", "describe_status"]


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

    @property
    def failed(self) -> bool:
        return bool(self.signal) or (self.code is not None and self.code != 0)

    @property
    def status(self) -> str:
        return describe_status(self.code, self.signal)

    @property
    def exit_status(self) -> int:
        """The exit status a shell would show: the code, or 128 + signal."""
        if self.signal:
            return 128 + self.signal
        return self.code or 0

    def where(self) -> str:
        lr = f", local rank {self.local_rank}" if self.local_rank is not None else ""
        who = f"rank {self.rank}" if self.rank is not None else "mpirun"
        return f"{who} (host {self.host}{lr})"


# Failures this close to the first one count as simultaneous (each worker host's shim notices
# its worker's end after a scheduling delay of its own).
SIMULTANEOUS_SECONDS = 0.5


def root_cause(exits: list[RankExit]) -> RankExit | None:
    """The failure that came first among those the launcher did not cause itself.

    When several ranks fail within ``SIMULTANEOUS_SECONDS`` of the first, one killed by a signal
    is preferred: a rank that loses a peer exits with an error code (a transport error, an MPI
    abort), while the peer that vanished was killed (out of memory, a crash, ``kill -9``).
    """
    own = [e for e in exits if e.failed and not e.stopped_by]
    if own:
        t0 = min(e.time for e in own)
        near = [e for e in own if e.time <= t0 + SIMULTANEOUS_SECONDS]
        return min(near, key=lambda e: (not e.signal, e.time,
                                        e.rank if e.rank is not None else -1))
    failed = [e for e in exits if e.failed]
    return min(failed, key=lambda e: e.time) if failed else None


def format_report(exits: list[RankExit], interrupted: str | None = None,
                  tail_lines: int = 10) -> str:
    """The text ``horovodrun`` prints (and ``WorkerFailedError`` carries) for a failed job."""
    first = root_cause(exits)
    lines: list[str] = []
    if interrupted and (first is None or first.stopped_by):
        lines.append(f"horovodrun: the job was interrupted ({interrupted}); all workers were stopped.")
    elif first is not None:
        lines.append("Horovod detected that one or more processes exited with non-zero status, "
                     "thus causing the job to be terminated. The first process to do so was:")
        lines.append(f"  {first.where()}: {first.status}"
                     + (f" ({first.note})" if first.note else ""))
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
            else:
                how = f"{e.status} (after the first failure)" if first else e.status
            lines.append(f"  {e.where()}: {how}" + (f" ({e.note})" if e.note else ""))
    return "\n".join(lines)
