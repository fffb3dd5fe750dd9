"""Horovod for JAX: collectives on ``jax.Array`` (eager and inside ``jax.jit``), optax, elastic.

::

    import jax, optax
    import horovod.jax as hvd

    hvd.init()
    params = hvd.broadcast_parameters(params, root_rank=0)
    tx = hvd.DistributedOptimizer(optax.sgd(0.01 * hvd.size()))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)   # gradients averaged here
        return optax.apply_updates(params, updates), opt_state

The same names and semantics as ``horovod.torch`` where they apply (JAX arrays are immutable, so
there are no in-place ``_`` variants). JAX arrays go through Horovod's NumPy path (see
``horovod.jax.mpi_ops``); arrays on a GPU are staged through host memory.
"""

from __future__ import annotations

from horovod.common.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
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
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.common.types import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from horovod.jax import elastic
from horovod.jax.compression import Compression
from horovod.jax.functions import allgather_object, allreduce_tree, broadcast_object, broadcast_parameters
from horovod.jax.mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    is_traced,
    join,
    last_error,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from horovod.jax.optimizer import DistributedOptimizer

__all__ = [
    # process-level API (horovod.common.BASICS)
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "start_timeline", "stop_timeline", "metrics", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "HorovodInternalError", "HostsUpdatedInterrupt",
    # collectives
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier",
    "is_traced", "last_error",
    # training helpers
    "Compression", "DistributedOptimizer", "broadcast_parameters", "allreduce_tree",
    "broadcast_object", "allgather_object", "elastic",
]
