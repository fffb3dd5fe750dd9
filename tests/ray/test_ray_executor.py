"""Static ``RayExecutor`` jobs on a real local Ray cluster (2 nodes: 2 + 1 CPUs)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from ray_jobs import identity as _identity

from horovod.common import exceptions as errors
from horovod.ray import RayExecutor

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def _settings(**kw):
    return RayExecutor.create_settings(timeout_s=kw.pop("timeout_s", 20), **kw)


def _pg_id():
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    return pg.id.hex() if pg is not None else None


def _executor_inside_placement_group():
    ex = RayExecutor(_settings(), num_workers=2)  # use_current_placement_group=True (default)
    ex.start()
    try:
        return ex.run(_pg_id), ex.adapter.owns_pg
    finally:
        ex.shutdown()


def test_ranks_go_into_the_current_placement_group(free_cluster):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=30)
    try:
        task = ray.remote(num_cpus=0)(_executor_inside_placement_group).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_capture_child_tasks=True))
        ids, owned = ray.get(task.remote(), timeout=120)
    finally:
        remove_placement_group(pg)
    assert ids == [pg.id.hex()] * 2 and owned is False


def test_num_hosts_places_one_rank_per_node(free_cluster):
    ex = RayExecutor(_settings(), num_hosts=2, num_workers_per_host=1)
    ex.start()
    try:
        out = ex.run(_identity, args=["hosts"])
    finally:
        ex.shutdown()
    assert len({o["node"] for o in out}) == 2
    assert [(o["rank"], o["local_rank"], o["local_size"], o["cross_rank"], o["cross_size"])
            for o in out] == [(0, 0, 1, 0, 2), (1, 0, 1, 1, 2)]


def _raise_on_rank_1():
    import torch

    import horovod.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank 1")
    hvd.allreduce(torch.ones(1), name="after")
    return hvd.rank()


def test_raising_function_names_rank_and_node(free_cluster):
    # A Gloo timeout far above the bound below: the error must not come from a timeout.
    ex = RayExecutor(_settings(timeout_s=120), num_workers=2)
    ex.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.WorkerFailedError) as info:
            ex.run(_raise_on_rank_1)
        elapsed = time.monotonic() - t0
        err = info.value
        assert err.rank == 1 and isinstance(err.exception, ValueError), err
        assert isinstance(err.__cause__, ValueError)
        text = str(err)
        assert "rank 1 (node " in text and "raised ValueError: bad batch on rank 1" in text, text
        assert "Traceback of rank 1" in text and "_raise_on_rank_1" in text, text
        # rank 0 was left waiting in its allreduce: not a hang until the 120 s Gloo timeout (a
        # bound that holds at load 10)
        assert elapsed < 90, elapsed
        # Rank 0 was stuck in a collective, so the workers were stopped: start() again.
        with pytest.raises(errors.LaunchError, match="call start\\(\\) again"):
            ex.run(_identity, args=["x"])
        ex.start()
        assert [o["rank"] for o in ex.run(_identity, args=["after restart"])] == [0, 1]
    finally:
        ex.shutdown()


def _die_on_rank_1():
    import torch

    import horovod.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="before")
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce(torch.ones(1), name="after")
    return hvd.rank()


def test_killed_actor_is_a_clear_error(free_cluster):
    ex = RayExecutor(_settings(timeout_s=120), num_workers=3)
    ex.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.WorkerFailedError) as info:
            ex.run(_die_on_rank_1)
        elapsed = time.monotonic() - t0
        text = str(info.value)
        assert info.value.rank == 1, text
        assert text.startswith("RayExecutor.run(_die_on_rank_1): rank 1 (node "), text
        assert "died" in text and "call start() again" in text, text
        assert elapsed < 90, elapsed  # not the 120 s Gloo timeout
    finally:
        ex.shutdown()


@pytest.mark.parametrize("num_workers,num_hosts,num_workers_per_host,what", [
    (5, None, None, "5 worker(s)"),  # upstream's tests pass num_workers_per_host=None explicitly
    (None, 1, 5, "1 node(s) with 5 worker(s) each"),
])
def test_too_few_cpus_is_a_timeout_error_within_the_placement_timeout(free_cluster, num_workers, num_hosts,
                                                                      num_workers_per_host, what):
    ex = RayExecutor(_settings(placement_group_timeout_s=3), num_workers=num_workers, num_hosts=num_hosts,
                     num_workers_per_host=num_workers_per_host)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:  # upstream's type; also our LaunchError
        ex.start()
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, errors.LaunchError)
    text = str(info.value)
    assert f"could not reserve {what}" in text and "3 CPU(s) in total" in text, text
    assert "placement_group_timeout_s=3" in text, text
    assert elapsed < 60, elapsed  # the 3 s placement timeout and the report, not a hang
    with pytest.raises(errors.LaunchError, match="call start"):
        ex.run(_identity, args=["never"])


def test_num_workers_per_host_none_with_num_workers_places_num_workers(free_cluster):
    ex = RayExecutor(_settings(), num_workers=2, num_hosts=None, num_workers_per_host=None)
    ex.start()
    try:
        assert [r["rank"] for r in ex.run(_identity, args=["x"])] == [0, 1]
    finally:
        ex.shutdown()


def test_argument_errors():
    s = _settings()
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers` provided. Give either num_workers"):
        RayExecutor(s, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="max_workers was given without a positive min_workers"):
        RayExecutor(s, max_workers=2)
    with pytest.raises(ValueError, match="use_gpu=True"):
        RayExecutor(s, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="give num_workers"):
        RayExecutor(s)
    with pytest.raises(ValueError, match="less than min_workers"):
        RayExecutor(s, min_workers=3, max_workers=2)
