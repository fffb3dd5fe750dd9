"""Horovod callbacks for ``tf.keras`` (Keras 3, or Keras 2 with ``TF_USE_LEGACY_KERAS=1``)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod._keras import callbacks as _impl

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

keras = tf.keras
_backend = keras.backend


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl, keras.callbacks.Callback):
    """Broadcast model and optimizer variables from ``root_rank`` at the end of the first batch.

    This makes every rank start from the same state (random initialization or a checkpoint that
    rank 0 restored). Put it first in the callback list.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__(_backend, root_rank, device, local_variables)


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, keras.callbacks.Callback):
    """Average the epoch's metrics (``logs``) over all ranks at the end of every epoch.

    Put it before callbacks that read metrics (ReduceLROnPlateau, TensorBoard, checkpoints).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__(_backend, device)


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl, keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` in ``[start_epoch, end_epoch)``.

    A constant ``multiplier`` means ``multiplier ** (epoch - start_epoch)``. With
    ``staircase=False`` the LR changes every batch using fractional epochs. Momentum correction
    applies where the optimizer's momentum is a variable (Keras 2 legacy optimizers).
    """

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__(_backend, initial_lr, multiplier, start_epoch, end_epoch, staircase,
                         momentum_correction, steps_per_epoch)


class LearningRateWarmupCallback(_impl.LearningRateWarmupCallbackImpl, keras.callbacks.Callback):
    """Ramp the LR from ``initial_lr / hvd.size()`` to ``initial_lr`` over ``warmup_epochs``."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__(_backend, initial_lr, warmup_epochs, momentum_correction, steps_per_epoch, verbose)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model; ``filepath`` is set later (e.g. by
    Spark estimators) through the ``filepath`` attribute."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: Any = "epoch") -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = None
