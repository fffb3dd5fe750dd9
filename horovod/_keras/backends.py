"""Gradient averaging for Keras 3's PyTorch and JAX backends (the TensorFlow backend uses
``horovod.tensorflow``'s graph ops, see ``horovod._keras``).

Keras 3 passes every step's gradients through ``BaseOptimizer._clip_gradients`` right before the
update (``keras/src/optimizers/base_optimizer.py``; with ``gradient_accumulation_steps`` the mean of
the accumulated gradients), eagerly on torch (``backend/torch/trainer.py`` calls
``optimizer.apply``) and inside the jitted ``stateless_apply`` on JAX. The distributed optimizer
reduces them there, as one grouped operation per dtype: ``horovod.torch.grouped_allreduce`` on
torch tensors, ``horovod.jax.grouped_allreduce`` on JAX arrays (an ordered host callback when
traced).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from horovod.common.process_sets import ProcessSet
from horovod.common.types import ReduceOp

__all__ = ["make_reduce", "backend_compression", "KERAS3_BACKENDS"]

KERAS3_BACKENDS = ("tensorflow", "torch", "jax")
_COMPRESSORS = {"NoneCompressor": "none", "FP16Compressor": "fp16", "BF16Compressor": "bf16"}


def backend_compression(backend: str, compression: Any) -> Any:
    """The backend's compressor of the same kind as ``compression`` (given as TF's or any binding's
    ``Compression.none``/``fp16``/``bf16``); other compressors are used as given.

    Raises:
        ValueError: a kind the backend's binding does not have (``bf16`` on JAX).
    """
    kind = _COMPRESSORS.get(getattr(compression, "__name__", ""))
    if kind is None:
        return compression
    if backend == "torch":
        from horovod.torch import compression as torch_compression
        return getattr(torch_compression.Compression, kind)
    from horovod.jax import compression as jax_compression
    found = getattr(jax_compression.Compression, kind, None)
    if found is None:
        raise ValueError(f"Compression.{kind} is not available on Keras's {backend} backend "
                         f"(horovod.jax has Compression.none and Compression.fp16)")
    return found


def make_reduce(backend: str, op: int, compression: Any, prescale: float, postscale: float,
                process_set: ProcessSet, name: str) -> Callable[[list[Any]], list[Any]]:
    """``reduce(grads) -> grads`` averaged (``op``) across the ranks of ``process_set``."""
    comp = backend_compression(backend, compression)
    rop = ReduceOp(int(op))

    if backend == "torch":
        import horovod.torch as hvd_torch

        def reduce_torch(grads: list[Any]) -> list[Any]:
            return _per_dtype(grads, lambda gs, key: hvd_torch.grouped_allreduce(
                [g.contiguous() for g in gs], name=f"{name}.{key}", compression=comp, op=rop,
                prescale_factor=prescale, postscale_factor=postscale, process_set=process_set))

        return reduce_torch

    import horovod.jax as hvd_jax

    def reduce_jax(grads: list[Any]) -> list[Any]:
        return _per_dtype(grads, lambda gs, key: hvd_jax.grouped_allreduce(
            gs, name=f"{name}.{key}", compression=comp, op=rop, prescale_factor=prescale,
            postscale_factor=postscale, process_set=process_set))

    return reduce_jax


def _per_dtype(grads: list[Any], reduce: Callable[[list[Any], str], list[Any]]) -> list[Any]:
    out = list(grads)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(grads):
        if g is not None:
            groups.setdefault(str(g.dtype).replace("torch.", ""), []).append(i)
    for key, idx in sorted(groups.items()):
        for i, r in zip(idx, reduce([grads[i] for i in idx], key)):
            out[i] = r
    return out
