"""Gradient compression for TensorFlow: reduce the bytes sent, restore the dtype afterwards."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TFCast(CastCompressor):
    @staticmethod
    def dtype_of(tensor: Any) -> Any:
        return tensor.dtype

    @staticmethod
    def is_float(dtype: Any) -> bool:
        return bool(dtype.is_floating)

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        return tf.cast(tensor, dtype)


class FP16Compressor(_TFCast):
    """Send floating-point tensors as float16; other dtypes pass through."""

    wire = tf.float16


class BF16Compressor(_TFCast):
    """Send floating-point tensors as bfloat16 (float32's range, 8 bits of mantissa); other dtypes
    pass through. Unlike fp16, large gradients cannot overflow."""

    wire = tf.bfloat16


class Compression:
    """The compression algorithms available to ``allreduce`` and the distributed optimizers:
    ``none``, ``fp16`` and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
