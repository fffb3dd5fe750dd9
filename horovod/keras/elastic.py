"""Elastic training with the standalone ``keras`` package (``import horovod.keras as hvd``)."""

from __future__ import annotations

from typing import Any

import keras

from horovod._keras import elastic as _impl
from horovod._keras.state import KerasModelState
from horovod.common.elastic import ObjectState, State

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "State", "ObjectState"]


def run(func: Any) -> Any:
    """Decorator: run ``func(state, ...)`` in the elastic retry loop of the Keras backend in use
    (on JAX, a collective failing inside the compiled train step resets the job too); each
    framework is imported only on its backend."""
    backend = keras.backend.backend()
    if backend == "jax":
        from horovod.jax.elastic import run as jax_run

        return jax_run(func)
    if backend == "torch":
        from horovod.torch.elastic import run as torch_run

        return torch_run(func)
    from horovod.tensorflow.elastic import run as tf_run

    return tf_run(func)


class KerasState(KerasModelState):
    """State of a Keras model and its optimizer (default ``model.optimizer``)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(_impl.CommitStateCallbackImpl, keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__(keras.backend, state, batches_per_commit)


class UpdateBatchStateCallback(_impl.UpdateBatchStateCallbackImpl, keras.callbacks.Callback):
    """Track ``state.batch``; shorten the epoch interrupted by a reset to what it had left."""

    def __init__(self, state: Any) -> None:
        super().__init__(keras.backend, state)


class UpdateEpochStateCallback(_impl.UpdateEpochStateCallbackImpl, keras.callbacks.Callback):
    """Track ``state.epoch`` (finished epochs, across resets)."""

    def __init__(self, state: Any) -> None:
        super().__init__(keras.backend, state)
