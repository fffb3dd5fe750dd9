"""``horovod.spark.keras``: ``KerasEstimator`` trains a Keras model (Keras 3, or ``tf_keras``) on
a Spark DataFrame with Horovod and returns a ``KerasModel`` (a Spark ML ``Model``)."""

from horovod.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
