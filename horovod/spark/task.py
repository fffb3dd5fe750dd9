"""What runs inside the Spark tasks of ``horovod.spark.run``: one Horovod rank per task.

Every task of the barrier stage knows the executor address of every other task
(``BarrierTaskContext.getTaskInfos()``) and reports them to the driver. The driver groups the
tasks by executor host (hosts in the order of their first task) and numbers the ranks host by
host, as ``horovodrun -H`` does, so ``local_rank``/``cross_rank`` follow; it computes every
rank's environment with ``horovod.runner.launch.cluster_job`` (the same plan code as
``horovodrun --gloo``). The task then starts its rank as the Gloo launcher starts a local one
(the worker shim running ``python -m horovod.runner.run_task``), forwards its output to the
driver (``horovod.spark.output``) and returns how it ended. The function, its result and any
exception travel through the driver's rendezvous service, as for ``horovod.run``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from horovod.common.protocol import (
    SECRET_ENV,
    SPARK_AGENT_SCOPE,
    SPARK_COMMAND_SCOPE,
    SPARK_ENV_SCOPE,
    SPARK_EXIT_SCOPE,
    SPARK_HEARTBEAT_SCOPE,
    SPARK_TASK_SCOPE,
    ExitAgent,
    FailureRecord,
    KillWorker,
    SparkAgentRegistration,
    SparkRankAssignment,
    SparkRankExit,
    SparkTaskStarted,
    SparkWorkerExit,
    StartWorker,
    StopWorker,
    agent_command,
    spark_agent_key,
)
from horovod.runner.hosts import HostSpec

__all__ = ["JobSpec", "run_rank", "elastic_agent", "executor_name",
           "group_by_host", "host_of_address", "barrier_task",
           "get_available_devices"]


@dataclass(frozen=True)
class JobSpec:
    """What the driver tells every task, pickled into the Spark closure: the only way the job
    secret reaches the tasks (Spark's own channel; never the rendezvous service; no secret in logs)."""

    addr: str
    port: int
    secret: str
    num_proc: int
    executable: str | None = None
    timestamp: bool = False
    start_timeout: float = 600.0


def host_of_address(address: str) -> str:
    """``"10.0.0.5:41234"`` -> ``"10.0.0.5"`` (IPv6 ``"[::1]:41234"`` -> ``"::1"``)."""
    host = address.rpartition(":")[0] or address
    return host.strip("[]")


def group_by_host(addresses: list[str]) -> tuple[list[HostSpec], list[int]]:
    """The job's hosts (in order of their first task) and the rank of each partition.

    ``addresses[p]`` is the executor address of partition ``p``. Ranks fill one host after the
    other, partitions of a host in partition order, so ``assign_slots(hosts, n)[ranks[p]]`` is
    partition ``p``'s slot.
    """
    by_host: dict[str, list[int]] = {}
    for partition, address in enumerate(addresses):
        by_host.setdefault(host_of_address(address), []).append(partition)
    ranks = [0] * len(addresses)
    rank = 0
    for partitions in by_host.values():
        for partition in partitions:
            ranks[partition] = rank
            rank += 1
    return [HostSpec(h, len(p)) for h, p in by_host.items()], ranks


def _client(spec: JobSpec) -> Any:
    from horovod.runner.rendezvous import RendezvousClient

    return RendezvousClient(spec.addr, spec.port, spec.secret)


def task_pythonpath() -> str:
    """The import path this task has beyond the interpreter's own: what Spark added (``--py-files``
    and ``addPyFile`` files, the executor's ``PYTHONPATH``), so the rank imports what the task can."""
    own = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    return os.pathsep.join(dict.fromkeys(p for p in sys.path if p and not p.startswith(own)))


def _worker_command(spec: JobSpec, env: dict[str, str], ranks: tuple[int, ...], host: str) -> Any:
    """The worker shim running ``python -m horovod.runner.run_task`` with this executor's
    environment, this task's import path, ``env`` and the job secret (from the task's closure: the
    driver never sends it over the rendezvous); stdin is its life line (the rank dies with this
    task)."""
    from horovod.runner.launch.commands import Command, shim_argv

    python = spec.executable or sys.executable
    return Command(argv=shim_argv([python, "-m", "horovod.runner.run_task"], python=python,
                                  watch_stdin=True),
                   env={**os.environ, "PYTHONPATH": task_pythonpath(), **env, SECRET_ENV: spec.secret},
                   ranks=ranks,
                   host=host, lifeline=True)


def run_rank(spec: JobSpec, rank: int, host: str, local_rank: int, env: dict[str, str],
             ) -> SparkRankExit:
    """Start rank ``rank`` here under the worker shim, forward its output, wait for its end.

    ``env`` is what the driver computed for the rank (``FunctionJob``: identity, rendezvous,
    secret); it is added to this executor's environment.

    Returns how the rank ended (its exit code or signal, failure record, last stderr lines).
    """
    from horovod.runner.elastic.workers import WorkerProcess
    from horovod.spark.output import RemoteOutput

    cmd = _worker_command(spec, env, (rank,), host)
    client = _client(spec)
    output = RemoteOutput(client.put, rank)
    tail: list[str] = []

    class _Tail:
        """stderr goes to the driver and its last lines into the exit report."""

        def write(self, text: str) -> int:
            output.stderr.write(text)
            tail.append(text.rstrip("\n"))
            del tail[:-20]
            return len(text)

        def flush(self) -> None:
            pass

    ended = threading.Event()
    status: list[tuple[int | None, int | None]] = []

    def on_exit(code: int | None, sig: int | None, _record: object) -> None:
        status.append((code, sig))
        ended.set()

    proc = WorkerProcess(cmd, f"rank {rank}", lambda: rank, on_exit, stdout=output.stdout,  # type: ignore[arg-type]
                         stderr=_Tail(), timestamp=spec.timestamp)  # type: ignore[arg-type]
    try:
        while not ended.wait(1.0):
            pass
    finally:
        # A Spark kill (job cancelled, stage aborted) interrupts this wait: stop the rank too.
        if not ended.is_set():
            proc.stop(grace=2.0)
        output.close()
    code, sig = status[0]
    info = proc.exit_info
    return SparkRankExit(rank, host, local_rank, code, sig,
                         (info.time if info is not None else None) or time.time(),
                         proc.exit_record, tuple(tail[-20:]))


def barrier_task(spec: JobSpec, _rows: Iterator[Any]) -> Iterator[SparkRankExit]:
    """The body of every barrier task of ``horovod.spark.run``: reports that it started
    (``SparkTaskStarted``), reads its rank (``SparkRankAssignment``), runs it, and yields how it
    ended (one ``SparkRankExit``, the task's row)."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    addresses = [info.address for info in ctx.getTaskInfos()]
    client = _client(spec)
    client.put(SPARK_TASK_SCOPE, str(partition),
               SparkTaskStarted(tuple(addresses), ctx.attemptNumber(), os.getpid()).encode())
    mine = SparkRankAssignment.decode(client.wait(SPARK_ENV_SCOPE, str(partition),
                                                  timeout=spec.start_timeout))
    yield run_rank(spec, mine.rank, mine.host, mine.local_rank, mine.env)


# Elastic agents (run_elastic): registration, heartbeats, commands from the driver, worker exits.
# An agent whose driver has not answered for this long stops its worker and ends its task.
DRIVER_LOST_SECONDS = 30.0


def executor_name(route_to: str) -> str:
    """This executor as an elastic "host": its IP and Spark executor id (``10.0.0.5/exec-3``).

    Spark loses executors, not machines, so ``run_elastic`` treats each executor as a host (a
    lost executor is blacklisted alone, not every executor of its machine).
    """
    import re
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((route_to, 9))
            ip = str(s.getsockname()[0])
        except OSError:
            ip = "127.0.0.1"
    m = re.search(r"executorId=([^&]+)", os.environ.get("SPARK_LOG_URL_STDERR", ""))
    if m:
        return f"{ip}/exec-{m.group(1)}"
    # Elsewhere the executor is the JVM that started the Python daemon that forked this worker.
    try:
        import psutil

        return f"{ip}/jvm-{psutil.Process(os.getppid()).ppid()}"
    except Exception:  # noqa: BLE001 - psutil missing or the process gone
        return f"{ip}/pid-{os.getppid()}"


def elastic_agent(spec: JobSpec, _rows: Iterator[Any]) -> Iterator[str]:
    """The body of every Spark task of ``run_elastic``: a slot the elastic driver starts workers in.

    The agent registers (``SPARK_AGENT_SCOPE/<partition>.<attempt>``), sends a heartbeat every 0.5 s,
    and follows the driver's numbered commands (``SPARK_COMMAND_SCOPE/<agent>.<n>``, a
    ``protocol.AgentCommand``): ``StartWorker`` with the given environment, ``StopWorker`` or
    ``KillWorker``, ``ExitAgent``. Each worker's end (``SparkWorkerExit``) goes to
    ``SPARK_EXIT_SCOPE/<agent>.<seq>``; its output to the driver under the agent's name.
    """
    from pyspark import TaskContext

    from horovod.runner.elastic.workers import WorkerProcess
    from horovod.spark.output import RemoteOutput

    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("the elastic agent runs inside a Spark task (TaskContext.get() is None here)")
    agent = f"{ctx.partitionId()}.{ctx.attemptNumber()}"
    client = _client(spec)
    client.put(SPARK_AGENT_SCOPE, agent,
               SparkAgentRegistration(executor_name(spec.addr), os.getpid(), ctx.attemptNumber()).encode())
    stop = threading.Event()
    last_ok = [time.monotonic()]

    def heartbeat() -> None:
        beat = 0
        while not stop.wait(0.5):
            beat += 1
            try:
                client.put(SPARK_HEARTBEAT_SCOPE, agent, str(beat).encode())
                last_ok[0] = time.monotonic()
            except Exception:  # noqa: BLE001 - counted below
                if time.monotonic() - last_ok[0] > DRIVER_LOST_SECONDS:
                    stop.set()

    threading.Thread(target=heartbeat, daemon=True, name="hvd-spark-heartbeat").start()
    proc: WorkerProcess | None = None
    output = RemoteOutput(client.put, agent)
    n = 0
    try:
        while not stop.is_set():
            try:
                raw = client.get(SPARK_COMMAND_SCOPE, spark_agent_key(agent, n))
            except Exception:  # noqa: BLE001 - the heartbeat decides when the driver is gone
                raw = None
            if raw is None:
                stop.wait(0.1)
                continue
            cmd = agent_command(raw)
            n += 1
            if isinstance(cmd, StartWorker):

                def on_exit(code: int | None, sig: int | None, record: FailureRecord | None,
                            seq: int = cmd.seq) -> None:
                    output.close_batch()
                    client.put(SPARK_EXIT_SCOPE, spark_agent_key(agent, seq),
                               SparkWorkerExit(code, sig, record).encode())

                proc = WorkerProcess(_worker_command(spec, cmd.env, (), agent), agent, lambda: None, on_exit,
                                     stdout=output.stdout, stderr=output.stderr)  # type: ignore[arg-type]
            elif isinstance(cmd, StopWorker) and proc is not None:
                proc.stop(grace=cmd.grace)
            elif isinstance(cmd, KillWorker) and proc is not None:
                proc.kill()
            elif isinstance(cmd, ExitAgent):
                break
    finally:
        stop.set()
        if proc is not None and proc.popen.poll() is None:
            proc.stop(grace=2.0)
        output.close()
    yield agent


def get_available_devices() -> list[str]:
    """The GPU addresses Spark assigned to this task (Spark resource scheduling), as upstream."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return []
    resources = ctx.resources()
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else []
