"""The public functions ``horovod.tensorflow.keras`` (tf.keras) and ``horovod.keras`` share, and
learning-rate access (any Keras 3 backend; Keras 2 through tf_keras).

A function whose signature is the same in both bindings is defined here once and re-exported by
both. Where a binding's signature differs only in a default or an error text (``allreduce``,
``PartialDistributedOptimizer``), a ``*_function`` factory here builds each binding's function
from the one definition; the binding names it in its module. Whatever depends on the Keras backend
is chosen by ``uses_tensorflow``: TensorFlow is imported only where it serves the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from horovod._keras import optimizer as _opt
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Average

__all__ = ["uses_tensorflow", "init_function", "compression_class", "create_distributed_optimizer",
           "broadcast_global_variables", "value_function", "partial_distributed_optimizer_function",
           "load_model", "get_lr", "set_lr"]


def _exported(fn: Callable[..., Any], module: str) -> Callable[..., Any]:
    """Name a function a factory built as ``module.<its name>`` (repr, help(), pickling by reference)."""
    fn.__module__ = module
    fn.__qualname__ = fn.__name__
    return fn


# ---------------------------------------------------------------------------- the backend's modules
def uses_tensorflow(keras: Any) -> bool:
    """Whether Horovod serves ``keras`` through ``horovod.tensorflow``: every backend but Keras 3's
    torch and JAX (whose collectives take NumPy values and whose gradients ``horovod._keras.backends``
    reduces). The only place that decides it; nothing else imports TensorFlow on the other two."""
    return _opt.backend_name(keras) not in ("torch", "jax")


def init_function(keras: Any) -> Callable[..., Any]:
    """``horovod.tensorflow.init`` (which sizes TensorFlow's inter-op pool) where ``keras`` runs on
    TensorFlow, the plain ``init`` otherwise."""
    if uses_tensorflow(keras):
        from horovod.tensorflow import init

        return init
    from horovod.common.basics import init as plain_init

    return plain_init


def compression_class(keras: Any) -> Any:
    """``Compression`` for ``keras``: TensorFlow's on TensorFlow, NumPy's otherwise (its ``none``/``fp16``
    map to the backend's by name, ``horovod._keras.backends.backend_compression``)."""
    if uses_tensorflow(keras):
        from horovod.tensorflow.compression import Compression

        return Compression
    from horovod.numpy.compression import Compression as NumpyCompression

    return NumpyCompression


def _tensorflow_reduction(keras: Any) -> Any:
    if not uses_tensorflow(keras):
        return None
    from horovod.tensorflow._keras_optimizer import tensorflow_reduction

    return tensorflow_reduction


def create_distributed_optimizer(keras: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """``horovod._keras.optimizer.create_distributed_optimizer`` with the reduction of ``keras``'s backend."""
    return _opt.create_distributed_optimizer(keras, optimizer, *args,
                                             tensorflow_reduction=_tensorflow_reduction(keras), **kwargs)


# ---------------------------------------------------------------------------- value helpers
def _eval(value: Any) -> Any:
    import tensorflow as tf

    if tf.executing_eagerly():
        return value
    return tf.compat.v1.keras.backend.get_session().run(value)


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast all global variables from ``root_rank`` (TF1 graph mode through the Keras session).

    Raises:
        RuntimeError: in eager mode; use ``callbacks.BroadcastGlobalVariablesCallback`` or
            ``horovod.tensorflow.broadcast_variables``.
    """
    import horovod.tensorflow as hvd_tf

    return _eval(hvd_tf.broadcast_global_variables(root_rank))


def _collective(tensorflow: bool) -> Callable[..., Any]:
    """``run(kind, value, **kwargs)``: the collective ``kind`` of ``horovod.tensorflow`` on a constant
    (evaluated now), or of ``horovod.numpy`` on an array."""
    if tensorflow:
        import tensorflow as tf

        import horovod.tensorflow as hvd_tf

        return lambda kind, value, *args, **kwargs: _eval(getattr(hvd_tf, kind)(tf.constant(value), *args, **kwargs))
    import horovod.numpy as hvd_np

    return lambda kind, value, *args, **kwargs: getattr(hvd_np, kind)(np.asarray(value), *args, **kwargs)


def value_function(kind: str, module: str, tensorflow: bool, average_default: bool | None = None,
                   compression: Any = None) -> Callable[..., Any]:
    """The binding ``module``'s ``kind`` (``allreduce``, ``allgather``, ``broadcast``, ``reducescatter``),
    with ``horovod.tensorflow``'s collectives if ``tensorflow`` (``uses_tensorflow``), NumPy's otherwise.
    (One public name per call: the API reference documents ``name = <call>`` assignments.)

    ``allreduce``'s ``average`` defaults to ``average_default``: where it is set (``horovod.keras``:
    True), an ``op`` given supersedes ``average``; where it is None (``horovod.tensorflow.keras``),
    giving both raises, as ``horovod.tensorflow.allreduce``. ``compression`` is the binding's
    ``Compression.none``.
    """
    run = _collective(tensorflow)

    def allreduce(value: Any, name: str | None = None, average: bool | None = average_default,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: int | None = None,
                  compression: Any = compression) -> Any:
        """Return the reduction (default: average) of ``value`` over all ranks, evaluated now."""
        if op is not None and average_default is not None:
            average = None
        return run("allreduce", value, name=name, average=average, op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, compression=compression)

    def allgather(value: Any, name: str | None = None) -> Any:
        """Return every rank's ``value`` concatenated along dimension 0, evaluated now."""
        return run("allgather", value, name=name)

    def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
        """Return ``root_rank``'s ``value`` on every rank, evaluated now."""
        return run("broadcast", value, root_rank, name=name)

    def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
        """Return this rank's part of the reduction of ``value``, evaluated now."""
        return run("reducescatter", value, name=name, op=Average if op is None else op)

    functions = {fn.__name__: fn for fn in (allreduce, allgather, broadcast, reducescatter)}
    return _exported(functions[kind], module)


# ---------------------------------------------------------------------------- optimizers
def partial_distributed_optimizer_function(module: str, keras: Any, layer_type: str,
                                           compression: Any) -> Callable[..., Any]:
    """The ``PartialDistributedOptimizer`` of the binding ``module`` (Keras module ``keras``), whose
    error names the layer class as ``layer_type``; ``compression`` is the binding's ``Compression.none``."""

    def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                                    device_dense: str = "", device_sparse: str = "",
                                    compression: Any = compression, sparse_as_dense: bool = False,
                                    gradient_predivide_factor: float = 1.0, op: int = Average,
                                    backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                    groups: Any = None, process_set: ProcessSet = global_process_set,
                                    local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
        """A ``DistributedOptimizer`` that keeps the gradients of ``local_layers`` local.

        Raises:
            ValueError: an entry of ``local_layers`` is not a Keras layer.
        """
        opt = create_distributed_optimizer(
            keras, optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
            gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, groups,
            process_set, scale_local_gradients)
        layers = [] if local_layers is None else (
            local_layers if isinstance(local_layers, list | tuple) else [local_layers])
        for layer in layers:
            if not _is_layer(keras, layer):
                raise ValueError(f"All local layers must be of {layer_type} type.")
            for w in layer.trainable_weights:
                opt.register_local_var(w)
        return opt

    return _exported(PartialDistributedOptimizer, module)


def _is_layer(keras: Any, layer: Any) -> bool:
    if uses_tensorflow(keras):
        from horovod.tensorflow.gradient_tape import _is_keras_layer

        return _is_keras_layer(layer)  # Keras 3 or tf_keras
    return isinstance(layer, keras.layers.Layer)


# ---------------------------------------------------------------------------- load_model
def load_model(keras: Any, compression: Any, optimizer_modules: tuple[str, ...], filepath: str,
               custom_optimizers: Any = None, custom_objects: Any = None, legacy_opts: bool = False) -> Any:
    """Load a saved Keras model, its optimizer re-created as a distributed optimizer with ``compression``.

    Every optimizer class of ``keras`` defined in ``optimizer_modules`` (its legacy ones with
    ``legacy_opts``) and each of ``custom_optimizers`` is wrapped; ``custom_objects`` are merged last.
    """

    def wrap_optimizer(cls: type) -> type:
        cfg = _opt.HvdConfig("", "", compression, False, 1.0, Average, 1, False, None, global_process_set,
                             True, f"Distributed{cls.__name__}", _opt.keras_backend(keras),
                             tensorflow_reduction=_tensorflow_reduction(keras))
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
