"""One real Spark cluster for all Spark tests: ``local-cluster[2,1,1024]`` (a master, a worker
and two executor JVMs of one core each), started once per session."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
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


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Any]:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("horovod-spark-tests")
             .config("spark.ui.enabled", "false")
             .config("spark.pyspark.python", sys.executable)
             .config("spark.pyspark.driver.python", sys.executable)
             .getOrCreate())
    spark.sparkContext.setLogLevel("FATAL")
    try:
        yield spark
    finally:
        spark.stop()


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
