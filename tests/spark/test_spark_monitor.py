"""The monitor of ``horovod.spark.run`` and ``run_elastic`` on the real local-cluster (two executor
JVMs): rank 0 reads ``/metrics`` on the driver while the job runs, until every rank's report is
there; the test checks one ``horovod_rank_info`` per rank and non-zero counters for every rank."""

from __future__ import annotations

import io
import socket

import pytest

import horovod.spark
from horovod.common.exceptions import LaunchError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

import cloudpickle  # noqa: E402

import tests._metrics_text as metrics_text  # noqa: E402
from tests._metrics_text import check_metrics, free_port, samples  # noqa: E402

cloudpickle.register_pickle_by_value(metrics_text)  # the executors cannot import the tests


def test_run_monitor_counts_every_rank(spark):
    port = free_port()
    err = io.StringIO()
    results = horovod.spark.run(metrics_text.steps_reading_metrics, args=(port,), num_proc=2,
                                stdout=io.StringIO(), stderr=err, start_timeout=60, monitor_port=port)
    assert f"horovod.spark.run: monitor at http://127.0.0.1:{port}/" in err.getvalue()
    check_metrics(results[0], 2)


def test_run_elastic_monitor_counts_every_rank(spark):
    port = free_port()
    err = io.StringIO()
    results = horovod.spark.run_elastic(metrics_text.steps_reading_metrics, args=(port,),
                                        num_proc=2, elastic_timeout=60, stdout=io.StringIO(), stderr=err,
                                        monitor_port=port)
    assert f"horovod.spark.run_elastic: monitor at http://127.0.0.1:{port}/" in err.getvalue()
    text = next(t for t in results if t)
    check_metrics(text, 2)
    rounds = samples(text, "horovod_elastic_rounds_total")
    assert rounds and rounds[0][1] >= 1, text


def test_run_monitor_port_in_use_fails_before_any_task(spark, tmp_path):
    marker = tmp_path / "ran"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match="port is in use.*No rank was started"):
            horovod.spark.run(marker.touch, num_proc=2, stderr=io.StringIO(), start_timeout=60,
                              monitor_port=port)
    assert not marker.exists()
