"""Gradient compression for ``allreduce`` and ``DistributedOptimizer`` (``hvd.Compression``).

Two kinds: a ``Compressor`` transforms one tensor before its allreduce and back after it
(stateless: ``Compression.fp16``, ``Compression.bf16``); a ``StatefulCompressor`` is handed a whole
step's gradients at once and does the communication itself, keeping state between steps (low-rank
factors, error feedback: ``horovod.torch.powersgd.PowerSGD``). See docs/compression.md.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "StatefulCompressor", "plain_wire"]


class _TorchCast(CastCompressor):
    @staticmethod
    def dtype_of(tensor: torch.Tensor) -> torch.dtype:
        return tensor.dtype

    @staticmethod
    def is_float(dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return tensor.to(dtype)


class FP16Compressor(_TorchCast):
    """Send floating-point tensors as float16 and cast them back; other dtypes pass unchanged."""

    wire = torch.float16


class BF16Compressor(_TorchCast):
    """Send floating-point tensors as bfloat16 (float32's range, 8 bits of mantissa) and cast them
    back; other dtypes pass unchanged. Unlike fp16, large gradients cannot overflow."""

    wire = torch.bfloat16


class Compression:
    """Available compressors: ``Compression.none``, ``Compression.fp16`` and ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def plain_wire(compression: Any) -> torch.dtype | None:
    """The dtype a compression sends when it is a plain cast (``Compression.fp16``, ``.bf16``:
    narrowing and widening are ``tensor.to(dtype)``), else None.

    Such a tensor is handed to the engine as it is, to be reduced as the 16-bit dtype
    (``mpi_ops.fused_wire``): narrowed on its way into the fusion buffer and widened on the way
    out, the same values as ``compress``/``decompress`` without a 16-bit copy of the tensor nor a
    pass of its own each way. Only the built-in casts qualify: a subclass that overrides any of
    their methods keeps the generic path (its own ``compress``/``decompress``).
    """
    try:
        return _PLAIN_WIRE[compression]
    except (KeyError, TypeError):  # not seen yet, or not hashable (then not a compressor class)
        pass
    wire = None
    if isinstance(compression, type) and issubclass(compression, _TorchCast):
        plain = all(inspect.getattr_static(compression, m) is inspect.getattr_static(_TorchCast, m)
                    for m in ("narrows", "narrow", "widen", "compress", "decompress", "cast", "is_float",
                              "dtype_of"))
        wire = compression.wire if plain and isinstance(compression.wire, torch.dtype) else None
        _PLAIN_WIRE[compression] = wire
    return wire


_PLAIN_WIRE: dict[Any, torch.dtype | None] = {}


class StatefulCompressor:
    """Interface: compression that averages a whole step's gradients itself and keeps state.

    ``DistributedOptimizer(opt, compression=c)`` with such a ``c`` starts no per-gradient
    allreduce: at the end of each backward pass that completes a step's gradients (or in
    ``step()``/``synchronize()``) it calls ``c.reduce_(grads, names, comm)`` once, with every
    gradient of the parameters it updates, in the same order on every rank (zeros for a parameter
    without a gradient). ``reduce_`` must leave in each tensor the (approximate) average over the
    ranks of ``comm``. ``comm`` offers (see ``horovod.torch._grad_comm.GradientCommunicator``):

    - ``comm.allreduce_async_(tensors, name) -> handle`` and ``comm.wait(handle)``: one fused,
      in-place average of a list of tensors; ``comm.allreduce_(tensors, name)`` waits at once;
    - ``comm.agree(integers, name) -> bool``: whether every rank passed the same integers (the
      same answer everywhere: check state that must agree before submitting by it);
    - ``comm.allgather_object(obj, name) -> list``: one picklable object from every rank;
    - ``comm.rank``, ``comm.size``: this rank's position in the process set and its size;
    - ``comm.bytes_submitted``: bytes handed to its allreduces so far (a counter).

    Every rank must submit the same names in the same order. The optimizer stores
    ``state_dict()`` in its own ``state_dict()`` (so checkpoints and elastic commits carry it) and
    hands it back to ``load_state_dict()``.
    """

    def reduce_(self, grads: list[torch.Tensor], names: list[str], comm: Any) -> None:
        """Average ``grads`` (in place) over the ranks of ``comm``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The state to checkpoint (tensors and plain values)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned."""
