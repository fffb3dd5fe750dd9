"""``DistributedOptimizer``: an optax ``GradientTransformation`` that averages gradients across ranks."""

from __future__ import annotations

from typing import Any

import optax

from horovod.common.basics import size
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Adasum, Average, ReduceOp, Sum
from horovod.jax.compression import Compression
from horovod.jax.functions import allreduce_tree

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer: optax.GradientTransformation, op: int = Average,  # noqa: N802
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         gradient_predivide_factor: float = 1.0, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> optax.GradientTransformation:
    """Wrap an optax transformation so its ``update`` first reduces the gradient pytree across ranks.

    ``update(grads, state, params)`` allreduces every gradient leaf as one grouped (fused)
    operation per dtype (``op``: Average by default, Sum, or Adasum), then calls the wrapped
    ``update``. It runs eagerly or inside a jitted train step (the allreduce compiles to an
    ordered host callback). With ``backward_passes_per_step=k`` the gradients of k calls are
    accumulated locally (their mean, as ``optax.MultiSteps``) and reduced and applied on every
    k-th call; the other calls return zero updates. ``gradient_predivide_factor=f`` divides by f
    before the sum and by ``size/f`` after it (Average only), as ``horovod.torch`` does.

    Raises:
        ValueError: ``op`` is not Average, Sum or Adasum; a predivide factor with an op other
            than Average; ``backward_passes_per_step`` < 1.
    """
    rop = ReduceOp(int(op))
    if rop not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer: op must be hvd.Average, hvd.Sum or hvd.Adasum, got {rop.name}.")
    if gradient_predivide_factor != 1.0 and rop != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    key = name or "DistributedOptimizer"

    def reduce(grads: Any) -> Any:
        if gradient_predivide_factor != 1.0:
            n = (process_set.size() if process_set is not global_process_set else None) or size()
            return allreduce_tree(grads, Sum, key, compression, 1.0 / gradient_predivide_factor,
                                  gradient_predivide_factor / n, process_set)
        return allreduce_tree(grads, rop, key, compression, process_set=process_set)

    def init_fn(params: Any) -> Any:
        return optimizer.init(params)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return optimizer.update(reduce(updates), state, params, **extra)

    inner = optax.GradientTransformation(init_fn, update_fn)
    if int(backward_passes_per_step) == 1:
        return inner
    return optax.MultiSteps(inner, every_k_schedule=int(backward_passes_per_step)).gradient_transformation()
