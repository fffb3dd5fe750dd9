"""``hvd.DistributedOptimizer`` for ``tf.compat.v1.train`` optimizers, and the dispatch to Keras."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Average, ReduceOp
from horovod.tensorflow._grads import (
    _var_key,
    check_op_args,
    make_allreduce_grads_fn,
    normalize_groups,
    reduce_except_local,
)
from horovod.tensorflow._keras_optimizer import create_distributed_optimizer
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a TF1 optimizer: ``compute_gradients`` averages the wrapped optimizer's gradients."""

    def __init__(self, optimizer: Any, name: str | None, use_locking: bool, device_dense: str,
                 device_sparse: str, compression: Any, sparse_as_dense: bool, op: int,
                 gradient_predivide_factor: float, groups: Any, backward_passes_per_step: int,
                 average_aggregated_gradients: bool, process_set: ProcessSet,
                 scale_local_gradients: bool) -> None:
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._process_set = process_set
        self._scale_local_gradients = scale_local_gradients
        self._local_vars: set[Any] = set()
        self._allreduce_grads = make_allreduce_grads_fn(
            name, device_dense, device_sparse, compression, sparse_as_dense, op, gradient_predivide_factor,
            groups, process_set, default_name=name + "_Allreduce")
        self._agg_helper = None
        if backward_passes_per_step > 1:
            if tf.executing_eagerly():
                raise ValueError("backward_passes_per_step > 1 is not supported yet with eager mode "
                                 "(tf.compat.v1 optimizers); use a Keras optimizer or a tf.function.")
            self._agg_helper = LocalGradientAggregationHelper(
                backward_passes_per_step, self._reduce, sparse_as_dense, average_aggregated_gradients)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local (not averaged across ranks)."""
        self._local_vars.add(_var_key(var))

    def _reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        return reduce_except_local(grads, variables, self._local_vars, self._allreduce_grads, self._process_set,
                                   self._scale_local_gradients)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """Compute gradients with the wrapped optimizer, then average them across ranks (one op)."""
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        if not gradients:
            return gradients
        grads, variables = zip(*gradients)
        if self._agg_helper is not None:
            avg = self._agg_helper.compute_gradients(list(grads), list(variables))
        else:
            avg = self._reduce(list(grads), list(variables))
        return list(zip(avg, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """Apply with the wrapped optimizer (every ``backward_passes_per_step``-th call)."""
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)
        return self._agg_helper.apply_gradients(
            lambda: self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name),
            global_step)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def _is_keras_optimizer(optimizer: Any) -> bool:
    import sys

    for mod in ("keras", "tf_keras"):
        m = sys.modules.get(mod)
        if m is None:
            continue
        opts = getattr(m, "optimizers", None)
        legacy = getattr(getattr(opts, "legacy", None), "Optimizer", None)
        classes = [getattr(opts, "Optimizer", None), legacy]
        if any(c is not None and isinstance(optimizer, c) for c in classes):
            return True
    return False


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap an optimizer so that gradients are averaged across ranks before they are applied.

    ``tf.compat.v1.train`` optimizers get a wrapper whose ``compute_gradients`` averages (use
    ``minimize`` or ``compute_gradients``/``apply_gradients`` as usual); Keras optimizers are
    wrapped as ``horovod.tensorflow.keras.DistributedOptimizer`` does (``_keras_optimizer``).

    Raises:
        ValueError: predivide with an op other than Average; Adasum with Keras; bad ``groups``;
            ``backward_passes_per_step > 1`` with a TF1 optimizer in eager mode.
    """
    keras_opt = _is_keras_optimizer(optimizer)
    op = check_op_args(op, gradient_predivide_factor, average_aggregated_gradients, keras=keras_opt)
    groups = normalize_groups(num_groups, groups)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if op == ReduceOp.ADASUM:  # upstream's delta optimizer (see _adasum_optimizer)
            if process_set.process_set_id != 0:
                raise NotImplementedError("Adasum does not support process sets yet")
            from horovod.tensorflow._adasum_optimizer import DistributedAdasumOptimizer

            return DistributedAdasumOptimizer(optimizer, name, use_locking, device_dense, device_sparse,
                                              compression, backward_passes_per_step)
        return _DistributedOptimizer(optimizer, name, use_locking, device_dense, device_sparse, compression,
                                     sparse_as_dense, op, gradient_predivide_factor, groups,
                                     backward_passes_per_step, average_aggregated_gradients, process_set,
                                     scale_local_gradients)
    if keras_opt:  # what horovod.tensorflow.keras.DistributedOptimizer returns
        return create_distributed_optimizer(
            tf.keras, optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
            gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, groups,
            process_set, scale_local_gradients)
    raise ValueError(f"Provided optimizer doesn't inherit from either legacy TensorFlow or Keras "
                     f"optimizer: {type(optimizer).__name__}")
