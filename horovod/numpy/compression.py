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

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "round_bf16"]


def round_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest bfloat16 value (ties to even), as float32; NaN stays NaN."""
    f = np.ascontiguousarray(x, np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
               & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(f), f, rounded)


class Compressor:
    """Interface: ``compress(array) -> (array, ctx)`` before sending, ``decompress(array, ctx)`` after."""

    @staticmethod
    def compress(tensor: np.ndarray) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send arrays unchanged."""

    @staticmethod
    def compress(tensor: np.ndarray) -> tuple[np.ndarray, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point arrays as float16 and cast them back; other dtypes pass unchanged."""

    @staticmethod
    def compress(tensor: np.ndarray) -> tuple[np.ndarray, Any]:
        a = np.asarray(tensor)
        if a.dtype.kind == "f" and a.dtype != np.float16:
            return a.astype(np.float16), a.dtype
        return a, None

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        return tensor if ctx is None else np.asarray(tensor).astype(ctx)


class BF16Compressor(Compressor):
    """Reduce floating-point arrays at bfloat16 precision and restore their dtype."""

    @staticmethod
    def compress(tensor: np.ndarray) -> tuple[np.ndarray, Any]:
        a = np.asarray(tensor)
        if a.dtype.kind == "f":
            return round_bf16(a), a.dtype
        return a, None

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        return tensor if ctx is None else round_bf16(tensor).astype(ctx)


class Compression:
    """Available compressors: ``Compression.none``, ``Compression.fp16`` and ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
