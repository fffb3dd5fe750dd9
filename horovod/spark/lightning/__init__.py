"""``horovod.spark.lightning``: ``TorchEstimator`` (docs: "LightningEstimator") trains a
``LightningModule`` on a Spark DataFrame through Lightning's ``Trainer`` with the Horovod strategy
(``horovod.lightning``) and returns a ``TorchModel``."""

from horovod.spark.lightning.estimator import TorchEstimator, TorchModel

LightningEstimator = TorchEstimator

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator"]
