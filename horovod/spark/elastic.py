"""``horovod.spark.run_elastic``: an elastic Horovod job over Spark executors.

The job is one Spark job of ``max_num_proc`` ordinary (not barrier) tasks. Each task is an agent
(``horovod.spark.task.elastic_agent``): it registers with the driver's rendezvous service, sends
heartbeats, and starts or stops elastic workers when the driver says so. The elastic driver of
``horovodrun`` (``horovod.runner.elastic.driver``) runs unchanged on the Spark driver; its host
discovery is the set of live agents, one "host" per executor. When an executor is lost, its
agent's heartbeats stop: the driver counts the worker as failed, blacklists that executor, and
the survivors restore their last commit and go on. Spark re-runs the lost task on an executor it
still has or gets anew; that agent is a new host, and the driver takes it in as it would a new
host in discovery.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import IO, Any

from horovod.common.exceptions import ConfigError
from horovod.common.protocol import (
    SECRET_ENV,
    SPARK_AGENT_SCOPE,
    SPARK_COMMAND_SCOPE,
    SPARK_EXIT_SCOPE,
    SPARK_HEARTBEAT_SCOPE,
    AgentCommand,
    ExitAgent,
    KillWorker,
    SparkAgentRegistration,
    SparkWorkerExit,
    StartWorker,
    StopWorker,
    spark_agent_key,
)
from horovod.runner.elastic.driver import Key, key_name
from horovod.runner.elastic.session import ElasticSession
from horovod.runner.elastic.settings import DriverSettings
from horovod.runner.hosts import SlotInfo
from horovod.spark.task import JobSpec

__all__ = ["run_elastic", "SparkAgents"]

log = logging.getLogger("horovod.spark")

# An agent whose heartbeat has not changed for this long is taken as lost (its executor died);
# HOROVOD_SPARK_AGENT_TIMEOUT sets it (raise it on clusters whose executors stall for GC).
AGENT_STALE_SECONDS = 5.0
# Spark task attempts looked for per partition (spark.task.maxFailures is 4 by default).
MAX_ATTEMPTS = 16


def agent_timeout() -> float:
    """``HOROVOD_SPARK_AGENT_TIMEOUT`` seconds, else 5."""
    import os

    raw = os.environ.get("HOROVOD_SPARK_AGENT_TIMEOUT")
    try:
        return float(raw) if raw else AGENT_STALE_SECONDS
    except ValueError as exc:
        raise ConfigError(f"HOROVOD_SPARK_AGENT_TIMEOUT={raw!r} is not a number of seconds.") from exc


class SparkAgents:
    """Host discovery for the elastic driver: live agents grouped by executor.

    Args:
        get: reads the rendezvous store in process.
        num_tasks: the Spark job's number of tasks (partitions).
        stale_seconds: heartbeat silence after which an agent counts as lost.
        clock: the time source.
    """

    def __init__(self, get: Callable[[str, str], bytes | None], num_tasks: int,
                 stale_seconds: float = AGENT_STALE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.get, self.num_tasks = get, num_tasks
        self.stale_seconds, self.clock = stale_seconds, clock
        self.hosts: dict[str, str] = {}  # agent -> host, in registration order
        self._beats: dict[str, tuple[bytes | None, float]] = {}
        self._lock = threading.Lock()

    def refresh(self) -> None:
        now = self.clock()
        with self._lock:
            for p in range(self.num_tasks):
                for a in range(MAX_ATTEMPTS):
                    agent = f"{p}.{a}"
                    if agent in self.hosts:
                        continue
                    raw = self.get(SPARK_AGENT_SCOPE, agent)
                    if raw is not None:
                        self.hosts[agent] = SparkAgentRegistration.decode(raw).host
                        self._beats[agent] = (None, now)
            for agent in self.hosts:
                beat = self.get(SPARK_HEARTBEAT_SCOPE, agent)
                if beat != self._beats[agent][0]:
                    self._beats[agent] = (beat, now)

    def alive(self, agent: str) -> bool:
        with self._lock:
            seen = self._beats.get(agent)
            return seen is not None and self.clock() - seen[1] < self.stale_seconds

    def live_agents(self, host: str | None = None) -> list[str]:
        with self._lock:
            agents = [a for a, h in self.hosts.items() if host is None or h == host]
        return [a for a in agents if self.alive(a)]

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """``{executor: live agents on it}`` (the discovery interface of the elastic driver)."""
        self.refresh()
        out: dict[str, int] = {}
        for agent in self.live_agents():
            host = self.hosts[agent]
            out[host] = out.get(host, 0) + 1
        return out


class _AgentWorker:
    """The driver's handle on one elastic worker, running in an agent's Spark task."""

    def __init__(self, job: _ElasticJob, key: Key, agent: str, seq: int) -> None:
        self.job, self.key, self.agent, self.seq = job, key, agent, seq
        self.finished = False

    def stop(self, grace: float = 5.0) -> None:
        self.job.command(self.agent, StopWorker(grace))

    def kill(self) -> None:
        self.job.command(self.agent, KillWorker())


class _ElasticJob:
    def __init__(self, sc: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], num_proc: int, min_np: int, max_np: int,
                 start_timeout: float, elastic_timeout: float | None, reset_limit: int | None,
                 env: dict[str, str] | None, stdout: IO[str] | None, stderr: IO[str] | None,
                 nics: list[str], timestamp: bool) -> None:
        import cloudpickle

        from horovod.common.protocol import FUNC_KEY, FUNC_SCOPE, FunctionCall
        from horovod.runner.elastic.discovery import HostManager
        from horovod.runner.launch.cluster_job import FunctionJob
        from horovod.runner.output import prefix_line
        from horovod.spark.driver import _driver_address
        from horovod.spark.output import OutputPump

        self.sc, self.num_tasks = sc, max_np
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.nics = nics
        bind, advertised = _driver_address(sc, nics)
        self.job = FunctionJob(advertised, bind_addr=bind)
        self.server = self.job.server
        self.server.put(FUNC_SCOPE, FUNC_KEY, cloudpickle.dumps(FunctionCall.of(fn, args, kwargs)))
        self.spec = JobSpec(addr=advertised, port=self.job.port, secret=self.job.secret,
                            num_proc=num_proc, timestamp=timestamp, start_timeout=start_timeout)
        self.agents = SparkAgents(self.server.get, self.num_tasks, agent_timeout())
        # The job's env= reaches the workers; the elastic settings come from the driver's
        # environment with env= over it (HOROVOD_ELASTIC_NOTIFY_WHEN_READY used to be ignored).
        settings = DriverSettings.from_env({**os.environ, **self.env}, timeout=elastic_timeout,
                                            reset_limit=reset_limit)
        self.session = ElasticSession(settings, HostManager(self.agents, None), num_proc, min_np,
                                      max_np, self.start_worker, self.job, discovery_interval=0.5,
                                      caller="horovod.spark.run_elastic")
        self.driver = self.session.driver
        self.procs: dict[str, _AgentWorker] = {}  # agent -> its current worker
        self.key_of: dict[str, Key] = {}
        self._cmd_seq: dict[str, int] = {}
        self._worker_seq = 0
        self._lock = threading.Lock()

        def fmt(agent: str, stream: str, text: str) -> str:
            key = self.key_of.get(agent)
            worker = self.driver.workers.get(key) if key is not None else None
            return prefix_line(worker.rank if worker is not None else None, stream, text, timestamp)

        self.pump = OutputPump(self.server.get, self.server.pop, stdout, stderr, fmt)
        self.group = f"horovod.spark.run_elastic.{uuid.uuid4().hex[:12]}"
        self.done = threading.Event()

    def command(self, agent: str, cmd: AgentCommand) -> None:
        """Give ``agent`` its next numbered command."""
        with self._lock:
            n = self._cmd_seq.get(agent, 0)
            self._cmd_seq[agent] = n + 1
        self.server.put(SPARK_COMMAND_SCOPE, spark_agent_key(agent, n), cmd.encode())

    def start_worker(self, key: Key, slot: SlotInfo) -> _AgentWorker:
        from horovod.common.protocol import RESULT_KEY_ENV

        with self._lock:
            busy = {a for a, p in self.procs.items() if not p.finished}
        free = [a for a in self.agents.live_agents(key[0]) if a not in busy]
        env = self.job.elastic_worker_env(slot, nics=self.nics, extra_env=self.env)
        env[RESULT_KEY_ENV] = key_name(key)
        with self._lock:
            self._worker_seq += 1
            seq = self._worker_seq
        if not free:
            # The executor went away between discovery and now: report the worker as lost.
            proc = _AgentWorker(self, key, f"none-{seq}", seq)
            threading.Thread(target=self.session.worker_exited,
                             args=(key, None, int(signal.SIGKILL)), daemon=True).start()
            proc.finished = True
            return proc
        agent = free[0]
        proc = _AgentWorker(self, key, agent, seq)
        with self._lock:
            self.procs[agent] = proc
            self.key_of[agent] = key
        # The secret stays out of the rendezvous: the agent has it from its Spark closure (JobSpec).
        env.pop(SECRET_ENV, None)
        self.command(agent, StartWorker(seq, env))
        return proc

    def _monitor(self) -> None:
        """Forward output; report workers that ended, or whose executor was lost."""
        while not self.done.wait(0.1):
            self.check()

    def check(self) -> None:
        self.pump.pump(list(self.agents.hosts))
        with self._lock:
            running = [p for p in self.procs.values() if not p.finished]
        for p in running:
            raw = self.server.get(SPARK_EXIT_SCOPE, spark_agent_key(p.agent, p.seq))
            if raw is not None:
                ended = SparkWorkerExit.decode(raw)
                p.finished = True
                self.session.worker_exited(p.key, ended.code, ended.signal, ended.record)
            elif not self.agents.alive(p.agent):
                p.finished = True
                log.warning("elastic: the Spark task of worker %s (agent %s) stopped sending "
                            "heartbeats: its executor is lost", key_name(p.key), p.agent)
                self.session.worker_exited(p.key, None, int(signal.SIGKILL))

    def _submit(self) -> None:
        from horovod.spark.task import elastic_agent

        spec = self.spec
        try:
            self.sc.setJobGroup(self.group, f"horovod.spark.run_elastic: up to {self.num_tasks} "
                                "processes", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.num_tasks), self.num_tasks)
            rdd.mapPartitions(lambda it: elastic_agent(spec, it)).collect()
        except BaseException as exc:  # noqa: BLE001 - ends the driver, which reports it
            if not self.done.is_set():
                from horovod.spark.driver import spark_failure_reason

                self.driver.abort("the Spark job of the elastic agents failed: "
                                  f"{spark_failure_reason(str(exc)) or exc}")

    def run(self) -> list[Any]:
        from horovod.runner.launch.elastic import configure_logging

        configure_logging()
        spark = threading.Thread(target=self._submit, name="hvd-spark-elastic-job", daemon=True)
        monitor = threading.Thread(target=self._monitor, name="hvd-spark-elastic-monitor",
                                   daemon=True)

        def finish() -> None:  # every worker has ended: end the agents
            self.done.set()
            monitor.join(5)
            self.check()
            for agent in list(self.agents.hosts):
                self.command(agent, ExitAgent())
            spark.join(15)
            if spark.is_alive():
                self.sc.cancelJobGroup(self.group)
                spark.join(10)

        spark.start()
        monitor.start()
        # (the session reads the results the workers stored once every agent has ended)
        return self.session.results(self.session.run(finish))


def run_elastic(fn: Callable[..., Any], args: tuple[Any, ...] = (),
                kwargs: dict[str, Any] | None = None, num_proc: int | None = None,
                min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: dict[str, str] | None = None,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
                nics: list[str] | set[str] | None = None,
                prefix_output_with_timestamp: bool = False, min_np: int | None = None,
                max_np: int | None = None, monitor_port: int | None = None,
                monitor_address: str | None = None) -> list[Any]:
    """Run ``fn`` as an elastic Horovod job over Spark executors (Gloo).

    ``fn`` should be an elastic training function (``hvd.elastic.run`` around the loop, state
    committed as it goes): when an executor is lost, the other workers restore the last commit
    and go on with at least ``min_num_proc`` workers; tasks Spark restarts are taken in again.

    Args:
        fn, args, kwargs: the function every worker runs, and its arguments.
        num_proc: workers to start with (default: ``spark.default.parallelism``).
        min_num_proc / max_num_proc: fewest workers to go on with, most to use (both default to
            ``num_proc``; ``min_np``/``max_np`` are the deprecated names). The Spark job has
            ``max_num_proc`` tasks.
        start_timeout: accepted for upstream compatibility; the wait for the first ``num_proc``
            workers is ``elastic_timeout``.
        elastic_timeout: seconds to wait for enough workers (``HOROVOD_ELASTIC_TIMEOUT``, 600).
        reset_limit: most resets before the job fails.
        env, stdout, stderr, verbose, nics, prefix_output_with_timestamp, monitor_port, monitor_address: as
            ``run`` (the monitor also shows the elastic rounds).

    Returns:
        The values returned by the workers of the final round, in rank order.

    Raises:
        WorkerFailedError: the job failed (every worker failed, too few workers for longer than
            ``elastic_timeout``, more than ``reset_limit`` resets, or the Spark job failed).
    """
    import sys

    from horovod.spark.driver import _configure_logging, _spark_context, default_start_timeout

    sc = _spark_context()
    min_num_proc = min_num_proc if min_num_proc is not None else min_np
    max_num_proc = max_num_proc if max_num_proc is not None else max_np
    if num_proc is None:
        num_proc = int(sc.defaultParallelism)
    min_num_proc = num_proc if min_num_proc is None else min_num_proc
    max_num_proc = num_proc if max_num_proc is None else max_num_proc
    if not 1 <= min_num_proc <= num_proc <= max_num_proc:
        raise ConfigError(f"run_elastic needs 1 <= min_num_proc ({min_num_proc}) <= num_proc "
                          f"({num_proc}) <= max_num_proc ({max_num_proc}).")
    _configure_logging(verbose)
    if verbose >= 1:
        print(f"Running elastic job: {num_proc} processes (at least {min_num_proc}, at most "
              f"{max_num_proc})...", file=stderr or sys.stderr, flush=True)
    job = _ElasticJob(sc, fn, tuple(args), dict(kwargs or {}), num_proc, min_num_proc,
                      max_num_proc, float(start_timeout or default_start_timeout()),
                      elastic_timeout, reset_limit, env, stdout, stderr,
                      sorted(nics) if isinstance(nics, set) else list(nics or []),
                      prefix_output_with_timestamp)
    from horovod.runner.monitor.cluster import run_monitored

    return run_monitored(job, monitor_port, monitor_address, "horovod.spark.run_elastic", stderr,
                         lambda: job.driver)
