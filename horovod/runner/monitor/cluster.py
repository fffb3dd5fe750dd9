"""The monitor of jobs whose ranks a cluster engine starts: ``horovod.spark.run``,
``horovod.spark.run_elastic`` and ``RayExecutor`` (docs/monitor.md).

The service itself is the one ``horovodrun --monitor-port`` starts (``MonitorService``), in the
process where the job's driver lives (the Spark driver, the Ray driver). The ranks do not need to
reach it: they post their reports to the job's rendezvous service (``FunctionJob``), which the
executors or actors already reach and which checks the job secret on every request; that service
hands each report to the monitor in process (``attach``). So a monitor on ``127.0.0.1`` serves a
job whose ranks run on other machines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any

from horovod.common import protocol
from horovod.runner.job_outcome import JobFailedError, JobOutcome
from horovod.runner.monitor import start_monitor
from horovod.runner.monitor.service import MonitorService, answer_report

__all__ = ["open_monitor", "attach", "job_failed", "close", "run_monitored"]


def open_monitor(port: int | None, address: str | None, secret: str, world_size: int,
                 who: str, out: IO[str] | None = None) -> MonitorService | None:
    """Start the service when ``port`` is not None and print its URL; call before any rank starts.

    Raises:
        LaunchError: the port is in use or the address is not this host's (no rank started).
    """
    if port is None:
        return None
    return start_monitor(secret, port, address, world_size, out=out, who=who)


def attach(svc: MonitorService, job: Any,
           driver: Callable[[], Any] | None = None) -> dict[str, str]:
    """Take the ranks' reports over ``job``'s rendezvous service (a ``FunctionJob``) into ``svc``.

    ``driver`` returns the job's elastic driver (or None between runs): the monitor then shows its
    rounds and workers. Returns the variables every rank needs to report (add them to its
    environment; the job secret reaches the ranks as it already does).
    """
    state = svc.state
    job.server.set_report_handler(lambda body: answer_report(state, body))
    if driver is not None:
        from horovod.runner.launch.elastic import elastic_status

        def elastic() -> dict[str, Any]:
            d = driver()
            return elastic_status(d) if d is not None else {"rounds": 0, "resets": 0, "workers": {}}

        state.elastic = elastic
    return {protocol.MONITOR_ADDR_ENV: str(job.addr), protocol.MONITOR_PORT_ENV: str(job.port)}


def job_failed(svc: MonitorService, outcome: JobOutcome, text: str) -> None:
    """Show a failed job's outcome with the failure's ``text``: its root cause (the rank; its
    host, from the outcome or else from the rank's reports; what it raised, that it was lost, or
    how its process ended) and the other failed ranks as stopped."""
    ranks = outcome.failed_ranks()
    rank = ranks[0] if ranks else None
    if outcome.elastic is not None:
        workers = outcome.failed_workers()
        o = workers[0][3] if workers else None
    else:
        o = outcome.outcomes.get(rank) if rank is not None else None
    root = outcome.root_cause()
    own = root is not None and root.rank == rank
    host = root.host if root is not None and own else ""
    if not host and rank is not None:
        row = next((r for r in svc.state.job()["ranks"] if r["rank"] == rank), None)
        host = row["host"] if row is not None else ""
    if isinstance(o, protocol.Raised):
        status = f"raised {type(o.error).__name__}"
    elif isinstance(o, protocol.Died):
        status = "lost"
    else:
        status = root.status if root is not None and own else "failed"
    svc.state.set_failure(rank, host, status, text[:4000])
    for other in ranks[1:]:
        svc.state.set_stopped(other)


def close(svc: MonitorService | None, error: BaseException | None = None) -> None:
    """The job ended (with ``error``, or not): record how, and stop the service. A
    ``JobFailedError`` shows the outcome it carries (``job_failed``); any other error (the job
    did not start, a launcher error) is shown as the job's failure, with no rank to blame."""
    if svc is None:
        return
    try:
        if isinstance(error, JobFailedError):
            job_failed(svc, error.outcome, str(error))
        elif error is not None:
            svc.state.set_failure(None, "", type(error).__name__, str(error)[:4000])
        svc.state.set_finished(0 if error is None else 1)
    finally:
        svc.stop()


def run_monitored(job: Any, port: int | None, address: str | None, who: str,
                  out: IO[str] | None = None, driver: Callable[[], Any] | None = None) -> Any:
    """``job.run()`` for a job of ``horovod.spark.run`` or ``run_elastic`` (``job.job``: its
    ``FunctionJob``; ``job.env``: what its ranks get), with the monitor started first when
    ``port`` is given (a port in use fails before any task starts), the ranks' reports taken over
    the job's rendezvous service, and the job's outcome shown at its end. ``driver``: the elastic
    driver, whose rounds the monitor shows (the world size then comes from the ranks' reports).
    """
    try:
        monitor = open_monitor(port, address, job.job.secret,
                               0 if driver is not None else job.num_proc, who, out)
    except BaseException:
        job.job.stop()
        raise
    if monitor is not None:
        job.env.update(attach(monitor, job.job, driver))
    error: BaseException | None = None
    try:
        return job.run()
    except BaseException as exc:
        error = exc
        raise
    finally:
        close(monitor, error)
