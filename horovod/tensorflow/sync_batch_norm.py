"""``SyncBatchNormalization``: batch normalization with statistics over all ranks' batches."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod.common import basics as _basics
from horovod.common.types import ReduceOp
from horovod.tensorflow.mpi_ops import _allreduce

__all__ = ["SyncBatchNormalization"]

_BatchNormalization: Any = tf.keras.layers.BatchNormalization  # Keras 3's, or tf_keras's (chosen at run time)
# Keras 3 computes statistics in _moments(inputs, mask); Keras 2 (tf_keras, also has a _moments)
# in _calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=None).
_KERAS3 = not hasattr(_BatchNormalization, "_calculate_mean_and_var")


def _group_moments(mean: Any, variance: Any) -> tuple[Any, Any]:
    """Average mean and E[x^2] over all ranks; variance = E[x^2] - mean^2 (global set only)."""
    if _basics.size() <= 1:
        return mean, variance
    mean_of_square = variance + tf.math.square(mean)
    stacked = tf.stack([mean, mean_of_square])
    summed = _allreduce(stacked, op=ReduceOp.SUM) / tf.cast(_basics.size(), stacked.dtype)
    group_mean, group_mean_of_square = tf.unstack(summed)
    return group_mean, group_mean_of_square - tf.math.square(group_mean)


class SyncBatchNormalization(_BatchNormalization):
    """Batch normalization whose training statistics are computed over every rank's batch.

    Every rank must call the layer in each training step (the statistics are allreduced). Only
    the global process set is supported, as upstream.

    Raises:
        ValueError: ``fused=True`` (or None) was requested.
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        if not _KERAS3:
            kwargs["fused"] = False
        super().__init__(**kwargs)

    if _KERAS3:
        def _moments(self, inputs: Any, mask: Any) -> Any:
            mean, variance = super()._moments(inputs, mask)
            return _group_moments(mean, variance)
    else:
        def _calculate_mean_and_var(self, x: Any, axes: Any, keep_dims: Any, mask: Any = None) -> Any:
            mean, variance = super()._calculate_mean_and_var(x, axes, keep_dims, mask=mask)
            return _group_moments(mean, variance)
