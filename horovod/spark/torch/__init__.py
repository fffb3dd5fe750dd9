"""``horovod.spark.torch``: ``TorchEstimator`` trains a ``torch.nn.Module`` on a Spark DataFrame
with Horovod and returns a ``TorchModel`` (a Spark ML ``Model``)."""

from horovod.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
