"""The process-level API that every framework binding re-exports (``hvd.init()``, ``hvd.rank()``...)."""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from horovod.common import context as _ctx
from horovod.common import lifecycle as _lifecycle
from horovod.common import stacks as _stacks
from horovod.common.exceptions import NotInitializedError
from horovod.common.probes import nccl_built

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "start_timeline", "stop_timeline",
]

_atexit_registered = False
_log = logging.getLogger("horovod")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _ctx.peek_context()
        record.hvd_rank = ctx.topology.rank if ctx is not None else "-"
        return True


def _configure_logging(level: str, hide_time: bool) -> None:
    levels = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
              "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}
    _log.setLevel(levels.get(level, logging.WARNING))
    if not any(getattr(h, "_horovod", False) for h in _log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        fmt = "[%(levelname)s horovod rank %(hvd_rank)s] %(message)s"
        if not hide_time:
            fmt = "[%(asctime)s " + fmt[1:]
        handler.setFormatter(logging.Formatter(fmt))
        handler.addFilter(_RankFilter())
        handler._horovod = True  # type: ignore[attr-defined]
        _log.addHandler(handler)
        _log.propagate = False


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start Horovod in this process: choose the transport, learn the topology, start the engine.

    Every process of the job must call it. Calling it again while initialized does nothing; after
    ``shutdown()`` it starts a new engine.

    Args:
        comm: None (all processes of the job), a list of world ranks, or an ``mpi4py`` communicator.
        process_sets: None, a list of ``ProcessSet`` (the same list on every rank), or "dynamic".

    Raises:
        ConfigError: a ``HOROVOD_*`` variable has an unusable value.
        BackendUnavailableError: the selected transport cannot start.
        ValueError: bad ``comm`` or ``process_sets``.
    """
    global _atexit_registered
    with _ctx._lock:
        ctx = _ctx.peek_context()
        if ctx is not None and ctx.started:
            ctx.resolve_process_sets(process_sets)
            return
        if ctx is None:
            ctx = _ctx.Context(comm=comm, start=False)
            _ctx.set_context(ctx)
            _configure_logging(ctx.config.log_level, ctx.config.log_hide_time)
            _log.info("started by %s; local rank %d of %d, cross rank %d of %d",
                      ctx.launch.describe(), ctx.topology.local_rank, ctx.topology.local_size,
                      ctx.topology.cross_rank, ctx.topology.cross_size)
            if _lifecycle.wanted(ctx.topology.size):  # a launched worker; HOROVOD_FAIL_FAST=0: never
                _lifecycle.install()
            if ctx.topology.size > 1:
                _lifecycle.note_multi_rank(ctx.topology.rank, ctx.topology.size)
            if not _atexit_registered:
                atexit.register(_lifecycle.end_process, shutdown)
                _atexit_registered = True
        # A bad process-set list raises here and leaves Horovod connected (hvd.size() works),
        # as upstream: init() may be called again with a valid list.
        ctx.start(process_sets)
        _install_stacks(ctx)


def _install_stacks(ctx: Any) -> None:
    """SIGUSR1 prints this rank's stacks and flight record (``horovod.common.stacks``)."""
    engine = ctx.engine
    if engine is None or _stacks.installed():
        return
    who = f"rank {ctx.topology.rank} (host {ctx.hostnames[ctx.topology.rank]}, pid {os.getpid()})"
    _stacks.install(lambda: who, lambda: engine.flight_record(_stacks.DUMP_DONE))


def shutdown() -> None:
    """Stop the engine on this rank and on every other rank (their pending operations fail)."""
    with _ctx._lock:
        ctx = _ctx.peek_context()
        if ctx is None:
            return
        _ctx.set_context(None)
    try:
        ctx.close()
    finally:
        _stacks.uninstall()  # SIGUSR1 back to its default action
        _lifecycle.uninstall()  # the fail-fast hook lives from init to shutdown


def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered process set: ``{id: sorted global ranks}`` (upstream's internal helper)."""
    return {i: list(ps.ranks or []) for i, ps in sorted(_ctx.get_context().process_sets.items())}


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _ctx.peek_context() is not None


def _topology_field(field: str, doc: str) -> Callable[[], int]:
    """The public function ``field()``: this rank's ``RankIdentity.<field>``, with ``doc`` as its docstring.

    Like every reader of the live context, it raises ``NotInitializedError`` before ``init()`` or after
    ``shutdown()``.
    """

    def accessor() -> int:
        return int(getattr(_ctx.get_context().topology, field))

    accessor.__name__ = accessor.__qualname__ = field
    accessor.__doc__ = doc
    return accessor


size = _topology_field("size", "Number of processes in the job.")
rank = _topology_field("rank", "This process's rank, 0 .. size()-1.")
local_size = _topology_field("local_size", "Number of processes on this host.")
local_rank = _topology_field("local_rank", "This process's index among the processes of its host.")
cross_size = _topology_field("cross_size", "Number of hosts that run a process with this process's local rank.")
cross_rank = _topology_field("cross_rank",
                             "Index of this host among the hosts that run a process with this local rank.")


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    return bool(_ctx.get_context().is_homogeneous)


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE.

    Raises:
        ValueError: Horovod is not initialized or does not use MPI.
    """
    ctx = _ctx.get_context()
    if ctx.backend_name != "mpi":
        raise ValueError("Horovod MPI is not enabled in this job (it uses "
                         f"{ctx.backend_name}); mpi_threads_supported() needs MPI.")
    from mpi4py import MPI

    return bool(ctx.backend.thread_level == MPI.THREAD_MULTIPLE)


def mpi_built() -> bool:
    """Whether the MPI transport can be used (mpi4py is importable)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether this job runs on MPI."""
    ctx = _ctx.get_context()
    return ctx.backend_name == "mpi"


def gloo_built() -> bool:
    """Whether the Gloo transport can be used (PyTorch with torch.distributed is importable)."""
    return importlib.util.find_spec("torch") is not None


def gloo_enabled() -> bool:
    """Whether this job runs on Gloo."""
    return _ctx.get_context().backend_name == "gloo"


def cuda_built() -> bool:
    """Whether GPU (CUDA) tensors can be used through PyTorch."""
    return nccl_built() > 0


def rocm_built() -> bool:
    """Always False: this build has no ROCm path."""
    return False


def ddl_built() -> bool:
    """Always False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """Always False: oneCCL is not supported."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline to ``file_path`` (rank 0 writes); switches files if one is open.

    Raises:
        ValueError: not initialized, or the job was not started with ``HOROVOD_TIMELINE`` set.
    """
    ctx = _ctx.get_context()
    if not ctx.config.timeline:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    ctx._engine().start_timeline(os.fspath(file_path), mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close its file (harmless when none is open)."""
    ctx = _ctx.peek_context()
    if ctx is None:
        raise NotInitializedError()
    ctx._engine().stop_timeline()


def metrics() -> dict:
    """This rank's engine counters, as a dict (for a logger of your own: TensorBoard, Lightning...).

    Keys: ``rank``, ``size``; per operation kind (``"allreduce"``...) ``collectives`` (tensors),
    ``collective_bytes`` (bytes this rank submitted) and ``collective_seconds`` (time in the
    transport); ``wait_seconds`` (time this rank's submitted tensors waited for other ranks);
    ``steps`` and ``step_times`` (the last step durations, seconds; a step ends whenever this rank
    has no operation left in flight); ``stalled_tensors`` and ``in_flight``; the coordinator's
    straggler verdict as of its last exchange (``straggler``: is this rank one,
    ``straggler_score``, ``stragglers``: every flagged rank, ``straggler_scores``: each rank's
    score, the share of a step the others spent waiting for it, smoothed over recent steps).

    Raises:
        NotInitializedError: before ``init()``.
    """
    ctx = _ctx.peek_context()
    if ctx is None:
        raise NotInitializedError()
    return ctx._engine().metrics_snapshot()
