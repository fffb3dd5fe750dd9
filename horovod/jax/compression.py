"""Gradient compression for ``allreduce`` and ``DistributedOptimizer`` on JAX arrays (``hvd.Compression``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class FP16Compressor(CastCompressor):
    """Send floating-point arrays as float16 and cast them back; other dtypes pass unchanged.

    Runs inside ``jax.jit`` too (jnp operations only).
    """

    wire = jnp.dtype(jnp.float16)

    @staticmethod
    def dtype_of(tensor: Any) -> Any:
        return jnp.dtype(tensor.dtype)

    @staticmethod
    def is_float(dtype: Any) -> bool:
        return bool(jnp.issubdtype(dtype, jnp.floating))

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        return tensor.astype(dtype)


class Compression:
    """Available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
