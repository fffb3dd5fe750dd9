"""What the monitor service knows about a job: the ranks' latest reports, elastic rounds, the
failure, and where each rank last said it was (its stack and flight record, with when that
arrived). Thread-safe; every reader gets a JSON-ready copy (``JobState.job``, ``JobState.stacks``)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from horovod.common.protocol import MonitorReport, flight_record_lines

__all__ = ["JobState", "STEP_HISTORY"]

# Step times kept per rank for the page's chart.
STEP_HISTORY = 120
# A rank whose last report is older than this many report intervals shows as "silent".
_SILENT_AFTER = 10.0
# The step rate is taken over this many of a rank's last reports (about as many seconds).
_RATE_REPORTS = 6


class _Rank:
    __slots__ = ("report", "seen", "prev_steps", "prev_time", "step_rate", "steps", "failed", "history",
                 "where", "where_seen")

    def __init__(self) -> None:
        self.report: MonitorReport | None = None
        self.seen = 0.0
        self.prev_steps: int | None = None
        self.prev_time = 0.0
        self.step_rate = 0.0
        self.steps: collections.deque[float] = collections.deque(maxlen=STEP_HISTORY)
        self.failed: str | None = None
        self.history: collections.deque[tuple[float, int]] = collections.deque(maxlen=_RATE_REPORTS)
        self.where: MonitorReport | None = None  # the latest report that said where the rank is
        self.where_seen = 0.0  # when it arrived (this service's clock)


class JobState:
    """The job as the monitor shows it.

    Args:
        world_size: the number of ranks the launcher starts (elastic jobs: updated by reports).
        ranks: ``{rank: (host, local_rank)}`` from the launch plan (known before any report).
        clock: wall clock (seconds), injectable for tests.
    """

    def __init__(self, world_size: int = 0, ranks: dict[int, tuple[str, int]] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.started = clock()
        self.world_size = world_size
        self.planned = dict(ranks or {})
        self._ranks: dict[int, _Rank] = {}
        self.failure: dict[str, Any] | None = None
        self.finished: dict[str, Any] | None = None
        self.elastic: Callable[[], dict[str, Any]] | None = None
        self.reports = 0

    def ingest(self, report: MonitorReport) -> None:
        """One rank's report (``horovod.common.reporter``)."""
        rank = report.rank
        now = self._clock()
        with self._lock:
            self.reports += 1
            if self.elastic is not None and report.size:
                self.world_size = report.size
                for r in [r for r in self._ranks if r >= report.size]:
                    del self._ranks[r]
            st = self._ranks.setdefault(rank, _Rank())
            steps = report.steps
            if st.history and steps < st.history[-1][1]:
                st.history.clear()  # a new engine (an elastic reset): counters start again
            st.history.append((now, steps))
            (t0, s0), (t1, s1) = st.history[0], st.history[-1]
            st.step_rate = (s1 - s0) / (t1 - t0) if t1 > t0 else st.step_rate
            if st.prev_steps is not None and steps >= st.prev_steps and now > st.prev_time:
                new = steps - st.prev_steps
                st.steps.extend(report.step_times[-new:] if new else ())
            elif st.prev_steps is None:
                st.steps.extend(report.step_times)
            st.prev_steps, st.prev_time = steps, now
            st.report = report
            st.seen = now
            if report.stack is not None or report.flight is not None:
                st.where, st.where_seen = report, now

    def set_failure(self, rank: int | None, host: str, status: str, error: str = "",
                    tail: list[str] | None = None) -> None:
        """The launcher's root cause of a failed job (``horovod.runner.failures``)."""
        with self._lock:
            self.failure = {"rank": rank, "host": host, "status": status, "error": error,
                            "stderr_tail": list(tail or [])[-5:], "time": self._clock()}
            if rank is not None:
                self._ranks.setdefault(rank, _Rank()).failed = status

    def set_stopped(self, rank: int) -> None:
        """The launcher stopped this rank (after another failed)."""
        with self._lock:
            st = self._ranks.setdefault(rank, _Rank())
            if not st.failed:
                st.failed = "stopped"

    def set_finished(self, returncode: int, text: str = "") -> None:
        with self._lock:
            self.finished = {"returncode": returncode, "text": text, "time": self._clock()}

    def _row(self, rank: int, st: _Rank | None, now: float) -> dict[str, Any]:
        rep = st.report if st is not None else None
        host, local_rank = self.planned.get(rank, (rep.host, rep.local_rank) if rep else ("", -1))
        host = host or (rep.host if rep else "")  # the launch plan's name, as the failure report uses
        interval = 1.0
        if st is not None and st.failed:
            state = "failed" if st.failed != "stopped" else "stopped"
        elif st is None or rep is None:
            state = "starting"
        elif rep.final:
            state = "finished"
        elif rep.stalled_tensors:
            state = "stalled"
        elif rep.straggler:
            state = "straggler"
        elif now - st.seen > _SILENT_AFTER * interval:
            state = "silent"
        else:
            state = "running"
        rep = rep or MonitorReport(rank)
        return {
            "rank": rank, "host": host, "local_rank": local_rank, "state": state,
            "step_rate": st.step_rate if st else 0.0, "steps": rep.steps,
            "wait_seconds": rep.wait_seconds,
            "collectives": dict(rep.collectives),
            "collective_bytes": dict(rep.collective_bytes),
            "collective_seconds": dict(rep.collective_seconds),
            "bytes": int(sum(rep.collective_bytes.values())),
            "stalled_tensors": rep.stalled_tensors,
            "straggler": rep.straggler,
            "straggler_score": rep.straggler_score,
            "step_times": list(st.steps) if st else [],
            "last_report_age": (now - st.seen) if st and st.seen else None,
        }

    def stacks(self) -> dict[str, Any]:
        """Where every rank last said it was (``/api/stacks``): per rank its host, pid, state, its
        main thread's innermost user frame and stack, its flight record (rows and text), and
        ``age_seconds``: how long ago that arrived (a stopped or stuck-in-C rank's grows)."""
        now = self._clock()
        with self._lock:
            ranks = sorted(set(self._ranks) | set(self.planned))
            if self.world_size:
                ranks = [r for r in ranks if r < self.world_size]
            out = []
            for r in ranks:
                st = self._ranks.get(r)
                row = self._row(r, st, now)
                rep = st.where if st is not None else None
                flight = dict(rep.flight) if rep is not None and rep.flight is not None else None
                out.append({
                    "rank": r, "host": row["host"], "state": row["state"],
                    "pid": (rep.pid or None) if rep is not None else None,
                    "where": rep.where if rep is not None else "",
                    "stack": rep.stack if rep is not None else None,
                    "flight": flight,
                    "flight_text": flight_record_lines(flight, "  ") if flight is not None else [],
                    "age_seconds": (now - st.where_seen) if st is not None and rep is not None else None,
                })
            return {"time": now, "ranks": out}

    def job(self) -> dict[str, Any]:
        """The whole job, JSON-ready (``/api/job``; ``/metrics`` renders the same)."""
        now = self._clock()
        elastic = None
        if self.elastic is not None:
            try:
                elastic = self.elastic()
            except Exception:  # noqa: BLE001 - the driver is changing under us: show nothing
                elastic = None
        with self._lock:
            ranks = sorted(set(self._ranks) | set(self.planned))
            if self.world_size:
                ranks = [r for r in ranks if r < self.world_size]
            rows = [self._row(r, self._ranks.get(r), now) for r in ranks]
            return {
                "world_size": self.world_size or len(rows),
                "uptime_seconds": now - self.started,
                "reports": self.reports,
                "ranks": rows,
                "stragglers": [r["rank"] for r in rows if r["straggler"]],
                "failure": dict(self.failure) if self.failure else None,
                "finished": dict(self.finished) if self.finished else None,
                "elastic": elastic,
            }
