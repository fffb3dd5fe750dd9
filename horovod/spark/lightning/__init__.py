"""``horovod.spark.lightning``: ``TorchEstimator`` (docs: "LightningEstimator") trains a
``LightningModule`` on a Spark DataFrame through Lightning's ``Trainer`` with the Horovod strategy
(``horovod.lightning``) and returns a ``TorchModel``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from horovod.spark.common.training import estimator_attrs

if TYPE_CHECKING:
    from horovod.spark.lightning.estimator import TorchEstimator, TorchModel

    LightningEstimator = TorchEstimator

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator"]


# The estimator (Spark ML: PySpark) loads on first use (horovod.spark.common.training).
__getattr__ = estimator_attrs(__name__, "horovod.spark.lightning.estimator", __all__,
                              {"LightningEstimator": "TorchEstimator"})
