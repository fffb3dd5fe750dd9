"""The monitor of ``RayExecutor`` jobs on the real local Ray cluster (2 nodes): rank 0 reads
``/metrics`` on the driver while the job runs, until every rank's report is there; one
``horovod_rank_info`` per rank and non-zero counters for every rank; a raising rank is the
monitor's failure culprit; the monitor stops with ``shutdown()``."""

from __future__ import annotations

import io
import json
import urllib.request
from contextlib import redirect_stderr

import pytest

import tests._metrics_text as metrics_text
from horovod.common import exceptions as errors
from horovod.ray import RayExecutor
from tests._metrics_text import check_metrics, free_port, samples

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def _ship() -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(metrics_text)  # the actors cannot import the tests


def _raise_on_rank_1():
    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank 1")
    return hvd.rank()


def _job(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/job", timeout=10) as r:
        return json.loads(r.read())


def test_static_monitor_counts_every_rank_and_names_the_failure(free_cluster):
    _ship()
    port = free_port()
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30, monitor_port=port), num_workers=3)
    err = io.StringIO()
    with redirect_stderr(err):
        ex.start()
    try:
        assert f"RayExecutor: monitor at http://127.0.0.1:{port}/" in err.getvalue()
        texts = ex.run(metrics_text.steps_reading_metrics, args=[port])
        check_metrics(texts[0], 3)
        assert samples(texts[0], "horovod_world_size") == [({}, 3.0)]
        with pytest.raises(errors.WorkerFailedError):
            ex.run(_raise_on_rank_1)
        failure = _job(port)["failure"]
        assert failure["rank"] == 1 and "bad batch on rank 1" in failure["error"], failure
    finally:
        ex.shutdown()
    with pytest.raises(OSError):  # shutdown() stopped the monitor
        _job(port)


def test_elastic_monitor_counts_every_rank(free_cluster):
    _ship()
    port = free_port()
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30, monitor_port=port), min_workers=2,
                     max_workers=2, elastic_timeout=60)
    with redirect_stderr(io.StringIO()):
        ex.start()
    try:
        texts = ex.run(metrics_text.steps_reading_metrics, args=[port])
        text = next(t for t in texts if t)
        check_metrics(text, 2)
        assert samples(text, "horovod_elastic_rounds_total")[0][1] >= 1, text
    finally:
        ex.shutdown()


def test_port_in_use_fails_before_any_worker_starts(free_cluster):
    import socket

    import ray

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        ex = RayExecutor(RayExecutor.create_settings(monitor_port=port), num_workers=2)
        with pytest.raises(errors.LaunchError, match="port is in use.*No rank was started"):
            ex.start()
    assert ex.adapter is None
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0)
