"""Framework-neutral core of Horovod: process API, engine, transports, process sets.

This package imports only the standard library and NumPy (plus mpi4py when the MPI transport
starts). It never imports a deep-learning framework or ``horovod.runner``.

Importing the package itself loads nothing else: ``import horovod.common.exceptions`` or
``horovod.common.protocol`` (what ``horovodrun`` needs) does not start the engine's imports. The
process-level names below (``horovod.common.init``, ``rank``, ``Sum``...) load their module on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# The process-level names every binding re-exports (declared once, here), by defining module.
_HOME = {
    **dict.fromkeys(("init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
                     "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built",
                     "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
                     "rocm_built", "ddl_built", "ccl_built", "start_timeline", "stop_timeline",
                     "metrics"),
                    "basics"),
    **dict.fromkeys(("ProcessSet", "global_process_set", "add_process_set", "remove_process_set"),
                    "process_sets"),
    **dict.fromkeys(("Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp"), "types"),
    **dict.fromkeys(("HorovodInternalError", "HostsUpdatedInterrupt"), "exceptions"),
}

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "start_timeline", "stop_timeline", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "HorovodInternalError", "HostsUpdatedInterrupt", "metrics",
]
BASICS = tuple(__all__)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
