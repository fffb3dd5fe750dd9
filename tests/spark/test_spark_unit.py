"""Pure pieces of horovod.spark: rank numbering by executor host, failure text, output relay,
elastic agent discovery, argument errors (no Spark cluster needed)."""

from __future__ import annotations

import io
import json

import pytest

from horovod.common.exceptions import ConfigError, HorovodInternalError
from horovod.common.protocol import SPARK_AGENT_SCOPE as AGENT_SCOPE
from horovod.common.protocol import SPARK_HEARTBEAT_SCOPE as HEARTBEAT_SCOPE
from horovod.common.protocol import SparkAgentRegistration, SparkOutputBatch, SparkRankAssignment, SparkTaskStarted
from horovod.runner.launch.cluster_job import FunctionJob
from horovod.spark.output import OutputPump, RemoteOutput
from horovod.spark.task import group_by_host, host_of_address


def test_host_of_address_ipv4_and_ipv6():
    assert host_of_address("10.0.0.5:41234") == "10.0.0.5"
    assert host_of_address("[::1]:41234") == "::1"


def test_group_by_host_numbers_ranks_host_by_host():
    hosts, ranks = group_by_host(["b:1", "a:2", "b:3", "a:4", "c:5"])
    assert [(h.name, h.slots) for h in hosts] == [("b", 2), ("a", 2), ("c", 1)]
    # partitions on b get ranks 0, 1; on a 2, 3; on c 4
    assert ranks == [0, 2, 1, 3, 4]


def test_group_by_host_gives_local_and_cross_ranks():
    hosts, ranks = group_by_host(["h1:1", "h2:1", "h1:2"])
    with FunctionJob("127.0.0.1", bind_addr="127.0.0.1") as job:
        envs = job.worker_envs(hosts)
    by_partition = [envs[r][1] for r in ranks]
    got = [(e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_CROSS_RANK"], e["HOROVOD_HOSTNAME"])
           for e in by_partition]
    assert got == [("0", "0", "0", "h1"), ("2", "0", "1", "h2"), ("1", "1", "0", "h1")]


def test_spark_failure_reason_keeps_reason_and_python_error():
    from horovod.spark.runner import spark_failure_reason

    text = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover "
            "from a failed barrier ResultStage. Most recent failure reason: Stage failed because "
            "barrier task ResultTask(0, 1) finished unsuccessfully.\n"
            "ExecutorLostFailure (executor 1 exited caused by one of the running tasks) Reason: "
            "Command exited with code 137\n\tat org.apache.spark.Foo(Foo.scala:1)\n")
    reason = spark_failure_reason(text)
    assert "barrier task ResultTask(0, 1) finished unsuccessfully" in reason
    assert "Command exited with code 137" in reason
    assert "Foo.scala" not in reason


_LOST_EXECUTOR = (
    "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
    ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a "
    "failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task "
    "ResultTask(3, 1) finished unsuccessfully.\nExecutorLostFailure (executor 1 exited caused by one "
    "of the running tasks) Reason: Command exited with code 137\n")


def test_failed_partitions_from_spark_messages():
    from horovod.spark.runner import failed_partitions

    assert failed_partitions(_LOST_EXECUTOR) == [1]
    assert failed_partitions("Task 2 in stage 4.0 failed 1 times, most recent failure: Lost task 2.0 in "
                             "stage 4.0 (TID 9) (10.0.0.2 executor 3): ... ResultTask(4, 0)") == [2, 0]
    assert failed_partitions("Job aborted: something else") == []


@pytest.mark.parametrize("reported", [[], [0]])
def test_lost_executor_names_the_rank_spark_names(reported):
    # The killed executor ran partition 1 (rank 1). Rank 0 may have reported its own "a peer
    # left" result in time, or its task may have been cancelled with the stage first: either
    # way the error is rank 1's, and rank 0 is named only as stopping with it.
    from horovod.common.protocol import RESULT_SCOPE
    from horovod.spark.runner import _Job

    class Store:
        def get(self, scope, key):
            assert scope == RESULT_SCOPE
            return b"x" if int(key) in reported else None

    job = object.__new__(_Job)
    job.spark_error = RuntimeError(_LOST_EXECUTOR)
    job.server = Store()
    job.num_proc = 2
    job.ranks = [0, 1]
    err = job._spark_failure({0: SparkTaskStarted(("10.0.0.1:1", "10.0.0.2:2"))})
    assert err.rank == 1
    text = str(err)
    assert text.startswith("horovod.spark.run: rank 1 (partition 1, executor 10.0.0.2:2) ended without a "
                           "result: its Spark task or executor was lost"), text
    assert ("rank 0 (partition 0, executor 10.0.0.1:1) stopped with it" in text) == (reported == [])
    assert "Command exited with code 137" in text and "run_elastic" in text


def test_output_relay_keeps_order_per_rank_and_streams():
    store: dict[tuple[str, str], bytes] = {}
    out, err = io.StringIO(), io.StringIO()
    pump = OutputPump(lambda s, k: store.get((s, k)), lambda s, k: store.pop((s, k), None), out, err)
    relay = RemoteOutput(lambda s, k, v: store.__setitem__((s, k), v), 1)
    for i in range(5):
        relay.stdout.write(f"[1]<stdout>:line {i}\n")
        relay.close_batch()  # one batch per line: the pump must read them in order
    relay.stderr.write("[1]<stderr>:oops\n")
    relay.close()
    pump.pump([0, 1])
    assert out.getvalue() == "".join(f"[1]<stdout>:line {i}\n" for i in range(5))
    assert err.getvalue() == "[1]<stderr>:oops\n"
    assert not store  # every batch was taken off the store


def test_output_pump_formats_on_the_driver():
    store = {("spark_output", "0.1.0"): SparkOutputBatch((("stdout", "hi\n"),)).encode()}
    out = io.StringIO()
    pump = OutputPump(lambda s, k: store.get((s, k)),
                      lambda s, k: store.pop((s, k), None), out, None,
                      fmt=lambda src, stream, text: f"<{src}|{stream}>{text}")
    pump.pump(["0.1"])
    assert out.getvalue() == "<0.1|stdout>hi\n"


def test_output_pump_names_the_batch_it_cannot_read():
    """A batch in another format (a task of another horovod-py version) stops the job with an
    error naming its key and source, not a bare JSON or unpacking error."""
    store = {("spark_output", "2.0"): SparkOutputBatch((("stdout", "ok\n"),)).encode(),
             ("spark_output", "2.1"): json.dumps([["stdout", "old format\n"]]).encode()}
    out = io.StringIO()
    pump = OutputPump(lambda s, k: store.get((s, k)), lambda s, k: store.pop((s, k), None), out, None)
    with pytest.raises(HorovodInternalError, match=r"spark_output/2\.1 \(from rank or agent 2\): Spark task's "
                                                   r"output batch .* malformed"):
        pump.pump([2])
    assert out.getvalue() == "ok\n"


def test_spark_agents_discovery_counts_live_agents_per_executor():
    from horovod.spark.elastic import SparkAgents

    store: dict[tuple[str, str], bytes] = {}
    now = [100.0]
    agents = SparkAgents(lambda s, k: store.get((s, k)), num_tasks=3, stale_seconds=5.0,
                         clock=lambda: now[0])
    assert agents.find_available_hosts_and_slots() == {}
    for agent, host in (("0.0", "ip/exec-0"), ("1.0", "ip/exec-1"), ("2.0", "ip/exec-1")):
        store[(AGENT_SCOPE, agent)] = SparkAgentRegistration(host).encode()
    assert agents.find_available_hosts_and_slots() == {"ip/exec-0": 1, "ip/exec-1": 2}
    # exec-1's agents keep beating, exec-0's falls silent: after 5 s it is gone
    for t in (102.0, 104.0, 106.0):
        now[0] = t
        store[(HEARTBEAT_SCOPE, "1.0")] = str(t).encode()
        store[(HEARTBEAT_SCOPE, "2.0")] = str(t).encode()
        found = agents.find_available_hosts_and_slots()
    assert found == {"ip/exec-1": 2}
    assert not agents.alive("0.0") and agents.alive("1.0")
    # Spark re-ran partition 0 (attempt 1) on a new executor
    store[(AGENT_SCOPE, "0.1")] = SparkAgentRegistration("ip/exec-2").encode()
    assert agents.find_available_hosts_and_slots() == {"ip/exec-1": 2, "ip/exec-2": 1}
    assert agents.live_agents("ip/exec-1") == ["1.0", "2.0"]


def test_run_refuses_mpi_with_a_clear_error():
    import horovod.spark

    with pytest.raises(ConfigError, match=r"use_mpi=True\) is not supported"):
        horovod.spark.run(lambda: 0, num_proc=2, use_mpi=True)
    with pytest.raises(ConfigError, match="not both"):
        horovod.spark.run(lambda: 0, num_proc=2, use_mpi=True, use_gloo=True)


def test_run_without_spark_context_says_so(monkeypatch):
    pytest.importorskip("pyspark")
    from pyspark import SparkContext

    import horovod.spark

    # (the Spark tests' session may be active in this process: hide it)
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    with pytest.raises(RuntimeError, match="Could not find an active SparkContext"):
        horovod.spark.run(lambda: 0, num_proc=2)
    with pytest.raises(RuntimeError, match="Could not find an active SparkContext"):
        horovod.spark.run_elastic(lambda: 0, num_proc=2)


def test_the_secret_reaches_tasks_only_through_their_closure():
    """The driver publishes each partition's environment on the rendezvous (plain HTTP) without
    the job secret; the task adds the secret from its pickled JobSpec (Spark's own channel)."""
    import pickle

    from horovod.common.protocol import SECRET_ENV
    from horovod.common.protocol import SPARK_ENV_SCOPE as ENV_SCOPE
    from horovod.spark.runner import _Job
    from horovod.spark.task import _worker_command

    class _Conf:
        def get(self, key, default=None):
            return default

    class _Sc:
        def getConf(self):
            return _Conf()

    job = _Job(_Sc(), lambda: 0, (), {}, 2, 30.0, {"MY_VAR": "1"}, None, None, None, False, None)
    try:
        secret = job.spec.secret
        assert len(secret) == 64
        job.assign({0: SparkTaskStarted(("10.0.0.1:1", "10.0.0.2:2"))})
        published = [job.server.get(ENV_SCOPE, str(p)) for p in range(2)]
        assert all(raw is not None and secret.encode() not in raw for raw in published), published
        env = SparkRankAssignment.decode(published[1]).env
        assert SECRET_ENV not in env and env["MY_VAR"] == "1" and env["HOROVOD_RANK"] == "1"
        spec = pickle.loads(pickle.dumps(job.spec))  # what the closure carries
        cmd = _worker_command(spec, env, (1,), "10.0.0.2")
        assert cmd.env[SECRET_ENV] == secret and secret not in " ".join(cmd.argv)
    finally:
        job.server.stop()
