"""A LightningModule trained with ``Trainer(strategy="horovod")`` inside ``horovod.spark.run``."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="the `lightning` package is not installed")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning"))
import lightning_jobs  # noqa: E402


def test_spark_run_trains_a_lightning_module(spark):
    import cloudpickle

    import horovod.spark

    cloudpickle.register_pickle_by_value(lightning_jobs)  # the executors cannot import the tests
    results = horovod.spark.run(lightning_jobs.tiny_fit, num_proc=2, verbose=0)
    lightning_jobs.check_tiny_fit(results, 2)
