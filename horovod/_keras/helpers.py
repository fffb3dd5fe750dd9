"""The public functions ``horovod.tensorflow.keras`` (tf.keras) and ``horovod.keras`` share, and
learning-rate access (any Keras 3 backend; Keras 2 through tf_keras).

A function whose signature is the same in both bindings is defined here once and re-exported by
both. Where a binding's signature differs only in a default or an error text (``allreduce``,
``PartialDistributedOptimizer``), a ``*_function`` factory here builds each binding's function
from the one definition; the binding names it in its module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

import horovod.tensorflow as _hvd_tf
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Average
from horovod.tensorflow import _keras_optimizer as _opt
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_tape import _is_keras_layer

__all__ = ["broadcast_global_variables", "allreduce_function", "allgather", "broadcast", "reducescatter",
           "partial_distributed_optimizer_function", "load_model", "get_lr", "set_lr"]


def _exported(fn: Callable[..., Any], module: str) -> Callable[..., Any]:
    """Name a function a factory built as ``module.<its name>`` (repr, help(), pickling by reference)."""
    fn.__module__ = module
    fn.__qualname__ = fn.__name__
    return fn


# ---------------------------------------------------------------------------- value helpers
def _eval(value: Any) -> Any:
    if tf.executing_eagerly():
        return value
    return tf.compat.v1.keras.backend.get_session().run(value)


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast all global variables from ``root_rank`` (TF1 graph mode through the Keras session).

    Raises:
        RuntimeError: in eager mode; use ``callbacks.BroadcastGlobalVariablesCallback`` or
            ``horovod.tensorflow.broadcast_variables``.
    """
    return _eval(_hvd_tf.broadcast_global_variables(root_rank))


def allreduce_function(module: str, average_default: bool | None) -> Callable[..., Any]:
    """The ``allreduce`` of the binding ``module``, whose ``average`` defaults to ``average_default``.

    Where that default is set (``horovod.keras``: True), an ``op`` given supersedes ``average``; where
    it is None (``horovod.tensorflow.keras``), giving both raises, as ``horovod.tensorflow.allreduce``.
    """

    def allreduce(value: Any, name: str | None = None, average: bool | None = average_default,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: int | None = None,
                  compression: Any = Compression.none) -> Any:
        """Return the reduction (default: average) of ``value`` over all ranks, evaluated now."""
        if op is not None and average_default is not None:
            average = None
        return _eval(_hvd_tf.allreduce(tf.constant(value), name=name, average=average, op=op,
                                       prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                       compression=compression))

    return _exported(allreduce, module)


def allgather(value: Any, name: str | None = None) -> Any:
    """Return every rank's ``value`` concatenated along dimension 0, evaluated now."""
    return _eval(_hvd_tf.allgather(tf.constant(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Return ``root_rank``'s ``value`` on every rank, evaluated now."""
    return _eval(_hvd_tf.broadcast(tf.constant(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    """Return this rank's part of the reduction of ``value``, evaluated now."""
    return _eval(_hvd_tf.reducescatter(tf.constant(value), name=name, op=Average if op is None else op))


# ---------------------------------------------------------------------------- optimizers
def partial_distributed_optimizer_function(module: str, keras: Any, layer_type: str) -> Callable[..., Any]:
    """The ``PartialDistributedOptimizer`` of the binding ``module`` (Keras module ``keras``), whose
    error names the layer class as ``layer_type``."""

    def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                                    device_dense: str = "", device_sparse: str = "",
                                    compression: Any = Compression.none, sparse_as_dense: bool = False,
                                    gradient_predivide_factor: float = 1.0, op: int = Average,
                                    backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                    groups: Any = None, process_set: ProcessSet = global_process_set,
                                    local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
        """A ``DistributedOptimizer`` that keeps the gradients of ``local_layers`` local.

        Raises:
            ValueError: an entry of ``local_layers`` is not a Keras layer.
        """
        opt = _opt.create_distributed_optimizer(
            keras, optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
            gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, groups,
            process_set, scale_local_gradients)
        layers = [] if local_layers is None else (
            local_layers if isinstance(local_layers, list | tuple) else [local_layers])
        for layer in layers:
            if not _is_keras_layer(layer):  # Keras 3 or tf_keras
                raise ValueError(f"All local layers must be of {layer_type} type.")
            for w in layer.trainable_weights:
                opt.register_local_var(w)
        return opt

    return _exported(PartialDistributedOptimizer, module)


# ---------------------------------------------------------------------------- load_model
def load_model(keras: Any, compression: Any, optimizer_modules: tuple[str, ...], filepath: str,
               custom_optimizers: Any = None, custom_objects: Any = None, legacy_opts: bool = False) -> Any:
    """Load a saved Keras model, its optimizer re-created as a distributed optimizer with ``compression``.

    Every optimizer class of ``keras`` defined in ``optimizer_modules`` (its legacy ones with
    ``legacy_opts``) and each of ``custom_optimizers`` is wrapped; ``custom_objects`` are merged last.
    """

    def wrap_optimizer(cls: type) -> type:
        cfg = _opt.HvdConfig("", "", compression, False, 1.0, Average, 1, False, None, global_process_set,
                             True, f"Distributed{cls.__name__}", _opt.keras_backend(keras))
        return _opt.distributed_class(cls, cfg)

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
