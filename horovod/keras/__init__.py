"""Horovod for standalone Keras (``import keras``; Keras 3 with the TensorFlow backend).

::

    import keras
    import horovod.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
"""

from __future__ import annotations

from typing import Any

import keras

from horovod._keras import helpers as _impl
from horovod.common.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    metrics,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.common.process_sets import global_process_set
from horovod.common.types import Adasum, Average, Sum
from horovod.keras import callbacks, elastic
from horovod.tensorflow import _keras_optimizer as _opt
from horovod.tensorflow import init  # noqa: F401 - with TensorFlow's inter-op pool (see there)
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_tape import _is_keras_layer

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "metrics", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "global_process_set", "Average", "Sum", "Adasum", "Compression", "callbacks", "elastic", "DistributedOptimizer",
    "PartialDistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather", "broadcast",
    "reducescatter", "load_model",
]


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",  # noqa: N802
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, num_groups: int = 0, groups: Any = None,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False) -> Any:
    """Return a copy of ``optimizer`` that averages gradients across ranks before applying them.

    Works on Keras 3's TensorFlow, PyTorch and JAX backends (``KERAS_BACKEND``). With
    ``backward_passes_per_step=k`` (an addition to upstream's signature, as in
    ``horovod.tensorflow.keras``) gradients of k batches are accumulated locally, then reduced
    and applied (summed, or averaged with ``average_aggregated_gradients=True``).

    Raises:
        ValueError: ``op`` other than Average/Sum, predivide with Sum, bad ``groups``, or a
            Keras backend that cannot train (numpy, openvino).
    """
    return _opt.create_distributed_optimizer(
        keras, optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        groups=groups, num_groups=num_groups)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",  # noqa: N802
                                device_sparse: str = "", compression: Any = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: int = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: Any = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A distributed optimizer that keeps the gradients of ``local_layers`` local.

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
            raise ValueError("All local layers must be of keras.layers.Layer type.")
        for w in layer.trainable_weights:
            opt.register_local_var(w)
    return opt


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast all global variables from ``root_rank`` (TF1 graph mode only).

    Raises:
        RuntimeError: in eager mode; use ``callbacks.BroadcastGlobalVariablesCallback``.
    """
    return _impl.broadcast_global_variables(root_rank)


def allreduce(value: Any, name: str | None = None, average: bool | None = True, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: int | None = None,
              compression: Any = Compression.none) -> Any:
    """Return the reduction (default: average) of ``value`` over all ranks, evaluated now."""
    if op is not None:
        average = None
    return _impl.allreduce(value, name, average, prescale_factor, postscale_factor, op, compression)


def allgather(value: Any, name: str | None = None) -> Any:
    """Return every rank's ``value`` concatenated along dimension 0, evaluated now."""
    return _impl.allgather(value, name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Return ``root_rank``'s ``value`` on every rank, evaluated now."""
    return _impl.broadcast(value, root_rank, name)


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    """Return this rank's part of the reduction of ``value``, evaluated now."""
    return _impl.reducescatter(value, name, op)


def load_model(filepath: str, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none) -> Any:
    """Load a saved model whose optimizer is re-created as a Horovod distributed optimizer."""

    def wrap(cls: type) -> type:
        cfg = _opt.HvdConfig("", "", compression, False, 1.0, Average, 1, False, None, global_process_set,
                               True, f"Distributed{cls.__name__}", _opt.keras_backend(keras))
        return _opt.distributed_class(cls, cfg)

    return _impl.load_model(keras, wrap, ("keras.src.optimizers", "keras.optimizers"), filepath,
                            custom_optimizers, custom_objects)

