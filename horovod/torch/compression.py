"""Gradient compression for ``allreduce`` and ``DistributedOptimizer`` (``hvd.Compression``).

Two kinds: a ``Compressor`` transforms one tensor before its allreduce and back after it
(stateless: ``Compression.fp16``, ``Compression.bf16``); a ``StatefulCompressor`` is handed a whole
step's gradients at once and does the communication itself, keeping state between steps (low-rank
factors, error feedback: ``horovod.torch.powersgd.PowerSGD``). See docs/compression.md.
"""

from __future__ import annotations

import collections
import inspect
import math
import threading
from typing import Any

import numpy as np
import torch

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "StatefulCompressor", "plain_wire", "KEPT", "host_empty"]


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

    Such a gradient is narrowed into a 16-bit tensor kept for the next step and widened straight
    into ``p.grad`` (``Tensor.copy_`` casts), the same values as ``compress``/``decompress``
    without a new tensor each way: a fresh large tensor costs a page fault per 4 KiB page, twice
    the conversion itself (32 Mi float32 elements: 38 ms into a new float16 tensor, 15 ms into a
    kept one; 58 and 18 ms back).
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


def host_empty(dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A new uninitialised CPU tensor in memory NumPy allocated: NumPy asks the kernel for huge
    pages from 4 MiB on (``madvise``), torch's allocator only under ``THP_MEM_ALLOC_ENABLE``, and a
    fresh tensor's first touch costs a page fault per page (64 MiB float32 widened from 16 bits,
    np=2 on the loaded 2-core machine: 214-316 ms into a ``torch.empty`` tensor, the engine's own
    out-of-place float32 allreduce with its output on NumPy's memory 252 ms in all)."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.empty(math.prod(shape) * item, np.uint8))
    return raw.view(dtype).reshape(shape)


class _Kept:
    """16-bit buffers kept between calls of ``hvd.allreduce(t, compression=...)`` with a plain
    cast (``plain_wire``), by dtype, shape and device: the narrowed copy of a large tensor is
    written into memory already touched, not a fresh tensor (a page fault per 4 KiB page, twice
    the conversion). A call takes a buffer (no other call holds it meanwhile) and gives it back
    when done; at most ``LIMIT`` bytes are kept, the least recently given dropped first."""

    LIMIT = 256 << 20

    def __init__(self) -> None:
        self._free: collections.OrderedDict[tuple[Any, ...], torch.Tensor] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, shape: torch.Size, device: torch.device) -> torch.Tensor:
        key = (dtype, tuple(shape), device)
        with self._lock:
            t = self._free.pop(key, None)
            if t is not None:
                self._bytes -= t.numel() * t.element_size()
                return t
        return host_empty(dtype, shape) if device.type == "cpu" else torch.empty(shape, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes > self.LIMIT:
            return
        key = (t.dtype, tuple(t.shape), t.device)
        with self._lock:
            if key in self._free:
                return
            self._free[key] = t
            self._bytes += nbytes
            while self._bytes > self.LIMIT:
                _, old = self._free.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0


#: the process's kept 16-bit buffers (``_Kept``)
KEPT = _Kept()


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
