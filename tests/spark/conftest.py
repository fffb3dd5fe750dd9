"""One real Spark cluster for all Spark tests: ``local-cluster[2,1,1024]`` (a master, a worker
and two executor JVMs of one core each), started by the first test of this directory that needs it
and stopped after the last test of this directory (its idle JVMs would otherwise take CPU and
memory from the tests collected after these, until the session ends)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest


def _unavailable() -> str | None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed (pip install 'horovod-py[spark]')"
    if shutil.which("java") is None:
        return "Spark needs Java (17), and no java is on PATH"
    return None


HERE = Path(__file__).resolve().parent
# The cluster's JVMs live minutes and run small jobs on two cores: C1's quick JIT only (C2 compiling
# their hot code cost more CPU than it won back: the cluster's start took 32-34 s against 17-18 s,
# the first Parquet write of the digits 38-45 s against 18-26 s, measured back to back) and one GC
# thread. JIT and GC choices change no result.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
_running: list[Any] = []  # the cluster's SparkSession, from its start to the end of this directory's tests


def _cluster() -> Any:
    if not _running:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("horovod-spark-tests")
                 .config("spark.ui.enabled", "false")
                 .config("spark.driver.extraJavaOptions", JVM_OPTIONS)  # master and worker run in the driver's JVM
                 .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
                 .config("spark.pyspark.python", sys.executable)
                 .config("spark.pyspark.driver.python", sys.executable)
                 .getOrCreate())
        spark.sparkContext.setLogLevel("FATAL")
        _running.append(spark)
    return _running[0]


def _stop() -> None:
    while _running:
        _running.pop().stop()


@pytest.fixture(scope="module")
def spark_session() -> Any:
    """The cluster (module-scoped for the module-scoped fits; every module shares the one cluster)."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    return _cluster()


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of this test's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Called for the tests of this directory only: stop the cluster after the last of them (a
    test collected after tests of other directories would start it again)."""
    if nextitem is None or HERE not in Path(nextitem.path).resolve().parents:
        _stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop()  # an interrupted run


@pytest.fixture
def spark(spark_session: Any) -> Any:
    """The session, once both executors are up (a test may have killed one: the worker restarts
    it, which takes a few seconds)."""
    from horovod.spark.runner import free_task_slots

    deadline = time.monotonic() + 90
    while (free_task_slots(spark_session.sparkContext) or 0) < 2:
        if time.monotonic() > deadline:
            pytest.fail("the local Spark cluster did not get its 2 executors back within 90 s")
        time.sleep(0.5)
    return spark_session
