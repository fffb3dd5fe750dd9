"""The monitor of ``horovod.spark.run`` and ``run_elastic`` on the real local-cluster (two executor
JVMs): rank 0 reads ``/metrics`` on the driver while the job runs, until every rank's report is
there; the test checks one ``horovod_rank_info`` per rank and non-zero counters for every rank."""

from __future__ import annotations

import io
import re
import socket
import sys

import pytest

import horovod.spark
from horovod.common.exceptions import LaunchError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

_SAMPLE = re.compile(r'^(horovod_\w+)\{([^}]*)\} (\S+)$')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample of metric ``name`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((labels, float(m.group(3))))
    return out


def every_rank_counted(text: str, size: int) -> bool:
    ranks = {lab["rank"] for lab, v in samples(text, "horovod_collectives_total")
             if lab["op"] == "allreduce" and v > 0}
    return ranks == {str(r) for r in range(size)}


def _steps_reading_metrics(port: int) -> str:
    """Allreduce steps until rank 0 has read /metrics with every rank's counters in it."""
    import time
    import urllib.request

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    text, deadline = "", time.monotonic() + 120
    while True:
        hvd.allreduce(np.ones(4, np.float32), name="grad")
        done = 0
        if hvd.rank() == 0:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            done = int(every_rank_counted(text, hvd.size()) or time.monotonic() > deadline)
        if hvd.broadcast(np.array([done]), 0, name="stop")[0]:
            break
        time.sleep(0.05)
    hvd.shutdown()
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_metrics(text: str, size: int) -> None:
    info = samples(text, "horovod_rank_info")
    assert sorted(lab["rank"] for lab, _ in info) == [str(r) for r in range(size)], text
    counted = {lab["rank"]: v for lab, v in samples(text, "horovod_collectives_total")
               if lab["op"] == "allreduce"}
    nbytes = {lab["rank"]: v for lab, v in samples(text, "horovod_collective_bytes_total")
              if lab["op"] == "allreduce"}
    steps = {lab["rank"]: v for lab, v in samples(text, "horovod_steps_total")}
    for r in map(str, range(size)):
        assert counted.get(r, 0) > 0 and steps.get(r, 0) > 0, (r, text)
        # every allreduce of this job is 4 float32s: 16 bytes per tensor, exactly
        assert nbytes[r] == 16 * counted[r], (r, text)


def test_run_monitor_counts_every_rank(spark):
    port = free_port()
    err = io.StringIO()
    results = horovod.spark.run(_steps_reading_metrics, args=(port,), num_proc=2, stdout=io.StringIO(),
                                stderr=err, start_timeout=60, monitor_port=port)
    assert f"horovod.spark.run: monitor at http://127.0.0.1:{port}/" in err.getvalue()
    check_metrics(results[0], 2)


def test_run_elastic_monitor_counts_every_rank(spark):
    port = free_port()
    err = io.StringIO()
    results = horovod.spark.run_elastic(_steps_reading_metrics, args=(port,), num_proc=2,
                                        elastic_timeout=60, stdout=io.StringIO(), stderr=err,
                                        monitor_port=port)
    assert f"horovod.spark.run_elastic: monitor at http://127.0.0.1:{port}/" in err.getvalue()
    text = next(t for t in results if t)
    check_metrics(text, 2)
    rounds = samples(text.replace("horovod_elastic_rounds_total ", "horovod_elastic_rounds_total{} "),
                     "horovod_elastic_rounds_total")
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
