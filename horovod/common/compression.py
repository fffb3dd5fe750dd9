"""The compressors every binding offers as ``hvd.Compression``, written once over a small adapter.

A compressor transforms one tensor before a collective and back after it:
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``. ``CastCompressor``
sends floating-point tensors at a lower precision and restores their dtype afterwards; other
dtypes pass unchanged, and ``ctx`` is the tensor's own dtype (upstream's contract). A binding
subclasses it once with its framework's three operations (``dtype_of``, ``is_float``, ``cast``) and
names the precision sent (``wire``) per compressor. No framework is imported here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Compressor", "NoneCompressor", "CastCompressor"]


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` before sending, ``decompress(tensor, ctx)`` after."""

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        """Return the tensor to send and the context that ``decompress`` needs."""
        raise NotImplementedError

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        """Return the tensor restored from what the collective produced."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors unchanged."""

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return tensor


class CastCompressor(Compressor):
    """Send floating-point tensors as ``wire`` and cast them back; other dtypes pass unchanged.

    A binding gives ``dtype_of(tensor)``, ``is_float(dtype)`` and ``cast(tensor, dtype)``;
    ``narrows``/``narrow``/``widen`` may be overridden where sending is not a plain cast.
    """

    wire: Any = None

    @staticmethod
    def dtype_of(tensor: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def is_float(dtype: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def narrows(cls, dtype: Any) -> bool:
        """Whether a tensor of ``dtype`` is sent at the lower precision."""
        return cls.is_float(dtype) and dtype != cls.wire

    @classmethod
    def narrow(cls, tensor: Any) -> Any:
        return cls.cast(tensor, cls.wire)

    @classmethod
    def widen(cls, tensor: Any, dtype: Any) -> Any:
        return cls.cast(tensor, dtype)

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        dtype = cls.dtype_of(tensor)
        return (cls.narrow(tensor) if cls.narrows(dtype) else tensor), dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return cls.widen(tensor, ctx) if ctx is not None and cls.narrows(ctx) else tensor
