"""Horovod callbacks for standalone Keras (``import keras``; Keras 3 on any of its training backends)."""

from __future__ import annotations

from typing import Any

import keras

from horovod._keras import callbacks as _impl

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

_backend = keras.backend


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl, keras.callbacks.Callback):
    """Broadcast model and optimizer variables from ``root_rank`` at the end of the first batch."""

    keras_backend = _backend


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, keras.callbacks.Callback):
    """Average the epoch's metrics over all ranks at the end of every epoch (put it first)."""

    keras_backend = _backend


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl, keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` in ``[start_epoch, end_epoch)``."""

    keras_backend = _backend


class LearningRateWarmupCallback(_impl.LearningRateWarmupCallbackImpl, keras.callbacks.Callback):
    """Ramp the LR from ``initial_lr / hvd.size()`` to ``initial_lr`` over ``warmup_epochs``."""

    keras_backend = _backend


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` keeping only the best model; ``filepath`` is set later."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Any = "epoch") -> None:
        super().__init__(filepath="best.keras", monitor=monitor, verbose=verbose, save_best_only=True,
                         mode=mode, save_freq=save_freq)
        self.filepath = None
