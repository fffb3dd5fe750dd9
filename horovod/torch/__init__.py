"""Horovod for PyTorch: ``import horovod.torch as hvd``.

::

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Collectives (``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` and their
``_async``, in-place ``_`` and ``grouped_`` variants) work on CPU tensors; see ``mpi_ops``.
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
from horovod.torch.compression import Compression
from horovod.torch.fully_shard import FullyShardedModule, MixedPrecisionPolicy, fully_shard
from horovod.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from horovod.torch.mpi_ops import *  # noqa: F403 - the collectives, re-exported as mpi_ops.__all__ lists them
from horovod.torch.optimizer import DistributedOptimizer
from horovod.torch.powersgd import PowerSGD
from horovod.torch.sync_batch_norm import SyncBatchNorm
from horovod.torch.zero import ZeroRedundancyOptimizer

# isort: split
from horovod.torch import checkpoint, elastic, mpi_ops  # hvd.elastic, imported last: it needs the names above

__all__ = [
    # process-level API (horovod.common.BASICS; a test checks this list covers it)
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "start_timeline", "stop_timeline", "metrics", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]
__all__ += mpi_ops.__all__  # the collectives
__all__ += [
    # training helpers
    "Compression", "PowerSGD", "DistributedOptimizer", "SyncBatchNorm", "ZeroRedundancyOptimizer",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "elastic", "checkpoint",
    "fully_shard", "FullyShardedModule", "MixedPrecisionPolicy",
]
