"""Horovod for TensorFlow 2 (eager and ``tf.function``) and TF1 graphs (``tf.compat.v1``).

::

    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)      # gradients averaged over all ranks
    grads = tape.gradient(loss, model.trainable_variables)

Every collective must be called by all ranks of its process set (in graphs: the same ops, which
get the same node names on every rank). The engine is Horovod's pure-Python core; TensorFlow
tensors reach it as NumPy arrays (through ``tf.numpy_function`` inside graphs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from horovod.common import BASICS as _BASICS
from horovod.common import basics as _basics
from horovod.common.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
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
from horovod.common.collectives import check_adasum
from horovod.common.collectives import resolve_op as _resolve_op
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.common.types import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from horovod.tensorflow._grads import sparse_allreduce as _sparse_allreduce
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.functions import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from horovod.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from horovod.tensorflow.mpi_ops import (
    _allreduce,
    _grouped_allreduce,
    _grouped_reducescatter,
    _reducescatter,
    allgather,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from horovod.tensorflow.optimizer import DistributedOptimizer
from horovod.tensorflow.util import _executing_eagerly  # noqa: F401 - upstream has hvd._executing_eagerly

#: the inter-op pool importing this module asks TensorFlow for when the program chose none
INTEROP_THREADS = 64


def init(comm: Any = None, process_sets: Any = None) -> None:
    """``hvd.init()`` of every binding (``horovod.common.basics.init``: joins the job, starts the
    engine), after telling TensorFlow's autograph to trace Horovod's own functions unconverted.

    Args:
        comm: the ranks of this job: None (all), a list of world ranks, or an ``mpi4py`` communicator.
        process_sets: the process sets to register (the same on every rank), or "dynamic".
    """
    _exclude_from_autograph()
    _basics.init(comm, process_sets)


def _widen_interop_pool() -> None:
    """TF1 sessions run graph ops on a shared inter-op pool (one thread per core by default).
    Horovod's ops block their thread until every rank submitted the same op, and TF may start
    independent ops in a different order on each rank: with fewer threads than independent Horovod
    ops in one ``session.run``, ranks could each hold all their threads on ops the other rank has
    not reached. A larger pool (idle threads cost nothing) makes that need dozens of independent
    ops in one run.

    Sessions made with a ``ConfigProto`` of their own that leaves the count at 0 (upstream's
    recipes make them so) take their pool size from ``TF_NUM_INTEROP_THREADS``, which TensorFlow
    reads once, the first time any session or the eager runtime sizes a pool: possibly before
    ``hvd.init()`` (a test harness opening its session first). So this runs at import, the one
    change the package makes to the environment there, and only when the program set neither
    that variable nor ``tf.config.threading``'s setting; the setting is widened too, for the
    eager runtime and sessions without a ``ConfigProto``."""
    if os.environ.get("TF_NUM_INTEROP_THREADS") or tf.config.threading.get_inter_op_parallelism_threads():
        return
    os.environ["TF_NUM_INTEROP_THREADS"] = str(INTEROP_THREADS)
    with contextlib.suppress(RuntimeError):  # the runtime already started: its eager pool stays
        tf.config.threading.set_inter_op_parallelism_threads(INTEROP_THREADS)


def _exclude_from_autograph() -> None:
    """Autograph would rewrite Horovod's own Python inside a ``tf.function`` (tracing it unchanged is what
    we want): a ``DoNotConvert("horovod")`` rule, added by ``hvd.init()`` (not at import: importing
    changes nothing of TensorFlow's) and kept after ``shutdown()`` (it concerns Horovod's code only)."""
    try:
        from tensorflow.python.autograph.core import config as _ag_config
    except ImportError:  # pragma: no cover - private module moved
        return
    rules = tuple(_ag_config.CONVERSION_RULES)
    if not any(getattr(r, "_prefix", None) == "horovod" for r in rules):
        _ag_config.CONVERSION_RULES = (_ag_config.DoNotConvert("horovod"),) + rules


_widen_interop_pool()

__all__ = [
    # process-level names (horovod.common.BASICS)
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "start_timeline", "stop_timeline", "metrics", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "HorovodInternalError", "HostsUpdatedInterrupt",
    # TensorFlow
    "Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "size_op", "local_size_op",
    "rank_op", "local_rank_op", "process_set_included_op", "broadcast_variables",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape",
    "SyncBatchNormalization", "gpu_available",
]
assert set(_BASICS) <= set(__all__)


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether Horovod's ``ext_base_name`` extension reduces GPU tensors (upstream's helper).

    TensorFlow tensors are reduced on the CPU here, so ``'tensorflow'`` is always False; ``'torch'``
    is True where PyTorch has CUDA and NCCL.
    """
    return ext_base_name == "torch" and bool(cuda_built())


def _check_adasum(op: ReduceOp, process_set: ProcessSet | None) -> None:
    """Upstream's Adasum preconditions, raised in Python (at trace time inside ``tf.function``)."""
    if op == ReduceOp.ADASUM:
        ps_id = 0 if process_set is None else process_set.process_set_id
        if ps_id is not None:
            check_adasum(ps_id, "float32")


def _check_sparse(op: ReduceOp, prescale_factor: float, postscale_factor: float) -> None:
    if op == ReduceOp.ADASUM:
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a "
                                  "workaround please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"Only Sum and Average ops are supported with tf.IndexedSlices, got "
                                  f"op={ReduceOp(op).name}. Pass sparse_as_dense=True (or densify with "
                                  "tf.convert_to_tensor) to use other ops.")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _through(compression: Any, tensor: Any, collective: Callable[[Any], Any]) -> Any:
    """``collective`` applied to ``tensor`` compressed, and its result decompressed."""
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    return compression.decompress(collective(compressed), ctx)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over all ranks of the set (default op: Average).

    Dense tensors are compressed, allreduced and decompressed. ``tf.IndexedSlices`` are reduced by
    allgathering values and indices (values divided by the set size for Average); duplicate indices
    are not merged. Every rank of ``process_set`` must call it; a shape/dtype mismatch raises on
    every rank (``FailedPreconditionError`` in eager mode).

    Raises:
        NotImplementedError: IndexedSlices with an op other than Sum/Average, or with scale factors.
        ValueError: both ``average`` and ``op`` given.
    """
    op = _resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            return _sparse_allreduce([tensor], op, process_set, name=name,
                                     ignore_name_scope=ignore_name_scope)[0]
    _check_adasum(op, process_set)
    with tf.device(device_dense):
        return _through(compression, tensor, lambda t: _allreduce(
            t, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            ignore_name_scope=ignore_name_scope, process_set=process_set))


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> list[Any]:
    """Allreduce a list of tensors as one negotiated, fused unit; output order is preserved.

    Dense entries go through one grouped allreduce, ``tf.IndexedSlices`` entries through one
    grouped allgather.
    """
    tensors = list(tensors)
    if not tensors:
        return tensors
    op = _resolve_op(average, op)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    out: list[Any] = list(tensors)
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            res = _sparse_allreduce([tensors[i] for i in sparse], op, process_set,
                                    name=None if name is None else name + "_sparse",
                                    ignore_name_scope=ignore_name_scope)
        for i, r in zip(sparse, res):
            out[i] = r
    if dense:
        _check_adasum(op, process_set)
        with tf.device(device_dense):
            pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
            reduced = _grouped_allreduce([p[0] for p in pairs], name=name, op=op,
                                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                         ignore_name_scope=ignore_name_scope, process_set=process_set)
            for i, r, (_, ctx) in zip(dense, reduced, pairs):
                out[i] = compression.decompress(r, ctx)
    return out


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: int = Average, name: str | None = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` across the set and return this rank's part of dimension 0.

    With N rows and P ranks, ranks 0 .. N%P-1 get N//P+1 rows and the others N//P.
    """
    with tf.device(device_dense):
        return _through(compression, tensor, lambda t: _reducescatter(
            t, name=name, op=op, ignore_name_scope=ignore_name_scope, process_set=process_set,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor))


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: Any = Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each tensor of the list as one unit (all must share a dtype)."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    with tf.device(device_dense):
        pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        outs = _grouped_reducescatter([p[0] for p in pairs], op=op, process_set=process_set,
                                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def __getattr__(name: str) -> Any:
    # Lazy: importing the Keras layer classes costs seconds and fixes the Keras flavour (3 vs 2).
    if name == "SyncBatchNormalization":
        from horovod.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module 'horovod.tensorflow' has no attribute {name!r}")

from horovod.tensorflow import elastic as elastic  # noqa: E402 - hvd.elastic (needs the names above)
