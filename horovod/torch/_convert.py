"""Torch tensor <-> NumPy buffer translation for the engine (CPU tensors only).

A CPU tensor of a dtype NumPy knows is handed to the engine as a zero-copy view
(``tensor.detach().numpy()``), so in-place operations land directly in the tensor's memory.
Two dtypes need a translation:

* ``bfloat16`` (NumPy has no such type): reductions run on a float32 copy that is rounded back
  afterwards; data movement (allgather, broadcast, alltoall) moves the raw bits as ``int16``.
* ``bool``: reductions run on a ``uint8`` copy (Sum/Max = logical or, Min/Product = logical and);
  data movement uses NumPy's ``bool``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod.common.types import ReduceOp

__all__ = ["reduce_input", "move_input", "reduce_output", "move_output", "check_tensor",
           "REDUCE_TORCH_DTYPES", "MOVE_TORCH_DTYPES", "DIRECT_DTYPES"]

# dtypes whose memory NumPy can view directly
_DIRECT = frozenset({torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                     torch.int16, torch.int32, torch.int64})
DIRECT_DTYPES = _DIRECT
REDUCE_TORCH_DTYPES = _DIRECT | {torch.bfloat16, torch.bool}
MOVE_TORCH_DTYPES = _DIRECT | {torch.bfloat16, torch.bool}


def _supported_text(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))


def check_tensor(tensor: Any, what: str, allowed: frozenset[torch.dtype]) -> torch.Tensor:
    """Check that ``tensor`` is a dense CPU tensor of a supported dtype.

    Raises:
        TypeError: not a ``torch.Tensor``.
        NotImplementedError: a CUDA (or other non-CPU) tensor.
        ValueError: an unsupported dtype or a sparse tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"horovod.torch.{what}() expects a torch.Tensor, got {type(tensor).__name__}. "
                        "Convert it with torch.as_tensor() first.")
    if tensor.device.type != "cpu":
        raise NotImplementedError(
            f"horovod.torch.{what}(): the tensor of shape {tuple(tensor.shape)} is on device "
            f"'{tensor.device}'. GPU support is not available in this version of Horovod (CPU "
            "tensors only); move the tensor with .cpu() first.")
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


# ---------------------------------------------------------------------------- reductions
def reduce_input(tensor: torch.Tensor, op: ReduceOp | None, inplace: bool, what: str
                 ) -> tuple[np.ndarray, Callable[[np.ndarray], torch.Tensor]]:
    """Return the array to reduce and a function turning the engine's result into the torch result.

    With ``inplace`` the array is the tensor's own memory when possible (the function then just
    returns ``tensor``); otherwise the result is copied back into ``tensor``.

    Raises:
        ValueError: Average of a bool tensor (it has no meaning; use Sum or Min).
    """
    dt = tensor.dtype
    if dt in _DIRECT:
        t = _plain(tensor)
        if inplace:
            if t.is_contiguous():
                arr = t.numpy()
                return arr, lambda _r: tensor
            work = t.contiguous().numpy()

            def back(r: np.ndarray) -> torch.Tensor:
                with torch.no_grad():
                    tensor.copy_(torch.from_numpy(r))
                return tensor
            return work, back
        return t.contiguous().numpy(), torch.from_numpy
    if dt == torch.bfloat16:
        work = _plain(tensor).to(torch.float32).contiguous().numpy()

        def from_f32(r: np.ndarray) -> torch.Tensor:
            out = torch.from_numpy(r).to(torch.bfloat16)
            if inplace:
                with torch.no_grad():
                    tensor.copy_(out)
                return tensor
            return out
        return work, from_f32
    if dt == torch.bool:
        if op == ReduceOp.AVERAGE:
            raise ValueError(f"horovod.torch.{what}(): op=Average is not defined for bool tensors; use "
                             "op=hvd.Sum or hvd.Max (logical or) or hvd.Min (logical and).")
        work = _plain(tensor).to(torch.uint8).contiguous().numpy()

        def from_u8(r: np.ndarray) -> torch.Tensor:
            out = torch.from_numpy(r) != 0
            if inplace:
                with torch.no_grad():
                    tensor.copy_(out)
                return tensor
            return out
        return work, from_u8
    raise ValueError(f"Tensor type {tensor.type()} is not supported.")


def reduce_output(result: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Turn a reduced array (from a reducescatter) back into a tensor of ``like``'s dtype."""
    out = torch.from_numpy(result)
    if like.dtype == torch.bool:
        return out != 0
    if out.dtype != like.dtype:
        return out.to(like.dtype)
    return out


# ---------------------------------------------------------------------------- data movement
def move_input(tensor: torch.Tensor, inplace: bool
               ) -> tuple[np.ndarray, Callable[[np.ndarray], torch.Tensor]]:
    """Return the array to move and a function turning the engine's result into the torch result."""
    t = _plain(tensor)
    bf16 = t.dtype == torch.bfloat16
    contiguous = t.is_contiguous()
    src = t if contiguous else t.contiguous()
    arr = (src.view(torch.int16) if bf16 else src).numpy()
    if inplace and contiguous:
        return arr, lambda _r: tensor

    def back(r: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(r)
        if bf16:
            out = out.view(torch.bfloat16)
        if inplace:
            with torch.no_grad():
                tensor.copy_(out)
            return tensor
        return out
    return arr, back


def move_output(result: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Turn a moved array (allgather/alltoall output) back into a tensor of ``like``'s dtype."""
    out = torch.from_numpy(result)
    return out.view(torch.bfloat16) if like.dtype == torch.bfloat16 else out


def same_device(tensors: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless every tensor of a grouped call is on the same device."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError("Tensors in list must be on same device.")
