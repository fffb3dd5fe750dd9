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
from typing import IO, Any

from horovod.common import protocol
from horovod.runner.monitor.service import MonitorService
from horovod.runner.monitor.state import JobState

__all__ = ["MonitorService", "JobState", "start_monitor", "worker_env", "record_result", "finish",
           "linger"]

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


def record_result(svc: MonitorService, result: Any) -> None:
    """The launcher's outcome of the job (``execute.JobResult``): the failure's culprit, if any."""
    culprit = getattr(result, "first_failure", None)  # execute.JobResult's root cause
    if callable(culprit):
        culprit = culprit()
    elastic = getattr(getattr(result, "result", None), "root_cause", None)
    worker = elastic() if callable(elastic) else None  # an elastic job's first failed worker
    if worker is not None:
        svc.state.set_failure(worker.rank, str(worker.key[0]), worker.status,
                              str(getattr(result, "error", "") or ""))
    elif culprit is not None:
        error = getattr(culprit, "error", "") or getattr(culprit, "note", "")
        svc.state.set_failure(culprit.rank, culprit.host, culprit.status, error,
                              getattr(culprit, "stderr_tail", None))
    elif getattr(result, "returncode", 0):
        svc.state.set_failure(None, "", str(getattr(result, "error", "") or
                                            f"exit code {result.returncode}"))
    for e in getattr(result, "exits", None) or []:
        if e.rank is not None and e.failed and (culprit is None or e.rank != culprit.rank):
            svc.state.set_stopped(e.rank)
    svc.state.set_finished(int(getattr(result, "returncode", 0)))


def finish(svc: MonitorService, result: Any, linger: float) -> None:
    """The job ended: show its outcome, then stop the service now, or after ``linger`` seconds
    (``linger()`` waits for that, once the launcher has printed its report)."""
    try:
        if result is not None:
            record_result(svc, result)
    finally:
        if linger > 0:
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
        while _LINGERING:
            _LINGERING.pop()[0].stop()
