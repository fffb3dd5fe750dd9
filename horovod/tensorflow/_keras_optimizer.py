"""The TensorFlow side of the Keras distributed optimizers (``horovod._keras.optimizer``), used by
``horovod.tensorflow``, ``horovod.tensorflow.keras`` and ``horovod.keras`` on the TensorFlow backend.

``tensorflow_reduction`` builds a distributed optimizer's gradient reduction with TensorFlow's ops
(``_grads``; local layers kept out, ``backward_passes_per_step`` aggregated locally). The functions
here are ``horovod._keras.optimizer``'s with that reduction filled in.

Layering (one way, no cycles): ``horovod._keras.{backends,optimizer}`` (no TensorFlow) <- this module
and the rest of ``horovod.tensorflow`` <- ``horovod._keras.{helpers,callbacks,elastic}`` <-
``horovod.tensorflow.keras``, ``horovod.keras``. It lives in the TensorFlow package because
``horovod.tensorflow.DistributedOptimizer`` hands Keras optimizers to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from horovod._keras import optimizer as _neutral
from horovod._keras.optimizer import (
    disable_jit_for,
    distributed_class,
    is_distributed,
    keras_backend,
    optimizer_backend,
)
from horovod.tensorflow._grads import _var_key, make_allreduce_grads_fn, reduce_except_local
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper

__all__ = ["create_distributed_optimizer", "distributed_class", "is_distributed", "disable_jit_for",
           "keras_backend", "optimizer_backend", "HvdConfig", "tensorflow_reduction"]


def tensorflow_reduction(cfg: _neutral.HvdConfig) -> tuple[Callable[[list[Any], list[Any]], list[Any]], Any,
                                                          Callable[[Any], Any]]:
    """``(reduce, aggregation helper or None, var_key)`` of ``cfg`` with TensorFlow's ops."""
    allreduce_grads = make_allreduce_grads_fn(
        cfg.name, cfg.device_dense, cfg.device_sparse, cfg.compression, cfg.sparse_as_dense, cfg.op,
        cfg.gradient_predivide_factor, cfg.groups, cfg.process_set, default_name=cfg.name + "_Allreduce")

    def reduce(grads: list[Any], variables: list[Any]) -> list[Any]:
        return reduce_except_local(grads, variables, cfg.local_vars, allreduce_grads, cfg.process_set,
                                   cfg.scale_local_gradients)

    agg = None
    if cfg.backward_passes_per_step > 1:
        agg = LocalGradientAggregationHelper(cfg.backward_passes_per_step, reduce, cfg.sparse_as_dense,
                                             cfg.average_aggregated_gradients)
    return reduce, agg, _var_key


def HvdConfig(*args: Any, **kwargs: Any) -> _neutral.HvdConfig:  # noqa: N802 - was the class
    """``horovod._keras.optimizer.HvdConfig`` with TensorFlow's reduction."""
    return _neutral.HvdConfig(*args, tensorflow_reduction=tensorflow_reduction, **kwargs)


def create_distributed_optimizer(keras: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """``horovod._keras.optimizer.create_distributed_optimizer`` with TensorFlow's reduction."""
    return _neutral.create_distributed_optimizer(keras, optimizer, *args, tensorflow_reduction=tensorflow_reduction,
                                                 **kwargs)
