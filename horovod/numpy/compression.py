"""Compression for NumPy allreduces (``hvd.Compression``): reduce fewer significant bits.

NumPy has no bfloat16 type, so ``Compression.bf16`` rounds floating-point arrays to bfloat16's
precision (round to nearest even, 8 bits of mantissa, float32's range) in a float32 container
before the allreduce and again after it, then restores the caller's dtype: the values are those a
bfloat16 allreduce gives (as the torch binding's host path, which also reduces bfloat16 in float32
and rounds back). On the host path the bytes sent stay float32's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "round_bf16"]


def round_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest bfloat16 value (ties to even), as float32; NaN stays NaN."""
    f = np.ascontiguousarray(x, np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
               & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(f), f, rounded)


class _NumpyCast(CastCompressor):
    @staticmethod
    def dtype_of(tensor: np.ndarray) -> np.dtype:
        return np.asarray(tensor).dtype

    @staticmethod
    def is_float(dtype: np.dtype) -> bool:
        return dtype.kind == "f"

    @staticmethod
    def cast(tensor: np.ndarray, dtype: Any) -> np.ndarray:
        return np.asarray(tensor).astype(dtype)


class FP16Compressor(_NumpyCast):
    """Send floating-point arrays as float16 and cast them back; other dtypes pass unchanged."""

    wire = np.dtype(np.float16)


class BF16Compressor(_NumpyCast):
    """Reduce floating-point arrays at bfloat16 precision (in float32) and restore their dtype."""

    @classmethod
    def narrows(cls, dtype: np.dtype) -> bool:
        return dtype.kind == "f"

    @classmethod
    def narrow(cls, tensor: np.ndarray) -> np.ndarray:
        return round_bf16(tensor)

    @classmethod
    def widen(cls, tensor: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return round_bf16(tensor).astype(dtype)


class Compression:
    """Available compressors: ``Compression.none``, ``Compression.fp16`` and ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
