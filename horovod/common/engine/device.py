"""Device planes: how the engine executes a batch whose tensors a framework owns (GPU tensors).

The engine's own executor runs batches on host NumPy buffers through the job's CPU transport.
A *device plane* supplies instead a ``transport.Lane`` on the framework's tensors where they live
(CUDA memory) and that framework's collective library (NCCL through ``torch.distributed``): its
buffer operations and a transport. Negotiation, the response cache, names, fusion planning, the
operations themselves (the executor's), error paths, join and process sets stay the engine's.

A request's ``device`` says which path executes it:

* ``"cpu"``: host NumPy buffers (the executor's own path);
* ``"host:<kind>"``: device tensors staged through host memory by the binding; the executor's
  own path runs them, the tag only keeps negotiation from pairing them with other kinds;
* ``"<plane>:<kind>"`` for a registered plane (``"torch:cuda"``, and ``"torch:cpu"``, the CPU twin
  of the CUDA path used to test it without a GPU): the plane runs the batch.

Ranks that submit one name with different tags fail with a ``CollectiveMismatchError`` naming the
ranks and their devices. This module imports no framework: ``horovod.torch`` registers its plane
with ``register_plane`` when it is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from horovod.common.backends.base import EngineBackend, Group
from horovod.common.engine.transport import Lane
from horovod.common.engine.tunables import Tunables
from horovod.common.exceptions import ConfigError, HorovodInternalError
from horovod.common.types import RequestType, Response

__all__ = ["DevicePlane", "DevicePlaneError", "PlaneServices", "Planes", "register_plane", "is_plane", "plane_name",
           "GPU_OP_SETTINGS", "gpu_transport", "check_gpu_settings"]


class DevicePlaneError(HorovodInternalError):
    """A device plane could not run a batch (bad device placement, library failure).

    The engine fails the batch's operations with it on this rank and keeps serving; every member
    of the set sees the same cause, since planes check what all members share.
    """


class DevicePlane(Protocol):
    """Supplies the lane that runs planned batches of one device kind (see the module docstring)."""

    def lane(self, batch: Sequence[Response], entries: Sequence[Any], group: Group) -> AbstractContextManager[Lane]:
        """The lane (buffer operations, transport, placement) that runs ``batch``; ``entries[i]`` is
        this rank's entry for ``batch[i]`` (None after join).

        The executor runs the batch inside the context (which orders it after the callers' work
        and translates the library's errors). Called only from the engine thread, in the same
        order on every member of ``group``.
        """

    def free_group(self, group: Group) -> None:
        """Release what the plane made for ``group`` (its process set was removed on every rank)."""

    def close(self) -> None:
        """Release process groups and buffers (the engine has stopped)."""


@dataclass(frozen=True)
class PlaneServices:
    """What the engine lends a plane: no more (a plane plans with ``plan``, scales and packs with
    ``buffers``, and never reaches into the executor).

    Attributes:
        backend: the job's CPU transport (small exchanges: store addresses, sizes, splits).
        tunables: the engine's tunables (``max_tensor_bytes``, ``fusion_threshold``), read per batch.
        timeout_s: how long set-up and collectives may wait for peers (``HOROVOD_GLOO_TIMEOUT_SECONDS``).
        hostnames: each rank's host name, by global rank (None: unknown, taken as one host).
        secret: the job secret that keys the plane's stores (None: a key travels over ``backend``).
    """

    backend: EngineBackend
    tunables: Tunables
    timeout_s: float = 30.0
    hostnames: tuple[str, ...] | None = None
    secret: str | None = None


# plane name -> factory(PlaneServices) -> DevicePlane
_FACTORIES: dict[str, Callable[[PlaneServices], DevicePlane]] = {}


def register_plane(name: str, factory: Callable[[PlaneServices], DevicePlane]) -> None:
    """Register the plane that runs requests whose device is ``"<name>:<kind>"``."""
    _FACTORIES[name] = factory


def plane_name(device: str) -> str:
    return device.partition(":")[0]


def is_plane(device: str) -> bool:
    """Whether a request with this device tag is executed by a registered plane."""
    return device != "cpu" and plane_name(device) in _FACTORIES


class Planes:
    """The planes of one executor, created on first use."""

    def __init__(self, services: PlaneServices) -> None:
        self.services = services
        self._planes: dict[str, DevicePlane] = {}

    def lane(self, batch: Sequence[Response], entries: Sequence[Any], group: Group) -> AbstractContextManager[Lane]:
        name = plane_name(batch[0].request.device)
        plane = self._planes.get(name)
        if plane is None:
            plane = self._planes[name] = _FACTORIES[name](self.services)
        return plane.lane(batch, entries, group)

    def free_group(self, group: Group) -> None:
        for plane in self._planes.values():
            plane.free_group(group)

    def close(self) -> None:
        planes, self._planes = self._planes, {}
        for plane in planes.values():
            plane.close()


# ------------------------------------------------------------------------- GPU settings
GPU_OP_SETTINGS: dict[RequestType, str] = {
    RequestType.ALLREDUCE: "gpu_allreduce",
    RequestType.ALLGATHER: "gpu_allgather",
    RequestType.BROADCAST: "gpu_broadcast",
    RequestType.ALLTOALL: "gpu_alltoall",
    RequestType.REDUCESCATTER: "gpu_reducescatter",
}


def gpu_transport(config: Any, kind: RequestType, nccl: bool) -> str:
    """``"NCCL"`` or ``"HOST"`` (staged through host memory) for a GPU tensor of ``kind``.

    The per-op setting (``HOROVOD_GPU_ALLREDUCE`` ...) wins over ``HOROVOD_GPU_OPERATIONS``; the
    default is NCCL when it is available. MPI and GLOO both mean host-staged over the job's CPU
    transport.
    """
    attr = GPU_OP_SETTINGS.get(kind)
    chosen = (getattr(config, attr, "") if attr else "") or getattr(config, "gpu_operations", "")
    if chosen:
        return "NCCL" if chosen == "NCCL" else "HOST"
    return "NCCL" if nccl else "HOST"


def check_gpu_settings(config: Any, nccl_version: Callable[[], int]) -> None:
    """Reject a setting that asks for NCCL where there is none (at ``init``, on every rank).

    Raises:
        ConfigError: ``HOROVOD_GPU_OPERATIONS`` or a per-op setting is NCCL but PyTorch with CUDA
            and NCCL is not available in this process.
    """
    names = {"gpu_operations": "HOROVOD_GPU_OPERATIONS"}
    names.update({attr: "HOROVOD_" + attr.upper() for attr in GPU_OP_SETTINGS.values()})
    wanted = [env for attr, env in names.items() if getattr(config, attr, "") == "NCCL"]
    if not wanted or nccl_version() > 0:
        return
    raise ConfigError(
        f"{wanted[0]}=NCCL, but NCCL cannot be used in this process: it needs PyTorch built with "
        "CUDA and NCCL and a visible GPU (torch.cuda.is_available() is False here, or torch is "
        "missing). Unset it to use the default, or set it to MPI or GLOO to stage GPU tensors "
        "through host memory.", variable=wanted[0], value="NCCL")

