"""The launcher's live view of a job: ``horovodrun --monitor-port PORT`` (docs/monitor.md).

``service.MonitorService`` serves ``/`` (``page.py``), ``/metrics`` (``exposition.py``) and
``/api/job`` from a ``state.JobState`` that the ranks' reporters (``horovod.common.reporter``)
and the launcher (failures, elastic rounds) update. ``start_monitor`` is the launcher's one call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO, Any

from horovod.common import wire
from horovod.runner.monitor.service import MonitorService
from horovod.runner.monitor.state import JobState

__all__ = ["MonitorService", "JobState", "start_monitor", "worker_env", "record_result"]


def start_monitor(secret: str, port: int, address: str | None, world_size: int,
                  ranks: dict[int, tuple[str, int]] | None = None,
                  out: IO[str] | None = None) -> MonitorService:
    """Bind and start the service, and print its URL.

    Raises:
        LaunchError: the port is in use or the address is not this host's.
    """
    svc = MonitorService(secret, port, address or "127.0.0.1", JobState(world_size, ranks))
    print(f"horovodrun: monitor at {svc.url} (metrics: /metrics, JSON: /api/job)",
          file=out or sys.stderr, flush=True)
    return svc


def worker_env(svc: MonitorService, advertised: str | None = None) -> dict[str, str]:
    """What each rank needs to report to ``svc`` (the job secret travels separately)."""
    addr = svc.address
    if addr in ("0.0.0.0", "::", ""):
        addr = advertised or "127.0.0.1"
    return {wire.MONITOR_ADDR_ENV: addr, wire.MONITOR_PORT_ENV: str(svc.port)}


def record_result(svc: MonitorService, result: Any) -> None:
    """The launcher's outcome of the job (``execute.JobResult``): the failure's culprit, if any."""
    first: Callable[[], Any] | None = getattr(result, "first_failure", None)
    culprit = first() if callable(first) else None
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
    svc.state.set_finished(int(getattr(result, "returncode", 0)))
