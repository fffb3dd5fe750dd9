"""``horovod.spark.run`` and ``horovod.spark.run_elastic``: Horovod jobs as Spark tasks.

The driver opens the job's rendezvous service (``horovod.runner.rendezvous``) on the Spark driver,
publishes the cloudpickled function there and submits one Spark job of ``num_proc`` tasks. In
``run`` the stage runs in barrier mode (all tasks start together or none does); each task starts
one Gloo rank (``horovod.spark.task``). Results come back in rank order through the same service,
the ranks' output is written to ``stdout``/``stderr`` on the driver as it happens, and a failure
names its rank, host and Spark executor.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from horovod.common.exceptions import ConfigError, WorkerFailedError
from horovod.common.protocol import (
    SECRET_ENV,
    SPARK_ENV_SCOPE,
    SPARK_TASK_SCOPE,
    SparkRankAssignment,
    SparkRankExit,
    SparkTaskStarted,
)
from horovod.spark.driver import (
    _configure_logging,
    _driver_address,
    _spark_context,
    default_start_timeout,
    spark_failure_reason,
)
from horovod.spark.elastic import run_elastic  # upstream's home of both
from horovod.spark.task import JobSpec

if TYPE_CHECKING:
    from horovod.runner.job_outcome import JobOutcome

__all__ = ["run", "run_elastic", "SparkStartTimeoutError", "default_start_timeout"]

log = logging.getLogger("horovod.spark")

CALLER = "horovod.spark.run"  # what its errors start with

class SparkStartTimeoutError(WorkerFailedError, TimeoutError):
    """Not every Spark task of the job started within ``start_timeout``."""


def free_task_slots(sc: Any) -> int | None:
    """How many tasks the cluster can run at once now (None when Spark cannot tell)."""
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # noqa: BLE001 - a private Spark API; without it only the timeout applies
        return None


class _Job:
    """One ``horovod.spark.run``: the service, the Spark job thread, output and results."""

    def __init__(self, sc: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], num_proc: int, start_timeout: float,
                 env: dict[str, str] | None, stdout: IO[str] | None, stderr: IO[str] | None,
                 nics: list[str] | None, timestamp: bool, executable: str | None) -> None:
        from horovod.common.protocol import FunctionCall
        from horovod.runner.launch.cluster_job import FunctionJob
        from horovod.runner.launch.static_session import StaticSession
        from horovod.spark.output import OutputPump

        self.sc, self.num_proc, self.start_timeout = sc, num_proc, start_timeout
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.nics = list(nics or [])
        bind, advertised = _driver_address(sc, self.nics)
        self.job = FunctionJob(advertised, bind_addr=bind)
        self.server = self.job.server
        # The function goes out on the job's service; the ranks' results come back there.
        self.session = StaticSession(num_proc, CALLER, service=self.job,
                                     call=FunctionCall.of(fn, args, kwargs))
        self.spec = JobSpec(addr=advertised, port=self.job.port, secret=self.job.secret,
                            num_proc=num_proc, executable=executable, timestamp=timestamp,
                            start_timeout=start_timeout)
        self.pump = OutputPump(self.server.get, self.server.pop, stdout, stderr)
        self.group = f"horovod.spark.run.{uuid.uuid4().hex[:12]}"
        self.records: list[SparkRankExit] | None = None
        self.spark_error: BaseException | None = None
        self.ranks: list[int] = []  # rank of each partition, once assigned

    def assign(self, started: dict[int, SparkTaskStarted]) -> None:
        """Once a task has reported every task's executor, publish each partition's rank and env."""
        from horovod.spark.task import group_by_host

        if self.ranks or not started:
            return
        addresses = list(next(iter(started.values())).addresses)
        hosts, ranks = group_by_host(addresses)
        envs = self.job.worker_envs(hosts, self.num_proc, nics=self.nics, extra_env=self.env)
        for partition, rank in enumerate(ranks):
            slot, env = envs[rank]
            # The secret stays out of the rendezvous (plain HTTP): the task has it from its Spark
            # closure (JobSpec) and adds it to the rank's environment itself.
            env = {k: v for k, v in env.items() if k != SECRET_ENV}
            self.server.put(SPARK_ENV_SCOPE, str(partition), SparkRankAssignment(
                rank, slot.hostname, slot.local_rank, env).encode())
        self.ranks = ranks
        log.debug("ranks by partition: %s on hosts %s", ranks, hosts)

    def started(self) -> dict[int, SparkTaskStarted]:
        out = {}
        for p in range(self.num_proc):
            raw = self.server.get(SPARK_TASK_SCOPE, str(p))
            if raw is not None:
                out[p] = SparkTaskStarted.decode(raw)
        return out

    def _submit(self) -> None:
        from horovod.spark.task import barrier_task

        spec = self.spec
        try:
            self.sc.setJobGroup(self.group, f"horovod.spark.run: {self.num_proc} processes",
                                interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.num_proc), self.num_proc)
            rows = rdd.barrier().mapPartitions(lambda it: barrier_task(spec, it)).collect()
            self.records = [_rank_exit(r) for r in rows]
        except BaseException as exc:  # noqa: BLE001 - reported on the calling thread
            self.spark_error = exc

    def run(self) -> list[Any]:
        return self.session.results(self.session.run(self._supervise))

    def _supervise(self) -> JobOutcome:
        """Run the Spark job to its end; how each rank's task ended (the rows they returned).

        Raises:
            SparkStartTimeoutError: not every task started within the start timeout.
            WorkerFailedError: the Spark job failed (``_spark_failure``).
        """
        from horovod.runner.failures import RankExit
        from horovod.runner.job_outcome import JobOutcome

        thread = threading.Thread(target=self._submit, name="hvd-spark-job", daemon=True)
        t0 = time.monotonic()
        thread.start()
        started: dict[int, SparkTaskStarted] = {}
        try:
            while thread.is_alive():
                thread.join(0.05)
                self.pump.pump(list(range(self.num_proc)))
                if len(started) < self.num_proc:
                    started = self.started()
                    if len(started) == self.num_proc:
                        log.debug("all %d tasks started after %.2f s", self.num_proc,
                                  time.monotonic() - t0)
                self.assign(started)
                if time.monotonic() - t0 > self.start_timeout:
                    if len(started) < self.num_proc:
                        self._cancel()
                        raise self._start_timeout_error(len(started))
            self.pump.pump(list(range(self.num_proc)))
            log.debug("the Spark job ended after %.2f s", time.monotonic() - t0)
            started = self.started()
            if self.spark_error is not None:
                raise self._spark_failure(started)
            assert self.records is not None
            exits = [RankExit.with_record(r.record, r.rank, r.host, r.code, r.signal, r.time, None,
                                          list(r.stderr_tail), r.local_rank)
                     for r in self.records]
            return JobOutcome(exits, 0 if all(e.code == 0 for e in exits) else 1)
        finally:
            if thread.is_alive():
                self._cancel()
                thread.join(10)

    def _cancel(self) -> None:
        try:
            self.sc.cancelJobGroup(self.group)
        except Exception:  # noqa: BLE001 - the context may be stopping
            log.debug("cancelJobGroup failed", exc_info=True)

    def _start_timeout_error(self, started: int) -> SparkStartTimeoutError:
        slots = free_task_slots(self.sc)
        have = f"; the cluster has {slots} free task slot(s) now" if slots is not None else ""
        return SparkStartTimeoutError(
            f"horovod.spark.run: timed out after {self.start_timeout:g} s waiting for Spark tasks to "
            f"start: {started} of {self.num_proc} started{have}. Each Horovod process runs in a "
            "Spark task and barrier mode starts them all together, so the cluster needs "
            f"{self.num_proc} free task slots (executor cores / spark.task.cpus). Lower num_proc, "
            "add executors, or raise start_timeout (HOROVOD_SPARK_START_TIMEOUT) if executors are "
            "allocated on demand.", started=started, num_proc=self.num_proc)

    def _spark_failure(self, started: dict[int, SparkTaskStarted]) -> WorkerFailedError:
        from horovod.common.protocol import RESULT_SCOPE, Died, Raised
        from horovod.runner.failures import RankExit
        from horovod.runner.job_outcome import JobOutcome
        from horovod.runner.launch.static_session import read_outcomes

        exc = self.spark_error
        assert exc is not None
        lost = [r for r in range(self.num_proc) if self.server.get(RESULT_SCOPE, str(r)) is None]
        if self.ranks and not lost:
            # Every rank reported and one raised (its task failed afterwards): name that rank.
            found = read_outcomes(self.server.get, [str(r) for r in range(self.num_proc)])
            outcome = JobOutcome(returncode=1, outcomes={int(k): o for k, o in found.items()})
            if any(isinstance(o, Raised) for o in outcome.outcomes.values()):
                return outcome.failure(CALLER)
        reason = spark_failure_reason(str(exc)) or type(exc).__name__
        partition_of = {r: p for p, r in enumerate(self.ranks)}
        addresses = next(iter(started.values())).addresses if started else ()

        def where(rank: int) -> str:
            p = partition_of.get(rank)
            if p is None or p >= len(addresses):
                return f"rank {rank}"
            return f"rank {rank} (partition {p}, executor {addresses[p]})"

        # Spark names the task that failed; the other ranks may also have ended without a result
        # (their tasks were cancelled with the stage before they could report "a peer left").
        failed = [self.ranks[p] for p in failed_partitions(str(exc)) if p < len(self.ranks)]
        culprits = [r for r in failed if r in lost] or lost
        others = [r for r in lost if r not in culprits]
        known = bool(self.ranks) and any(r in partition_of for r in culprits)
        outcome = JobOutcome(
            [RankExit(r, where(r), None, None, 0.0, stopped_by="cancelled with the Spark stage")
             for r in others] if known else [], 1,
            {r: Died(exc) for r in culprits + others} if known else {})
        err = outcome.failure(CALLER, where, lost="ended without a result: its Spark task or executor "
                              "was lost", lost_other="stopped with it", notes=[
                                  f"Spark says: {reason[:800]}.",
                                  "The other ranks stopped because a peer left. A static job cannot "
                                  "survive a lost task or executor; use horovod.spark.run_elastic for "
                                  "fault tolerance."])
        err.spark_error = str(exc)[:2000]  # type: ignore[attr-defined]
        return err


def _rank_exit(row: object) -> SparkRankExit:
    """A barrier task's row: how its rank ended."""
    if not isinstance(row, SparkRankExit):
        from horovod.common.exceptions import HorovodInternalError

        raise HorovodInternalError(f"a horovod.spark.run task returned {type(row).__name__} "
                                   f"{row!r:.200}, not a SparkRankExit: the driver and the "
                                   "executors run different horovod-py versions?")
    return row


def failed_partitions(text: str) -> list[int]:
    """The partitions of the tasks a Spark job failure names, in order of first mention
    (``barrier task ResultTask(3, 1) finished unsuccessfully``, ``Lost task 1.0 in stage 3.0``)."""
    import re

    found: dict[int, None] = {}
    for m in re.finditer(r"ResultTask\(\d+, (\d+)\)|[Ll]ost task (\d+)\.\d+ in stage", text):
        found.setdefault(int(m.group(1) or m.group(2)), None)
    return list(found)


def run(fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None,
        use_mpi: bool | None = None, use_gloo: bool | None = None,
        extra_mpi_args: str | None = None, env: dict[str, str] | None = None,
        stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
        nics: list[str] | set[str] | None = None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None, monitor_port: int | None = None,
        monitor_address: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as a Horovod job of ``num_proc`` Spark tasks.

    Every task runs one rank; ranks are grouped by executor host, so ``hvd.local_rank()`` and
    ``hvd.cross_rank()`` are right. Needs an active ``SparkContext``.

    Args:
        fn: the function every rank runs (shipped with cloudpickle).
        args, kwargs: its arguments.
        num_proc: number of processes (default: ``spark.default.parallelism``).
        start_timeout: seconds for every task to start (default ``HOROVOD_SPARK_START_TIMEOUT``
            or 600).
        use_mpi, use_gloo, extra_mpi_args: the transport. Gloo is the one used; ``use_mpi=True``
            is refused (see docs/spark.md).
        env: variables added to the ranks' environment (which is otherwise the executor's).
        stdout, stderr: where the ranks' prefixed output is written (default: the driver's).
        verbose: 0 silent, 1 one line per job, 2 debug logging of the launcher.
        nics: network interfaces to use (the first one binds the service and Gloo).
        prefix_output_with_timestamp: put ``time.asctime()`` before every output line.
        executable: the Python that runs the ranks on the executors (default: the executor's).
        monitor_port / monitor_address: serve the job's live view, Prometheus metrics and JSON
            on the driver while the job runs (``horovodrun --monitor-port``; docs/monitor.md);
            port 0 picks a free port, the URL is printed to ``stderr``. The ranks report over
            the job's rendezvous service.

    Returns:
        One return value per rank, in rank order.

    Raises:
        WorkerFailedError: a rank raised (its traceback is in the message; ``err.rank``,
            ``err.exception``), or a task or executor was lost.
        SparkStartTimeoutError: not every task started within ``start_timeout``.
        ConfigError (ValueError): bad arguments; ``use_mpi=True``.
    """
    if use_mpi and use_gloo:
        raise ConfigError("Give either use_gloo=True or use_mpi=True to horovod.spark.run, not both.")
    if use_mpi:
        raise ConfigError(
            "horovod.spark.run(use_mpi=True) is not supported by horovod-py: Spark tasks are "
            "started by Spark, not by mpirun, so the ranks run on Gloo (the default). Leave "
            "use_mpi unset, or start an MPI job with horovodrun/mpirun outside Spark.")
    if extra_mpi_args:
        raise ConfigError("extra_mpi_args applies to MPI only; horovod.spark.run uses Gloo.")
    sc = _spark_context()
    if num_proc is None:
        num_proc = int(sc.defaultParallelism)
    if num_proc < 1:
        raise ConfigError(f"num_proc={num_proc}: need at least 1 process.")
    timeout = float(start_timeout) if start_timeout is not None else default_start_timeout()
    _configure_logging(verbose)
    if verbose >= 1:
        print(f"Running {num_proc} processes...", file=stderr or sys.stderr, flush=True)
    job = _Job(sc, fn, tuple(args), dict(kwargs or {}), num_proc, timeout, env, stdout, stderr,
               sorted(nics) if isinstance(nics, set) else list(nics or []),
               prefix_output_with_timestamp, executable)
    from horovod.runner.monitor.cluster import run_monitored

    return run_monitored(job, monitor_port, monitor_address, "horovod.spark.run", stderr)
