"""Torch tensor <-> engine buffer translation: which path a tensor takes, and its buffers.

``route`` picks the path of a tensor (the request's device tag, see
``horovod.common.engine.device``): ``"cpu"`` (host NumPy), ``"torch:cuda"`` (the device plane on
NCCL), ``"host:cuda"`` (a CUDA tensor staged through pinned host memory over the job's CPU
transport: ``HOROVOD_GPU_OPERATIONS=MPI|GLOO``, a per-op setting, no NCCL, or Adasum) or
``"torch:cpu"`` (a CPU tensor on the device plane's Gloo twin, ``HOROVOD_TORCH_CPU_PLANE=1``).
For the plane a tensor is handed over as a ``DeviceTensor`` (no copy, with its CUDA ordering
events); staged tensors are copied to pinned memory and then follow the host path.

On the host path, a CPU tensor is handed to the engine in its own dtype as a zero-copy view
(``tensor.detach().numpy()``; ``bfloat16`` as ``ml_dtypes.bfloat16``), so in-place operations land
directly in the tensor's memory. Nothing is widened here: what crosses the wire (bool as uint8,
bfloat16 as itself or float32) is the engine's rule per transport (``horovod.common.dtypes``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as _dist

from horovod.common.backends.half import ml_bfloat16
from horovod.common.context import peek_context
from horovod.common.engine.device import gpu_transport
from horovod.common.engine.pages import HUGE_PAGE_BYTES, huge_page_backed, huge_page_empty, malloc_thp, register_owner
from horovod.common.types import ReduceOp, RequestType

if _dist.is_available():
    from horovod.torch._device_plane import PLANE_CPU, PLANE_CUDA, DeviceTensor, set_join_device, wait_done
else:  # a torch without torch.distributed: host paths only
    PLANE_CPU = PLANE_CUDA = ""
    DeviceTensor = wait_done = None  # type: ignore[assignment,misc]

    def set_join_device(device: int) -> None:
        """No device plane here: joined ranks only contribute to host operations."""

__all__ = ["to_engine", "from_engine", "check_tensor", "route",
           "TORCH_DTYPES", "DIRECT_DTYPES", "HOST_CUDA", "set_join_device",
           "memory_on_huge_pages", "HUGE_PAGES_ATTR", "huge_page_zeros"]

HOST_CUDA = "host:cuda"
# PyTorch's CPU allocator asks for transparent huge pages for blocks of 2 MiB or more when this was
# set as torch loaded (horovodrun sets it for its workers); see horovod.common.engine.pages. The
# blocks do not start on a 2 MiB boundary (torch 2.13, measured: data_ptr % 2 MiB != 0), so only
# the whole 2 MiB ranges inside a block are huge pages: from 4 MiB on, that is at least half of
# it, and reducing in place beats copying through the huge-page buffer (ResNet-50 set at np=2,
# same run: 1.42x vs 1.45x the best raw schedule; counting blocks from 2 MiB: 1.45-1.51x).
_THP_SETTING = os.environ.get("THP_MEM_ALLOC_ENABLE", "0").strip()
_TORCH_THP = _THP_SETTING.isdigit() and int(_THP_SETTING) != 0  # as torch's atoi reads it
_THP_MIN_BYTES = 4 * 1024 * 1024
# The attribute of a kept ctypes view of a tensor's memory holding ``_torch_memory_on_huge_pages``'s
# verdict for that tensor (see ``_repeat._HostView``).
HUGE_PAGES_ATTR = "horovod_huge_pages"


# Storages that ``huge_page_zeros`` put on 2 MiB-aligned huge pages: their data pointer -> bytes.
# An entry leaves when the NumPy block under the storage is freed.
_HUGE_BLOCKS: dict[int, int] = {}


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of ``numel`` elements, on 2 MiB-aligned transparent huge pages when it
    is large enough for them (``_THP_MIN_BYTES``) and the kernel gives them (else ``torch.zeros``).

    Whatever the launcher and ``THP_MEM_ALLOC_ENABLE``, a reduction where such a tensor lies moves
    whole huge pages, as the engine's own fusion buffers do (``pages.huge_page_empty``): at np=2 on
    MPI under a plain ``mpirun``, ResNet-50's gradients as views of one such buffer synchronise in
    0.70-0.92x the time of one raw ``Allreduce``, the same views of ``torch.zeros`` in 0.94-1.36x
    (docs/performance.md, "Flat gradients on huge pages").
    """
    nbytes = numel * dtype.itemsize
    if nbytes < _THP_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    block = huge_page_empty(nbytes)
    if not huge_page_backed(block):  # THP off, or NumPy told not to madvise: no gain in aligning
        return torch.zeros(numel, dtype=dtype)
    tensor = torch.from_numpy(block).view(dtype)
    tensor.zero_()
    ptr = tensor.untyped_storage().data_ptr()
    _HUGE_BLOCKS[ptr] = nbytes
    weakref.finalize(block.base, _HUGE_BLOCKS.pop, ptr, None)
    return tensor


def _torch_memory_on_huge_pages(owner: Any) -> bool | None:
    if not isinstance(owner, torch.Tensor):
        # A kept view of a tensor's memory (``_repeat._HostView``: a ctypes block that does not
        # reference the tensor) carries the verdict its tensor had when the view was made.
        return getattr(owner, HUGE_PAGES_ATTR, None) if isinstance(owner, ctypes.Array) else None
    storage = owner.untyped_storage()
    if storage.data_ptr() in _HUGE_BLOCKS:
        return True
    nbytes = storage.nbytes()
    if malloc_thp():  # jemalloc with thp:always: every large block is on huge pages
        return nbytes >= HUGE_PAGE_BYTES
    return _TORCH_THP and nbytes >= _THP_MIN_BYTES


register_owner(_torch_memory_on_huge_pages)
memory_on_huge_pages = _torch_memory_on_huge_pages

# The torch dtypes of the engine's (``horovod.common.dtypes``): every operation takes them all.
TORCH_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                          torch.int16, torch.int32, torch.int64, torch.bool})
# those NumPy views as they are (bfloat16 is viewed as ml_dtypes' type)
DIRECT_DTYPES = TORCH_DTYPES - {torch.bfloat16}


def _supported_text(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))


def check_tensor(tensor: Any, what: str, allowed: frozenset[torch.dtype]) -> torch.Tensor:
    """Check that ``tensor`` is a dense CPU tensor of a supported dtype.

    Raises:
        TypeError: not a ``torch.Tensor``.
        NotImplementedError: a tensor on a device other than the CPU and CUDA.
        ValueError: an unsupported dtype or a sparse tensor; a CUDA tensor on another GPU than
            this process's current one.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"horovod.torch.{what}() expects a torch.Tensor, got {type(tensor).__name__}. "
                        "Convert it with torch.as_tensor() first.")
    dev = tensor.device
    if dev.type == "cuda":
        current = torch.cuda.current_device()
        if dev.index != current:
            raise ValueError(
                f"horovod.torch.{what}(): the tensor of shape {tuple(tensor.shape)} is on {dev}, but "
                f"this process uses cuda:{current}. Each Horovod process works on one GPU (another "
                "rank may own this one): call torch.cuda.set_device(hvd.local_rank()) before "
                "creating tensors, and keep them on that device.")
    elif dev.type != "cpu":
        raise NotImplementedError(
            f"horovod.torch.{what}(): the tensor of shape {tuple(tensor.shape)} is on device "
            f"'{dev}'; Horovod supports CPU and CUDA tensors. Move it with .cpu() or .cuda() first.")
    if tensor.dtype not in allowed:
        raise ValueError(f"Tensor type {tensor.type()} is not supported. horovod.torch.{what}() accepts "
                         f"{_supported_text(allowed)}.")
    if tensor.layout != torch.strided:
        raise ValueError(f"horovod.torch.{what}(): {tensor.layout} tensors are not supported; convert "
                         "to a dense tensor (sparse gradients: use DistributedOptimizer).")
    return tensor


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    # detach() releases the GIL inside torch, and getting it back behind the busy engine thread
    # can cost milliseconds per tensor: only detach tensors that need it.
    return tensor.detach() if tensor.requires_grad else tensor


# ---------------------------------------------------------------------------- routing
@functools.cache
def _nccl() -> bool:
    """Whether this installation's torch can run NCCL on a GPU here: a fact of the process (not
    of a job), asked once."""
    return bool(_dist.is_available() and _dist.is_nccl_available() and torch.cuda.is_available())


def route(tensor: torch.Tensor, kind: RequestType, op: ReduceOp | None = None) -> str:
    """The device tag of ``tensor`` for an operation of ``kind``: which path executes it."""
    ctx = peek_context()
    if tensor.device.type == "cpu":
        if ctx is not None and ctx.config.torch_cpu_plane and op != ReduceOp.ADASUM and PLANE_CPU:
            return PLANE_CPU
        return "cpu"
    if op == ReduceOp.ADASUM or ctx is None or not PLANE_CUDA:
        return HOST_CUDA
    return PLANE_CUDA if gpu_transport(ctx.config, kind, _nccl()) == "NCCL" else HOST_CUDA


def _on_plane(device: str) -> bool:
    return device in (PLANE_CPU, PLANE_CUDA) and device != ""


def _stage(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor (waits for the caller's stream up to this point)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(_plain(tensor))
    return host


def _result(tensor: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    """``out``; with ``inplace``, ``tensor`` holding ``out``'s values."""
    if not inplace:
        return out
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def _to_device(result: torch.Tensor, tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Bring a staged result back onto ``tensor``'s GPU (ordered on the caller's stream)."""
    if inplace:
        with torch.no_grad():
            tensor.copy_(result, non_blocking=result.is_pinned())
        return tensor
    return result.to(tensor.device, non_blocking=result.is_pinned())


def _plane_input(tensor: torch.Tensor, inplace: bool) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    t = _plain(tensor)
    contiguous = t.is_contiguous()
    w = DeviceTensor.of(t if contiguous else t.contiguous())

    def back(r: torch.Tensor) -> torch.Tensor:
        wait_done([w], [r])
        if inplace:
            if not contiguous:
                with torch.no_grad():
                    tensor.copy_(r)
            return tensor
        return r
    return w, back


# ---------------------------------------------------------------------------- engine buffers
def to_engine(tensor: torch.Tensor, inplace: bool, device: str = "cpu"
              ) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    """Return the buffer to hand the engine and a function turning its result into the torch result.

    The same for every operation: the tensor in its own dtype (the engine decides per transport
    what crosses the wire, ``horovod.common.dtypes``). With ``inplace`` the buffer is the tensor's
    own memory when possible (the function then just returns ``tensor``); otherwise the result is
    copied back into ``tensor``. ``device`` is the tensor's route (see ``route``).
    """
    if _on_plane(device):
        return _plane_input(tensor, inplace)
    if device == HOST_CUDA:
        arr, host_back = _host_input(_stage(tensor), inplace)
        return arr, lambda r: _to_device(host_back(r), tensor, inplace)
    return _host_input(tensor, inplace)


def _host_input(tensor: torch.Tensor, inplace: bool
                ) -> tuple[np.ndarray, Callable[[np.ndarray], torch.Tensor]]:
    t = _plain(tensor)
    bf16 = _np_bfloat16() if t.dtype == torch.bfloat16 else None
    if inplace:
        if t.is_contiguous():
            return _numpy(t, bf16), lambda _r: tensor
        return _numpy(t.contiguous(), bf16), lambda r: _result(tensor, _from_numpy(r), True)
    return _numpy(t.contiguous(), bf16), _from_numpy


@functools.cache
def _np_bfloat16() -> np.dtype:
    """NumPy's bfloat16 (``ml_dtypes``, a dependency of the package): bfloat16 tensors are handed
    to the engine as zero-copy views."""
    bf16 = ml_bfloat16()
    if bf16 is None:
        raise ValueError("bfloat16 tensors need the ml_dtypes package (a dependency of horovod): "
                         "pip install ml_dtypes")
    return bf16  # type: ignore[no-any-return]


def _numpy(t: torch.Tensor, bf16: np.dtype | None) -> np.ndarray:
    """A zero-copy NumPy view of CPU tensor ``t`` (bfloat16 as ``bf16``)."""
    return t.view(torch.int16).numpy().view(bf16) if bf16 is not None else t.numpy()


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` that also takes ml_dtypes' bfloat16 arrays (no copy)."""
    if a.dtype.char == "E":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def from_engine(result: Any, like: torch.Tensor, buf: Any = None) -> torch.Tensor:
    """Turn a result the engine made (reducescatter, allgather, alltoall: in ``like``'s dtype) into
    a tensor on ``like``'s device.

    ``buf`` is what was submitted (a ``DeviceTensor`` for the plane, whose result is final).
    """
    if isinstance(result, torch.Tensor):
        wait_done([buf], [result])
        return result
    out = _from_numpy(result)
    return out.to(like.device) if like.is_cuda else out


def same_device(tensors: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless every tensor of a grouped call is on the same device."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError("Tensors in list must be on same device.")
