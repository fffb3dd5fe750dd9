"""Horovod for standalone Keras (``import keras``; Keras 3 on its TensorFlow, PyTorch or JAX backend).

::

    import keras
    import horovod.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

On the torch and JAX backends nothing here imports TensorFlow (``horovod._keras.helpers.uses_tensorflow``):
``init`` is the plain one, ``Compression`` NumPy's, the value helpers return NumPy arrays.
"""

from __future__ import annotations

from typing import Any

import keras

from horovod._keras import helpers as _impl
from horovod._keras.helpers import broadcast_global_variables
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

_TF = _impl.uses_tensorflow(keras)  # whether this backend goes through horovod.tensorflow
init = _impl.init_function(keras)  # TensorFlow's (its inter-op pool) on the TensorFlow backend
Compression = _impl.compression_class(keras)

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
    return _impl.create_distributed_optimizer(
        keras, optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        groups=groups, num_groups=num_groups)


PartialDistributedOptimizer = _impl.partial_distributed_optimizer_function(
    __name__, keras, "keras.layers.Layer", Compression.none)
allreduce = _impl.value_function("allreduce", __name__, _TF, True, Compression.none)
allgather = _impl.value_function("allgather", __name__, _TF)
broadcast = _impl.value_function("broadcast", __name__, _TF)
reducescatter = _impl.value_function("reducescatter", __name__, _TF)


def load_model(filepath: str, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none) -> Any:
    """Load a saved model whose optimizer is re-created as a Horovod distributed optimizer."""
    return _impl.load_model(keras, compression, ("keras.src.optimizers", "keras.optimizers"), filepath,
                            custom_optimizers, custom_objects)
