"""Gradient compression for TensorFlow: reduce the bytes sent, restore the dtype afterwards."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface for compressing and decompressing a tensor around a collective."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return the tensor to send and the context that ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return the tensor restored from what the collective produced."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16; other dtypes pass through."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            tensor = tf.cast(tensor, tf.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            tensor = tf.cast(tensor, ctx)
        return tensor


class BF16Compressor(Compressor):
    """Send floating-point tensors as bfloat16 (float32's range, 8 bits of mantissa); other dtypes
    pass through. Unlike fp16, large gradients cannot overflow."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.bfloat16:
            tensor = tf.cast(tensor, tf.bfloat16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            tensor = tf.cast(tensor, ctx)
        return tensor


class Compression:
    """The compression algorithms available to ``allreduce`` and the distributed optimizers:
    ``none``, ``fp16`` and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
