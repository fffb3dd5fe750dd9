"""Static ``RayExecutor`` jobs on a real local Ray cluster (2 nodes: 2 + 1 CPUs)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from horovod.ray import RayExecutor
from horovod.runner import errors

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def _settings(**kw):
    return RayExecutor.create_settings(timeout_s=kw.pop("timeout_s", 20), **kw)


def _identity(tag):
    import ray
    import torch

    import horovod.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="ranks").item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "sum": total, "tag": tag,
            "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


class Counter:
    """An executable: one per worker, kept between calls."""

    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self.value


def test_results_in_rank_order_grouped_by_node(free_cluster):
    ex = RayExecutor(_settings(), num_workers=3, cpus_per_worker=1)
    ex.start(executable_cls=Counter, executable_args=[10], extra_env_vars={"HVD_RAY_TEST": "yes"})
    try:
        out = ex.run(_identity, args=["first"])
        again = ex.run(_identity, kwargs={"tag": "second"})  # the same actors, a second call
        env = ex.execute(lambda c: (c.bump(), os.environ["HVD_RAY_TEST"]))
        single = ex.execute_single(lambda c: c.bump())
        import ray

        remote = ray.get(ex.run_remote(lambda x: x * 2, args=[21]))
    finally:
        ex.shutdown()
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["size"] == 3 and o["sum"] == 6.0 and o["tag"] == "first", o
    # Ranks of one node are consecutive; local and cross ranks follow (2 on one node, 1 on the other).
    nodes = [o["node"] for o in out]
    assert nodes[0] == nodes[1] != nodes[2], nodes
    assert {nodes[0], nodes[2]} == {free_cluster.head_id, free_cluster.second_id}
    assert [(o["local_rank"], o["local_size"], o["cross_rank"], o["cross_size"]) for o in out] == \
        [(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)]
    assert [o["pid"] for o in again] == [o["pid"] for o in out]
    assert [o["tag"] for o in again] == ["second"] * 3
    assert env == [(11, "yes")] * 3 and single == 12 and remote == [42, 42, 42]


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


def _logging(n):
    import horovod.torch as hvd
    from horovod.ray import ray_logger

    hvd.init()
    for step in range(n):
        ray_logger.log({"rank": hvd.rank(), "step": step})  # rank 0's only
    ray_logger.log({"rank": hvd.rank(), "all": True}, chief_only=False)
    return hvd.rank()


def test_callbacks_get_what_the_ranks_log(free_cluster):
    seen = []
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start()
    try:
        assert ex.run(_logging, args=[3], callbacks=[seen.append]) == [0, 1]
    finally:
        ex.shutdown()
    assert [s for s in seen if "step" in s] == [{"rank": 0, "step": i} for i in range(3)]
    assert sorted(s["rank"] for s in seen if "all" in s) == [0, 1]


def _train(steps, seed):
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(seed + hvd.rank())  # different initial weights: the broadcast must fix them
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        half = slice(4 * hvd.rank(), 4 * hvd.rank() + 4)  # each rank its half of the batch
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()], \
        [p.detach().numpy().copy() for p in _initial(seed)]


def _initial(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Linear(4, 1).parameters()


def test_training_gives_identical_parameters_equal_to_full_batch(free_cluster):
    import torch

    ex = RayExecutor(_settings(), num_workers=2)
    ex.start()
    try:
        out = ex.run(_train, kwargs={"steps": 5, "seed": 3})
    finally:
        ex.shutdown()
    (w0, init0), (w1, _) = out
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)  # identical on every rank
    # The same 5 steps on the full batch in one process (averaged halves == full-batch mean).
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        for p, v in zip(model.parameters(), init0):
            p.copy_(torch.tensor(v))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for got, p in zip(w0, model.parameters()):
        np.testing.assert_allclose(got, p.detach().numpy(), rtol=1e-5, atol=1e-6)


def _raise_on_rank_1():
    import torch

    import horovod.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank 1")
    hvd.allreduce(torch.ones(1), name="after")
    return hvd.rank()


def test_raising_function_names_rank_and_node(free_cluster):
    ex = RayExecutor(_settings(), num_workers=2)
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
        assert elapsed < 20, elapsed  # rank 0 was left waiting in its allreduce: not a hang
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
    ex = RayExecutor(_settings(), num_workers=3)
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
        assert elapsed < 30, elapsed
    finally:
        ex.shutdown()


def test_too_few_cpus_is_a_clear_error_within_the_placement_timeout(free_cluster):
    ex = RayExecutor(_settings(placement_group_timeout_s=3), num_workers=5)
    t0 = time.monotonic()
    with pytest.raises(errors.LaunchError) as info:
        ex.start()
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "could not reserve 5 worker(s)" in text and "3 CPU(s) in total" in text, text
    assert "placement_group_timeout_s=3" in text, text
    assert elapsed < 15, elapsed
    with pytest.raises(errors.LaunchError, match="call start"):
        ex.run(_identity, args=["never"])


def test_argument_errors():
    s = _settings()
    with pytest.raises(ValueError, match="either num_workers .* or min_workers"):
        RayExecutor(s, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="max_workers was given without a positive min_workers"):
        RayExecutor(s, max_workers=2)
    with pytest.raises(ValueError, match="use_gpu=True"):
        RayExecutor(s, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="give num_workers"):
        RayExecutor(s)
    with pytest.raises(ValueError, match="less than min_workers"):
        RayExecutor(s, min_workers=3, max_workers=2)
