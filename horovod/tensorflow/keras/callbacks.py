"""Horovod callbacks for ``tf.keras`` (Keras 3, or Keras 2 with ``TF_USE_LEGACY_KERAS=1``)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod._keras import callbacks as _impl

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

keras: Any = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1 (chosen at run time)
_backend = keras.backend


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl, keras.callbacks.Callback):
    """Broadcast model and optimizer variables from ``root_rank`` at the end of the first batch.

    This makes every rank start from the same state (random initialization or a checkpoint that
    rank 0 restored). Put it first in the callback list.
    """

    keras_backend = _backend


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, keras.callbacks.Callback):
    """Average the epoch's metrics (``logs``) over all ranks at the end of every epoch.

    Put it before callbacks that read metrics (ReduceLROnPlateau, TensorBoard, checkpoints).
    """

    keras_backend = _backend


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl, keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` in ``[start_epoch, end_epoch)``.

    A constant ``multiplier`` means ``multiplier ** (epoch - start_epoch)``. With
    ``staircase=False`` the LR changes every batch using fractional epochs. Momentum correction
    applies where the optimizer's momentum is a variable (Keras 2 legacy optimizers).
    """

    keras_backend = _backend


class LearningRateWarmupCallback(_impl.LearningRateWarmupCallbackImpl, keras.callbacks.Callback):
    """Ramp the LR from ``initial_lr / hvd.size()`` to ``initial_lr`` over ``warmup_epochs``."""

    keras_backend = _backend


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model; ``filepath`` is set later (e.g. by
    Spark estimators) through the ``filepath`` attribute."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: Any = "epoch") -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = None
