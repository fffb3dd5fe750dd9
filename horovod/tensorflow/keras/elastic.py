"""Elastic training with ``tf.keras`` (Keras 3, or tf_keras with ``TF_USE_LEGACY_KERAS=1``).

::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(dataset, steps_per_epoch=..., epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod._keras import elastic as _impl
from horovod.common.elastic import ObjectState, State
from horovod.tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "State", "ObjectState"]


class KerasState(TensorFlowKerasState):
    """State of a ``tf.keras`` model and its optimizer (default ``model.optimizer``)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(_impl.CommitStateCallbackImpl, tf.keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__(tf.keras.backend, state, batches_per_commit)


class UpdateBatchStateCallback(_impl.UpdateBatchStateCallbackImpl, tf.keras.callbacks.Callback):
    """Track ``state.batch``; shorten the epoch interrupted by a reset to what it had left."""

    def __init__(self, state: Any) -> None:
        super().__init__(tf.keras.backend, state)


class UpdateEpochStateCallback(_impl.UpdateEpochStateCallbackImpl, tf.keras.callbacks.Callback):
    """Track ``state.epoch`` (finished epochs, across resets)."""

    def __init__(self, state: Any) -> None:
        super().__init__(tf.keras.backend, state)
