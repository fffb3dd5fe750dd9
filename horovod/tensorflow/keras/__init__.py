"""Horovod for ``tf.keras``: Keras 3, or Keras 2 (``tf_keras``) when ``TF_USE_LEGACY_KERAS=1``.

::

    import tensorflow as tf
    import horovod.tensorflow.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])          # Keras 3 defaults are fine
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

``model.compile``'s ``jit_compile="auto"`` may choose XLA on GPU machines; XLA cannot run
Horovod's host ops, so the distributed optimizer compiles its model's train step without XLA.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

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
from horovod.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.common.types import Average, Sum
from horovod.tensorflow import _keras_optimizer as _opt
from horovod.tensorflow import init  # noqa: F401 - with TensorFlow's inter-op pool (see there)
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.keras import callbacks, elastic

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum",
    "Compression", "callbacks", "elastic", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_global_variables", "allreduce", "allgather", "broadcast", "reducescatter", "load_model",
]

keras = tf.keras


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",  # noqa: N802
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Return a copy of ``optimizer`` that averages gradients across ranks before applying them.

    The result is an instance of a subclass of the optimizer's class with the same name, built by
    ``from_config`` (hyper-parameters copied; slot state is not). All gradients of a step go to
    the engine as one op. With ``backward_passes_per_step=k`` gradients are summed locally over k
    steps, then allreduced (and divided by k if ``average_aggregated_gradients``) and applied.

    Raises:
        ValueError: ``op`` other than Average/Sum, predivide with Sum, bad ``groups``.
    """
    return _opt.create_distributed_optimizer(
        keras, optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, groups,
        process_set, scale_local_gradients, num_groups)


PartialDistributedOptimizer = _impl.partial_distributed_optimizer_function(
    __name__, keras, "tf.keras.layers.Layer", Compression.none)
allreduce = _impl.value_function("allreduce", __name__, True, None, Compression.none)
allgather = _impl.value_function("allgather", __name__, True)
broadcast = _impl.value_function("broadcast", __name__, True)
reducescatter = _impl.value_function("reducescatter", __name__, True)


def load_model(filepath: str, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """Load a saved model whose optimizer is re-created as a Horovod distributed optimizer.

    Every Keras optimizer class (``keras.optimizers.legacy`` ones with ``legacy_opts=True``) and
    each of ``custom_optimizers`` is wrapped with ``compression``; ``custom_objects`` are merged last.
    """
    prefixes = ("keras.src.optimizers", "tf_keras.src.optimizers", "keras.optimizers",
                "tf_keras.optimizers")
    return _impl.load_model(keras, compression, prefixes, filepath, custom_optimizers, custom_objects,
                            legacy_opts)
