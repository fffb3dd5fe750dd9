"""Reductions of 16-bit floats (float16, bfloat16) for transports whose library has none (MPI).

MPI defines no 16-bit float types: without a reduction of its own, every float16 or bfloat16
allreduce would be widened to float32 and put twice the bytes on the wire. ``kernel`` gives, for a
dtype and an op, a function ``run(inbuf, inoutbuf)`` that reduces raw 16-bit buffers elementwise
into ``inoutbuf``; ``MPIBackend`` wraps it in a user-defined MPI operation (``MPI.Op.Create``) over
``MPI.UINT16_T`` (upstream Horovod's ``float16_sum`` over ``MPI_UINT16_T``, ``half.cc``).

Every step of a reduction is one pairwise operation computed in float32 and rounded once to the
16-bit type, to nearest even: ``half(float(a) + float(b))``, as upstream's float16 sum does. Sums
and products of two values are therefore correctly rounded (float32 holds a product of two
16-bit floats exactly, and a sum's float32 rounding is invisible after rounding to 11 or 8
bits but in rare double-rounding ties, where every implementation here agrees), so every
rank computes the same bits whichever implementation it runs. Min and Max propagate NaN.

Implementations, chosen per call (never imported for it):

* PyTorch's vectorized CPU kernels when ``torch`` is already imported in the process (a torch
  job always is): float16/bfloat16 arithmetic at float32's speed;
* NumPy otherwise: its own float16 loops, and for bfloat16 ``ml_dtypes``' loops when that package
  is installed (every process that has NumPy bfloat16 arrays has it: JAX, TensorFlow), else the
  bit-level widening and round-to-nearest-even narrowing below, in cache-sized pieces.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from horovod.common.dtypes import HALF_DTYPES
from horovod.common.types import ReduceOp

__all__ = ["HALF_CHARS", "TORCH_PIECE", "SOLO_PIECE", "piece", "kernel", "numpy_kernel", "scale", "cast",
           "bf16_widen", "bf16_narrow", "ml_bfloat16"]

#: NumPy's type characters of the 16-bit floats: float16, ml_dtypes' bfloat16
HALF_CHARS = frozenset("eE")

Kernel = Callable[[Any, Any], None]

# bfloat16 without ml_dtypes is widened in pieces of this many elements (float32 scratch in cache).
_PIECE = 1 << 14


def ml_bfloat16() -> Any:
    """NumPy's bfloat16 dtype from ``ml_dtypes``, or None where it is not installed (imported on
    first use only: it registers its dtypes with NumPy)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def bf16_widen(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bfloat16 values (their uint16 bits) as float32 into ``out`` (a float32 array of the same
    size): exact, the bits moved to the top half."""
    u = out.view(np.uint32)
    np.left_shift(bits, 16, out=u, dtype=np.uint32)
    return out


def bf16_narrow(x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """float32 ``x`` rounded to bfloat16, to nearest even, as uint16 bits into ``out``; NaN stays
    a (quiet) NaN, infinities and overflow to infinity as IEEE rounding gives. ``x`` is
    overwritten; ``scratch`` is a uint32 array of its size."""
    u = x.view(np.uint32)
    np.right_shift(u, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    nan = np.isnan(x)
    np.add(u, scratch, out=u)  # round half to even at bit 16 (carries into the exponent as it must)
    np.right_shift(u, 16, out=u)
    if nan.any():
        u[nan] = 0x7FC0
    np.copyto(out, u, casting="unsafe")


_NP_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
             ReduceOp.MAX: np.maximum}


def numpy_kernel(dtype: str, op: ReduceOp) -> Kernel:
    """The NumPy implementation of ``kernel`` (see the module docstring)."""
    ufunc = _NP_UFUNC[op]
    if dtype == "float16":
        def run16(inbuf: Any, inoutbuf: Any) -> None:
            a = np.frombuffer(inbuf, np.float16)
            b = np.frombuffer(inoutbuf, np.float16)
            with np.errstate(all="ignore"):  # overflow to inf is the result, as MPI's own ops give
                ufunc(a, b, out=b)
        return run16
    if dtype != "bfloat16":
        raise TypeError(f"no 16-bit float reduction for {dtype}")
    bf16 = ml_bfloat16()
    if bf16 is not None:
        def run_ml(inbuf: Any, inoutbuf: Any) -> None:
            a = np.frombuffer(inbuf, bf16)
            b = np.frombuffer(inoutbuf, bf16)
            with np.errstate(all="ignore"):
                ufunc(a, b, out=b)
        return run_ml
    scratch = np.empty((3, _PIECE), np.float32)

    def run_bits(inbuf: Any, inoutbuf: Any) -> None:
        a = np.frombuffer(inbuf, np.uint16)
        b = np.frombuffer(inoutbuf, np.uint16)
        with np.errstate(all="ignore"):
            for s in range(0, a.size, _PIECE):
                e = min(a.size, s + _PIECE)
                x, y, z = scratch[0, :e - s], scratch[1, :e - s], scratch[2, :e - s]
                ufunc(bf16_widen(a[s:e], x), bf16_widen(b[s:e], y), out=x)
                bf16_narrow(x, b[s:e], z.view(np.uint32))
    return run_bits


# torch runs an elementwise kernel on one thread up to this many elements (at::internal::
# GRAIN_SIZE): the engine's thread calls it in pieces of this size, so that a reduction neither
# starts a second OpenMP team beside the training's (oversubscribed cores) nor leaves cache.
TORCH_PIECE = 32768
# Where torch's intra-op pool has one thread on the calling thread (``torch.get_num_threads()``
# there: 1 under ``mpirun``, or after ``torch.set_num_threads(1)``), no kernel can start a team,
# and pieces this large (1 MiB of float32: the output of one step still in L2 for the next) make
# the per-call cost vanish: 16 Mi elements are 64 calls, not 512. With the views cut in one call
# (``split``), MPI's engine thread at np=2, 16 Mi elements: narrowing 8.5 -> 7.3 ms (float16),
# 13.0 -> 12.0 (bfloat16); widening with Average's division 16.6 -> 12.6 and 16.0 -> 14.4.
SOLO_PIECE = 1 << 18


def piece(torch: Any) -> int:
    """The piece size of torch's 16-bit work on the calling thread: ``SOLO_PIECE`` where torch
    runs every kernel on that thread alone, ``TORCH_PIECE`` otherwise."""
    return SOLO_PIECE if torch.get_num_threads() == 1 else TORCH_PIECE


def _torch_kernel(torch: Any, dtype: str, op: ReduceOp) -> Kernel:
    tdtype = torch.float16 if dtype == "float16" else torch.bfloat16
    if op == ReduceOp.SUM:
        def step(a: Any, b: Any) -> None:
            b.add_(a)
    elif op == ReduceOp.PRODUCT:
        def step(a: Any, b: Any) -> None:
            b.mul_(a)
    else:
        fn = torch.minimum if op == ReduceOp.MIN else torch.maximum

        def step(a: Any, b: Any) -> None:
            fn(a, b, out=b)

    def run(inbuf: Any, inoutbuf: Any) -> None:
        if not len(inoutbuf):
            return
        a = torch.frombuffer(inbuf, dtype=tdtype)
        b = torch.frombuffer(inoutbuf, dtype=tdtype)
        p = piece(torch)
        if b.numel() <= p:
            step(a, b)
            return
        for x, y in zip(a.split(p), b.split(p)):  # views made in one call (no slicing per piece)
            step(x, y)
    return run


def kernel(dtype: str, op: ReduceOp) -> Kernel:
    """``run(inbuf, inoutbuf)``: ``inoutbuf[i] = op(inbuf[i], inoutbuf[i])`` over two buffers of
    ``dtype`` (``HALF_DTYPES``) elements given as raw memory; torch's kernels once torch is
    imported in the process, NumPy's before (decided per call: a process may import torch after
    its first reduction).

    Raises:
        TypeError: ``dtype`` is not a 16-bit float or ``op`` not Sum, Min, Max or Product.
    """
    if dtype not in HALF_DTYPES or op not in _NP_UFUNC:
        raise TypeError(f"no 16-bit float reduction for {dtype} with {op.name}")
    fallback = numpy_kernel(dtype, op)
    fast: list[Kernel] = []

    def run(inbuf: Any, inoutbuf: Any) -> None:
        if not fast:
            torch = sys.modules.get("torch")
            if torch is None or not hasattr(torch, "frombuffer"):
                fallback(inbuf, inoutbuf)
                return
            fast.append(_torch_kernel(torch, dtype, op))
        fast[0](inbuf, inoutbuf)
    return run


def scale(dst: np.ndarray, src: np.ndarray, factor: float, divisor: int = 1) -> None:
    """``dst = src * factor / divisor`` for float16 or ml_dtypes bfloat16 arrays, computed in
    float32 and rounded once (upstream's scaling of 16-bit buffers on the CPU); torch's vectorized
    kernels once torch is imported (NumPy's float16 conversions cost ten times more), NumPy's
    float32 loops before. Both round the same float32 value the same way."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "from_numpy") and dst.size >= _TORCH_SCALE_MIN:
        d, s = _as_torch(torch, dst.reshape(-1)), _as_torch(torch, src.reshape(-1))
        fn, by = _torch_scaling(torch, factor, divisor)
        p = piece(torch)  # one thread, in cache
        for a, b in zip(d.split(p), s.split(p)):
            fn(b, by, out=a)
        return
    if divisor != 1:
        np.divide(src, np.float32(divisor), out=dst, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(src, np.float32(factor), out=dst, dtype=np.float32, casting="unsafe")


# Below this many elements NumPy's call costs less than wrapping the arrays as tensors.
_TORCH_SCALE_MIN = 4096


def cast(dst: np.ndarray, src: np.ndarray, factor: float = 1.0, divisor: int = 1) -> None:
    """``dst[...] = src`` between a 16-bit float array (float16, ml_dtypes bfloat16) and a wider
    float one, either way: narrowing rounds to nearest even (as ``tensor.to(torch.float16)`` and
    NumPy's own casts do), widening is exact. With a ``factor`` or ``divisor``, the 16-bit values
    are scaled as ``scale`` does (after narrowing, in ``dst``; before widening, in ``src``, which
    may be changed: the 16-bit values a 16-bit tensor's reduction gets; bfloat16 with a
    power-of-two multiplier is scaled after widening instead, see below), piece by piece while
    each is in cache. torch's vectorized casts once torch is imported, on one thread in
    cache-sized pieces (``piece``; NumPy's float16 casts cost about ten times more), NumPy's
    before. A compression's narrowing into a fusion buffer and its widening back out of it
    (``buffers``)."""
    narrow = dst.dtype.char in HALF_CHARS
    scaled = factor != 1.0 or divisor != 1
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "from_numpy") and dst.size >= _TORCH_SCALE_MIN:
        d, s = _as_torch(torch, dst.reshape(-1)), _as_torch(torch, src.reshape(-1))
        fn, by = _torch_scaling(torch, factor, divisor)
        # widening bfloat16 with a power-of-two multiplier: scaled after widening, in float32
        # (torch's bfloat16 arithmetic costs about twice float16's here): the same values, since
        # bfloat16 has float32's exponent range, except results among bfloat16's subnormals
        # (below 2**-126), which keep the bits bfloat16 would round away
        wide_after = (scaled and not narrow and src.dtype.char == "E" and fn is torch.mul
                      and math.frexp(by)[0] == 0.5)
        p = piece(torch)
        pieces = zip(d.split(p), s.split(p))  # the views made in one call each
        if not scaled:
            for a, b in pieces:
                a.copy_(b)
        elif wide_after:
            for a, b in pieces:
                a.copy_(b).mul_(by)
        elif narrow:
            for a, b in pieces:
                fn(a.copy_(b), by, out=a)
        else:
            # scaled in place in the 16-bit type (one dtype: torch's vectorized loop; an ``out``
            # of another dtype goes through a temporary), then widened
            for a, b in pieces:
                a.copy_(fn(b, by, out=b))
        return
    if narrow:
        with np.errstate(all="ignore"):  # overflow to inf is the result, as torch's cast gives
            np.copyto(dst, src, casting="unsafe")
        if scaled:
            scale(dst, dst, factor, divisor)
    else:
        if scaled:
            scale(src, src, factor, divisor)
        np.copyto(dst, src, casting="unsafe")


def _torch_scaling(torch: Any, factor: float, divisor: int) -> tuple[Any, float]:
    """(torch function, scalar) computing ``x * factor / divisor`` as ``scale`` does: a division
    by ``divisor``, a multiplication by ``factor``; a power-of-two divisor as a multiplication by
    its inverse (exact: the same float32 value, half the cost of a division)."""
    if divisor == 1:
        return torch.mul, float(np.float32(factor))
    m, _ = math.frexp(divisor)
    if m == 0.5:
        return torch.mul, float(np.float32(1.0 / divisor))
    return torch.div, float(np.float32(divisor))


def _as_torch(torch: Any, a: np.ndarray) -> Any:
    if a.dtype.char == "E":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
