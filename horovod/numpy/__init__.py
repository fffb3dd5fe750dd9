"""Horovod's collectives on NumPy arrays: the framework-neutral public API.

Same names, arguments and defaults as ``horovod.torch``::

    import numpy as np
    import horovod.numpy as hvd

    hvd.init()
    avg = hvd.allreduce(np.ones(4, np.float32) * hvd.rank(), name="x")   # Average by default

Every collective must be called by all ranks of its process set, with the same name (or in the same
order when unnamed). ``*_async`` functions return an integer handle for ``poll``/``synchronize``;
functions ending in ``_`` write the result into their input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common import collectives as _C
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
from horovod.common.objects import allgather_object, broadcast_object
from horovod.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.common.types import Adasum, Average, Max, Min, Product, ReduceOp, RequestType, Sum
from horovod.numpy.compression import Compression

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "start_timeline", "stop_timeline", "metrics", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Compression",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "join", "poll", "synchronize", "broadcast_object", "allgather_object",
]


# ---------------------------------------------------------------------------- handles
_register = _C.register_handle
poll = _C.poll
synchronize = _C.synchronize


def _contig(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(a, order="C") for a in arrays]


def _inplace(arrays: Sequence[np.ndarray]) -> tuple[list[np.ndarray], Callable[[Any], None]]:
    """Contiguous working arrays for in-place ops, and a function that writes results back."""
    for a in arrays:
        if not isinstance(a, np.ndarray):
            raise ValueError(f"in-place operations need numpy arrays, got {type(a).__name__}")
        if not a.flags.writeable:
            raise ValueError("in-place operation on a read-only array")
    work = [a if a.flags.c_contiguous else np.asarray(a, order="C") for a in arrays]

    def write_back(_: Any) -> None:
        for a, w in zip(arrays, work):
            if a is not w:
                a[...] = w

    return work, write_back


def _as_arrays(tensors: Any) -> list[np.ndarray]:
    return [np.asarray(t) for t in tensors]


_AR, _BC, _RS = RequestType.ALLREDUCE, RequestType.BROADCAST, RequestType.REDUCESCATTER


def _checked(kind: RequestType, name: str | None, process_set: ProcessSet, grouped: bool,
             check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)``; when it rejects the arguments, the call fails on every rank of the set
    (``collectives.fail_everywhere``), not on this rank alone."""
    try:
        return check(*args)
    except _C.ARGUMENT_ERRORS as exc:
        _C.fail_everywhere(kind, name, process_set, exc, grouped)


# ---------------------------------------------------------------------------- allreduce
def allreduce_async(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an allreduce of ``tensor``; the result is a new array. Returns a handle."""
    rop = _checked(_AR, name, process_set, False, _C.resolve_op, average, op)
    h = _C.allreduce_async(_contig([np.asarray(tensor)]), name=name, op=rop,
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                           process_set=process_set, wake=_wake)
    return _register(h, lambda r: r[0])


def allreduce(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
              op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set,
              compression: Any = Compression.none) -> np.ndarray:
    """Reduce ``tensor`` over all ranks of the set (default: Average) and return the result.

    Must be called by every rank of ``process_set`` with the same name, dtype and shape; a
    mismatch raises on every rank and the engine keeps working. ``compression``
    (``Compression.bf16``, ``Compression.fp16``) reduces at lower precision and restores the dtype.
    """
    sent, ctx = compression.compress(tensor)
    out = synchronize(allreduce_async(sent, average, name, op, prescale_factor, postscale_factor,
                                      process_set, _wake=False))
    return compression.decompress(out, ctx)


def allreduce_async_(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an in-place allreduce of ``tensor``. Returns a handle."""
    rop = _checked(_AR, name, process_set, False, _C.resolve_op, average, op)
    work, back = _checked(_AR, name, process_set, False, _inplace, [tensor])
    h = _C.allreduce_async(work, name=name, op=rop, inplace=True,
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                           process_set=process_set, wake=_wake)
    return _register(h, lambda r: (back(r), tensor)[1])


def allreduce_(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Allreduce ``tensor`` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set, _wake=False))


def grouped_allreduce_async(tensors: Sequence[np.ndarray], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an allreduce of a list of arrays, negotiated and fused as one unit. Returns a handle."""
    rop = _checked(_AR, name, process_set, True, _C.resolve_op, average, op)
    h = _C.allreduce_async(_contig(_as_arrays(tensors)), name=name, op=rop,
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                           process_set=process_set, grouped=True, wake=_wake)
    return _register(h, list)


def grouped_allreduce(tensors: Sequence[np.ndarray], average: bool | None = None, name: str | None = None,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      compression: Any = Compression.none) -> list[np.ndarray]:
    """Allreduce every array of the list (reduction per list position); returns new arrays."""
    packed = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_allreduce_async([p[0] for p in packed], average, name, op, prescale_factor,
                                               postscale_factor, process_set, _wake=False))
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed)]


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an in-place grouped allreduce. Returns a handle."""
    tensors = list(tensors)
    rop = _checked(_AR, name, process_set, True, _C.resolve_op, average, op)
    work, back = _checked(_AR, name, process_set, True, _inplace, tensors)
    h = _C.allreduce_async(work, name=name, op=rop, inplace=True,
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                           process_set=process_set, grouped=True, wake=_wake)
    return _register(h, lambda r: (back(r), tensors)[1])


def grouped_allreduce_(tensors: Sequence[np.ndarray], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Grouped allreduce in place; returns the same arrays."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set, _wake=False))


# ---------------------------------------------------------------------------- allgather
def allgather_async(tensor: np.ndarray, name: str | None = None,
                    process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an allgather (concatenation along dimension 0, in rank order). Returns a handle."""
    h = _C.allgather_async(_contig([np.asarray(tensor)]), name=name, process_set=process_set, wake=_wake)
    return _register(h, lambda r: r[0])


def allgather(tensor: np.ndarray, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ)."""
    return synchronize(allgather_async(tensor, name, process_set, _wake=False))


def grouped_allgather_async(tensors: Sequence[np.ndarray], name: str | None = None,
                            process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an allgather of each array of a list, as one unit. Returns a handle."""
    h = _C.allgather_async(_contig(_as_arrays(tensors)), name=name, process_set=process_set, grouped=True, wake=_wake)
    return _register(h, list)


def grouped_allgather(tensors: Sequence[np.ndarray], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allgather each array of the list; returns a list of gathered arrays."""
    return synchronize(grouped_allgather_async(tensors, name, process_set, _wake=False))


# ---------------------------------------------------------------------------- broadcast
def broadcast_async(tensor: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start a broadcast from ``root_rank`` (a global rank) into a new array. Returns a handle."""
    h = _C.broadcast_async(_contig([np.asarray(tensor)]), root_rank, name=name, process_set=process_set, wake=_wake)
    return _register(h, lambda r: r[0].copy() if r[0] is tensor else r[0])


def broadcast(tensor: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return the root rank's ``tensor`` on every rank (the input is not modified)."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set, _wake=False))


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an in-place broadcast. Returns a handle."""
    work, back = _checked(_BC, name, process_set, False, _inplace, [tensor])
    h = _C.broadcast_async(work, root_rank, name=name, process_set=process_set, inplace=True, wake=_wake)
    return _register(h, lambda r: (back(r), tensor)[1])


def broadcast_(tensor: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Overwrite ``tensor`` with the root rank's values and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set, _wake=False))


# ---------------------------------------------------------------------------- alltoall
def alltoall_async(tensor: np.ndarray, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    h = _C.alltoall_async(np.asarray(tensor, order="C"), splits, name=name, process_set=process_set, wake=_wake)
    return _register(h, lambda r: r[0])


def alltoall(tensor: np.ndarray, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter slices of dimension 0 to every rank and gather theirs.

    ``splits[i]`` rows go to rank i of the set (without ``splits``, equal parts). Returns the
    output, or ``(output, received_splits)`` when ``splits`` is given.
    """
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set, _wake=False))
    return out if splits is None else (out, received)


# ---------------------------------------------------------------------------- reducescatter
def reducescatter_async(tensor: np.ndarray, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, _wake: bool = True) -> int:
    """Start a reducescatter. Returns a handle."""
    rop = _checked(_RS, name, process_set, False, _C.resolve_op, None, op)
    h = _C.reducescatter_async(_contig([np.asarray(tensor)]), name=name, op=rop,
                               process_set=process_set, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, wake=_wake)
    return _register(h, lambda r: r[0])


def reducescatter(tensor: np.ndarray, name: str | None = None, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``tensor`` over the set and return this rank's rows of the result."""
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                           _wake=False))


def grouped_reducescatter_async(tensors: Sequence[np.ndarray], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0, _wake: bool = True) -> int:
    """Start a reducescatter of each array of a list, as one unit. Returns a handle."""
    rop = _checked(_RS, name, process_set, True, _C.resolve_op, None, op)
    h = _C.reducescatter_async(_contig(_as_arrays(tensors)), name=name, op=rop,
                               process_set=process_set, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, grouped=True, wake=_wake)
    return _register(h, list)


def grouped_reducescatter(tensors: Sequence[np.ndarray], name: str | None = None, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[np.ndarray]:
    """Reducescatter each array of the list."""
    return synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                   postscale_factor, _wake=False))


# ---------------------------------------------------------------------------- control
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the set calls ``barrier``."""
    _C.barrier(process_set)


def join() -> int:
    """Declare this rank out of data; returns the last rank to join once all have (see API docs)."""
    return _C.join()
