"""A LightningModule trained with ``Trainer(strategy="horovod")`` inside ``horovod.spark.run``: the
ranks end with the weights of the same training in one process, each step's gradients averaged
over the ranks' batches."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="the `lightning` package is not installed")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning"))
import lightning_jobs  # noqa: E402

from tests._averaging import averaged_steps  # noqa: E402


def _sampler_order(n: int, size: int, epoch: int) -> list[list[int]]:
    """Each rank's rows in an epoch, as Lightning's ``DistributedSampler`` deals them with its
    defaults (shuffle, seed 0): ``randperm(n)`` seeded with ``seed + epoch``, every ``size``-th
    index to a rank starting at its rank."""
    import torch

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
    return [perm[r::size] for r in range(size)]


def _tiny_fit_reference(size: int) -> list[list[float]]:
    """``lightning_jobs.tiny_fit`` in one process: rank 0's initial ``Linear(4, 1)`` (seed 1234,
    which the strategy broadcasts), the job's data (generator seed 0, 8 rows per rank), each
    rank's batches of 2 in the sampler's order, SGD with lr 0.1 on the ranks' MSE gradients
    averaged at each step, two epochs."""
    import torch

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8 * size, 4, generator=g), torch.randn(8 * size, 1, generator=g)
    torch.manual_seed(1234)
    model = torch.nn.Linear(4, 1)
    steps = []
    for epoch in range(2):
        per_rank = [[idx[i:i + 2] for i in range(0, len(idx), 2)]
                    for idx in _sampler_order(8 * size, size, epoch)]
        steps += [list(step) for step in zip(*per_rank)]

    def mse(m: torch.nn.Module, idx: list[int]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(x[idx]), y[idx])

    averaged_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, steps)
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def test_spark_run_trains_a_lightning_module(spark):
    import cloudpickle

    import horovod.spark

    cloudpickle.register_pickle_by_value(lightning_jobs)  # the executors cannot import the tests
    results = horovod.spark.run(lightning_jobs.tiny_fit, num_proc=2, verbose=0)
    lightning_jobs.check_tiny_fit(results, 2)
    # The reference deals the rows as the ranks' sampler did (their epoch 0 says so).
    assert [r["seen"] for r in results] == _sampler_order(16, 2, 0)
    expected = _tiny_fit_reference(2)
    for r in results:
        for got, want in zip(r["weights"], expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7,
                                       err_msg=f"rank {r['rank']}: not the averaged SGD of the shards")
