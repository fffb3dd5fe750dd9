"""The launcher's live view of a job: ``horovodrun --monitor-port PORT`` (docs/monitor.md).

``service.MonitorService`` serves ``/`` (``page.py``), ``/metrics`` (``exposition.py``),
``/api/job`` and ``/api/stacks`` from a ``state.JobState`` that the ranks' reporters (``horovod.common.reporter``)
and the launcher (failures, elastic rounds) update. ``start_monitor`` is the launcher's one call;
``cluster`` wires the same service into Spark and Ray jobs, whose ranks report over the job's
rendezvous service.
"""

from __future__ import annotations

import sys
import time
from typing import IO, TYPE_CHECKING

from horovod.common import protocol
from horovod.runner.monitor.service import MonitorService
from horovod.runner.monitor.state import JobState

if TYPE_CHECKING:
    from horovod.runner.job_outcome import JobOutcome

__all__ = ["MonitorService", "JobState", "start_monitor", "worker_env", "record_result", "finish",
           "linger", "stop_lingering"]

# Services kept up after their job ended (--monitor-linger), with when to stop them.
_LINGERING: list[tuple[MonitorService, float]] = []


def start_monitor(secret: str, port: int, address: str | None, world_size: int,
                  ranks: dict[int, tuple[str, int]] | None = None,
                  out: IO[str] | None = None, who: str = "horovodrun") -> MonitorService:
    """Bind and start the service, and print its URL (after ``who``: the launcher's name).

    Raises:
        LaunchError: the port is in use or the address is not this host's.
    """
    svc = MonitorService(secret, port, address or "127.0.0.1", JobState(world_size, ranks))
    print(f"{who}: monitor at {svc.url} (metrics: /metrics, JSON: /api/job, stacks: /api/stacks)",
          file=out or sys.stderr, flush=True)
    return svc


def worker_env(svc: MonitorService, advertised: str | None = None) -> dict[str, str]:
    """What each rank needs to report to ``svc`` (the job secret travels separately)."""
    addr = svc.address
    if addr in ("0.0.0.0", "::", ""):
        addr = advertised or "127.0.0.1"
    return {protocol.MONITOR_ADDR_ENV: addr, protocol.MONITOR_PORT_ENV: str(svc.port)}


def record_result(svc: MonitorService, outcome: JobOutcome) -> None:
    """The launcher's outcome of the job: its root cause (rank, host, status, error, the last
    lines of its stderr), the other failed ranks as stopped, and the exit status."""
    first = outcome.root_cause()
    if first is not None:
        # (an elastic job: why the driver gave up, as before; a static job: the rank's error)
        error = (outcome.error if outcome.elastic is not None else "") or first.error or first.note or ""
        svc.state.set_failure(first.rank, first.host, first.status, error, first.stderr_tail or None)
    elif outcome.returncode:
        svc.state.set_failure(None, "", outcome.error or f"exit code {outcome.returncode}")
    for e in outcome.exits:
        if e.rank is not None and e.failed and (first is None or e.rank != first.rank):
            svc.state.set_stopped(e.rank)
    svc.state.set_finished(outcome.returncode)


def finish(svc: MonitorService, result: JobOutcome | None, linger: float) -> None:
    """The job ended: show its outcome, then stop the service now, or after ``linger`` seconds
    (``linger()`` waits for that, once the launcher has printed its report). A job interrupted
    by a signal does not linger: the user's Ctrl-C, taken by the launcher while the job was still
    ending, also means "stop the monitor" (it would otherwise be swallowed, and the monitor kept
    up for the whole linger)."""
    try:
        if result is not None:
            record_result(svc, result)
    finally:
        if linger > 0 and (result is None or not result.interrupted):
            _LINGERING.append((svc, time.monotonic() + linger))
        else:
            svc.stop()


def linger(out: IO[str] | None = None) -> None:
    """Keep the services of ended jobs up until their linger time is over (Ctrl-C: at once)."""
    try:
        for svc, until in list(_LINGERING):
            left = until - time.monotonic()
            if left > 0:
                print(f"horovodrun: the job ended; the monitor stays up {left:.0f} s at {svc.url} "
                      "(Ctrl-C ends it)", file=out or sys.stderr, flush=True)
                time.sleep(left)
    except KeyboardInterrupt:
        pass
    finally:
        stop_lingering()


def stop_lingering() -> None:
    """Stop the services of ended jobs now."""
    while _LINGERING:
        _LINGERING.pop()[0].stop()
