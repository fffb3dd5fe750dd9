"""``horovod.spark.torch``: ``TorchEstimator`` trains a ``torch.nn.Module`` on a Spark DataFrame
with Horovod and returns a ``TorchModel`` (a Spark ML ``Model``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from horovod.spark.common.training import estimator_attrs

if TYPE_CHECKING:
    from horovod.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]


# The estimator (Spark ML: PySpark) loads on first use (horovod.spark.common.training).
__getattr__ = estimator_attrs(__name__, "horovod.spark.torch.estimator", __all__)
