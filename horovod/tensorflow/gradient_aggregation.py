"""Local gradient aggregation (``backward_passes_per_step > 1``) for TF1 graphs, tf.function and eager.

Gradients are summed into non-trainable local variables on every call; on every k-th call the sums
are allreduced (divided by k when ``average_aggregated_gradients``) and applied, and the sums reset.
On the other calls ``apply_gradients`` only advances the step counter (``global_step`` or the Keras
optimizer's ``iterations``). Every rank takes the same branch, since the counters agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["LocalGradientAggregationHelper"]


def _is_tf1_graph() -> bool:
    g = tf.compat.v1.get_default_graph()
    return not tf.executing_eagerly() and not getattr(g, "building_function", False)


def _local_variable(shape: Any, dtype: Any, name: str) -> tf.Variable:
    zeros = np.zeros(shape, dtype=tf.as_dtype(dtype).as_numpy_dtype)
    if _is_tf1_graph():
        return tf.compat.v1.Variable(zeros, trainable=False, name=name,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
    # Created once, outside any tf.function being traced (like optimizer slots).
    with tf.init_scope():
        return tf.Variable(zeros, trainable=False, name=name)


class LocalGradientAggregationHelper:
    """Accumulate gradients over ``backward_passes_per_step`` calls before one allreduce."""

    def __init__(self, backward_passes_per_step: int, allreduce_func: Callable[..., list[Any]],
                 sparse_as_dense: bool, average_aggregated_gradients: bool) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.allreduce_grads = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.counter: Any = None
        self.accumulators: list[Any] | None = None

    def _build(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        self.counter = _local_variable((), tf.int32, "hvd_aggregation_counter")
        accs: list[Any] = []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                accs.append(None)
                continue
            shape = tuple(v.shape if v is not None else g.shape)
            accs.append(_local_variable(shape, g.dtype, f"hvd_aggregated_grad_{i}"))
        self.accumulators = accs

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Accumulate ``grads``; return the allreduced sums on the k-th call (else the local sums).

        Raises:
            ValueError: a gradient is ``tf.IndexedSlices`` and ``sparse_as_dense`` is False.
        """
        grads = list(grads)
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                                     "and `sparse_as_dense` is False.")
                grads[i] = tf.convert_to_tensor(g)
        if self.accumulators is None:
            self._build(grads, variables)
        accumulators = self.accumulators
        assert accumulators is not None
        updates = [a.assign_add(g, read_value=False) for a, g in zip(accumulators, grads)
                   if a is not None]
        with tf.control_dependencies([] if tf.executing_eagerly() else updates):
            count = tf.convert_to_tensor(self.counter.assign_add(1, read_value=True))
        k = self.backward_passes_per_step
        live = [i for i, a in enumerate(accumulators) if a is not None]

        def reduce_branch() -> list[Any]:
            values = [accumulators[i].read_value() for i in live]
            reduced = self.allreduce_grads(values, [variables[i] for i in live])
            if self.average_aggregated_gradients:
                reduced = [r / tf.cast(k, r.dtype) for r in reduced]
            return reduced

        def local_branch() -> list[Any]:
            return [tf.identity(accumulators[i].read_value()) for i in live]

        if tf.executing_eagerly():
            out = reduce_branch() if int(count) >= k else local_branch()
        else:
            out = tf.cond(tf.greater_equal(count, k), reduce_branch, local_branch)
            out = list(out) if isinstance(out, list | tuple) else [out]
        res: list[Any] = [None] * len(grads)
        for i, r in zip(live, out):
            res[i] = r
        return res

    def apply_gradients(self, apply_fn: Callable[[], Any], step_counter: Any = None) -> Any:
        """Run ``apply_fn`` on the k-th call and reset the sums; otherwise advance ``step_counter``."""
        k = self.backward_passes_per_step

        def do_apply() -> Any:
            result = apply_fn()
            deps = [] if tf.executing_eagerly() or result is None else [result]
            with tf.control_dependencies(deps):
                resets = [a.assign(tf.zeros_like(a), read_value=False)
                          for a in (self.accumulators or []) if a is not None]
                resets.append(self.counter.assign(0, read_value=False))
            return tf.no_op() if tf.executing_eagerly() else tf.group(*resets)

        def skip() -> Any:
            if step_counter is None:
                return tf.no_op()
            one = tf.cast(1, step_counter.dtype)
            try:
                op = step_counter.assign_add(one, read_value=False)
            except TypeError:  # Keras 3 variables take no read_value
                op = step_counter.assign_add(one)
                op = None if tf.executing_eagerly() else getattr(op, "op", op)
            return tf.no_op() if tf.executing_eagerly() or op is None else tf.group(op)

        if tf.executing_eagerly():
            return do_apply() if int(self.counter.numpy()) >= k else skip()
        return tf.cond(tf.greater_equal(self.counter.read_value(), k), do_apply, skip)
