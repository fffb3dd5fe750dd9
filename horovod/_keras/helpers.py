"""Keras value helpers, ``load_model`` and learning-rate access, shared by ``horovod.tensorflow.keras``
and ``horovod.keras`` (any Keras 3 backend; Keras 2 through tf_keras)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

import horovod.tensorflow as _hvd_tf
from horovod.common.types import Average
from horovod.tensorflow.compression import Compression

__all__ = ["broadcast_global_variables", "allreduce", "allgather", "broadcast", "reducescatter",
           "load_model", "get_lr", "set_lr"]


# ---------------------------------------------------------------------------- value helpers
def _eval(value: Any) -> Any:
    if tf.executing_eagerly():
        return value
    return tf.compat.v1.keras.backend.get_session().run(value)


def broadcast_global_variables(root_rank: int) -> Any:
    return _eval(_hvd_tf.broadcast_global_variables(root_rank))


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: int | None = None,
              compression: Any = Compression.none) -> Any:
    return _eval(_hvd_tf.allreduce(tf.constant(value), name=name, average=average, op=op,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                               compression=compression))


def allgather(value: Any, name: str | None = None) -> Any:
    return _eval(_hvd_tf.allgather(tf.constant(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    return _eval(_hvd_tf.broadcast(tf.constant(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: int | None = None) -> Any:
    return _eval(_hvd_tf.reducescatter(tf.constant(value), name=name, op=Average if op is None else op))


# ---------------------------------------------------------------------------- load_model
def load_model(keras: Any, wrap_optimizer: Any, optimizer_modules: Any, filepath: str,
               custom_optimizers: Any = None, custom_objects: Any = None, legacy_opts: bool = False) -> Any:
    """Load a saved Keras model, wrapping its optimizer in a distributed optimizer."""
    opts_mod = keras.optimizers
    legacy = getattr(getattr(opts_mod, "legacy", None), "Optimizer", None)
    root = legacy if legacy_opts else opts_mod.Optimizer
    found: dict[str, type] = {}
    stack = list(root.__subclasses__()) if root is not None else []
    while stack:
        c = stack.pop()
        if c.__module__.startswith(optimizer_modules) and not getattr(c, "_hvd_distributed", False):
            found.setdefault(c.__name__, c)
        stack.extend(c.__subclasses__())
    objects: dict[str, Any] = {}
    for cls_name, c in found.items():
        objects[cls_name] = objects[cls_name.lower()] = wrap_optimizer(c)
    for c in custom_optimizers or []:
        objects[c.__name__] = wrap_optimizer(c)
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)


# ---------------------------------------------------------------------------- learning rate access
def get_lr(optimizer: Any) -> float:
    lr = optimizer.learning_rate if hasattr(optimizer, "learning_rate") else optimizer.lr
    if callable(lr) and not hasattr(lr, "numpy"):
        lr = lr(optimizer.iterations)
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))


def set_lr(optimizer: Any, value: float) -> None:
    lr = optimizer.learning_rate if hasattr(optimizer, "learning_rate") else optimizer.lr
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value
