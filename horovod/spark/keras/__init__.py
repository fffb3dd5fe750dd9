"""``horovod.spark.keras``: ``KerasEstimator`` trains a Keras model (Keras 3, or ``tf_keras``) on
a Spark DataFrame with Horovod and returns a ``KerasModel`` (a Spark ML ``Model``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from horovod.spark.common.training import estimator_attrs

if TYPE_CHECKING:
    from horovod.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]


# The estimator (Spark ML: PySpark) loads on first use (horovod.spark.common.training).
__getattr__ = estimator_attrs(__name__, "horovod.spark.keras.estimator", __all__)
