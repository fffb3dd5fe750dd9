"""A LightningModule trained with ``Trainer(strategy="horovod")`` on ``RayExecutor`` workers."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="the `lightning` package is not installed")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning"))
import lightning_jobs  # noqa: E402


def test_ray_executor_trains_a_lightning_module(free_cluster):
    import ray

    from horovod.ray import RayExecutor

    ray.cloudpickle.register_pickle_by_value(lightning_jobs)  # the actors cannot import the tests
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    try:
        results = executor.run(lightning_jobs.tiny_fit)
    finally:
        executor.shutdown()
    lightning_jobs.check_tiny_fit(results, 2)
