"""Horovod callbacks for standalone Keras (``import keras``, TensorFlow backend)."""

from __future__ import annotations

from typing import Any

import keras

from horovod._keras import callbacks as _impl

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

_backend = keras.backend


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl, keras.callbacks.Callback):
    """Broadcast model and optimizer variables from ``root_rank`` at the end of the first batch."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__(_backend, root_rank, device, local_variables)


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, keras.callbacks.Callback):
    """Average the epoch's metrics over all ranks at the end of every epoch (put it first)."""

    def __init__(self, device: str = "") -> None:
        super().__init__(_backend, device)


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl, keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` in ``[start_epoch, end_epoch)``."""

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
    """A ``ModelCheckpoint`` keeping only the best model; ``filepath`` is set later."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Any = "epoch") -> None:
        super().__init__(filepath="best.keras", monitor=monitor, verbose=verbose, save_best_only=True,
                         mode=mode, save_freq=save_freq)
        self.filepath = None
