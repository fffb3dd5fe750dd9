"""Static ``RayExecutor``: one 3-rank executor (2 ranks on the 2-CPU node, 1 on the other) serves
every test of this module: rank order and node grouping, actors reused between calls,
``execute``/``execute_single``/``run_remote``, callbacks, and a short training."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from ray_jobs import identity as _identity

from horovod.ray import RayExecutor

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


class Counter:
    """An executable: one per worker, kept between calls."""

    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self.value


@pytest.fixture(scope="module")
def executor(ray_cluster) -> Iterator[RayExecutor]:
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=3, cpus_per_worker=1)
    ex.start(executable_cls=Counter, executable_args=[10], extra_env_vars={"HVD_RAY_TEST": "yes"})
    try:
        yield ex
    finally:
        ex.shutdown()


def test_results_in_rank_order_grouped_by_node(executor, ray_cluster):
    import ray

    ex = executor
    out = ex.run(_identity, args=["first"])
    again = ex.run(_identity, kwargs={"tag": "second"})  # the same actors, a second call
    env = ex.execute(lambda c: (c.bump(), os.environ["HVD_RAY_TEST"]))
    single = ex.execute_single(lambda c: c.bump())
    remote = ray.get(ex.run_remote(lambda x: x * 2, args=[21]))
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["size"] == 3 and o["sum"] == 6.0 and o["tag"] == "first", o
    # Ranks of one node are consecutive; local and cross ranks follow (2 on one node, 1 on the other).
    nodes = [o["node"] for o in out]
    assert nodes[0] == nodes[1] != nodes[2], nodes
    assert {nodes[0], nodes[2]} == {ray_cluster.head_id, ray_cluster.second_id}
    assert [(o["local_rank"], o["local_size"], o["cross_rank"], o["cross_size"]) for o in out] == \
        [(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)]
    assert [o["pid"] for o in again] == [o["pid"] for o in out]
    assert [o["tag"] for o in again] == ["second"] * 3
    assert env == [(11, "yes")] * 3 and single == 12 and remote == [42, 42, 42]


def _logging(n):
    import horovod.torch as hvd
    from horovod.ray import ray_logger

    hvd.init()
    for step in range(n):
        ray_logger.log({"rank": hvd.rank(), "step": step})  # rank 0's only
    ray_logger.log({"rank": hvd.rank(), "all": True}, chief_only=False)
    return hvd.rank()


def test_callbacks_get_what_the_ranks_log(executor):
    seen = []
    assert executor.run(_logging, args=[3], callbacks=[seen.append]) == [0, 1, 2]
    assert [s for s in seen if "step" in s] == [{"rank": 0, "step": i} for i in range(3)]
    assert sorted(s["rank"] for s in seen if "all" in s) == [0, 1, 2]


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
    part = 12 // hvd.size()
    for _ in range(steps):
        x, y = torch.randn(12, 4, generator=gen), torch.randn(12, 1, generator=gen)
        mine = slice(part * hvd.rank(), part * (hvd.rank() + 1))  # each rank its part of the batch
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    torch.manual_seed(seed)
    initial = torch.nn.Linear(4, 1)  # rank 0's initial weights, which the broadcast spread
    return ([p.detach().numpy().copy() for p in model.parameters()],
            [p.detach().numpy().copy() for p in initial.parameters()])


def test_training_gives_identical_parameters_equal_to_full_batch(executor):
    import torch

    out = executor.run(_train, kwargs={"steps": 5, "seed": 3})
    w0, init0 = out[0]
    for w, _ in out[1:]:
        for a, b in zip(w0, w):
            np.testing.assert_array_equal(a, b)  # identical on every rank
    # The same 5 steps on the full batch in one process (averaged equal parts == full-batch mean).
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        for p, v in zip(model.parameters(), init0):
            p.copy_(torch.tensor(v))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(12, 4, generator=gen), torch.randn(12, 1, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for got, p in zip(w0, model.parameters()):
        np.testing.assert_allclose(got, p.detach().numpy(), rtol=1e-5, atol=1e-6)
