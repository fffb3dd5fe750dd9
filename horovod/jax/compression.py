"""Gradient compression for ``allreduce`` and ``DistributedOptimizer`` on JAX arrays (``hvd.Compression``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Interface: ``compress(array) -> (array, ctx)`` before sending, ``decompress(array, ctx)`` after.

    Both run inside ``jax.jit`` too, so they must be traceable (jnp operations only).
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send arrays unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point arrays as float16 and cast them back; other dtypes pass unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = jnp.dtype(tensor.dtype)
        if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.float16:
            return tensor.astype(jnp.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and jnp.dtype(tensor.dtype) != ctx:
            return tensor.astype(ctx)
        return tensor


class Compression:
    """Available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
